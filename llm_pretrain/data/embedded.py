"""The embedded default corpus: real English text that is already on every machine.

The docstrings of the Python standard library (modules, classes, functions; parsed with
`ast` from the installed .py files, nothing imported or downloaded) in sorted file order,
one document each, headed by the object's name and signature. A byte-fallback BPE
sentencepiece model (vocab 512, EOS id 2) is trained on them, then the documents are
tokenized with the same code as scripts/prepare_data.py. About 2 MB of text, 7.4k
documents and 1.1M tokens on Python 3.11; about 3 seconds. Everything is deterministic for
a given Python version (sentencepiece runs single-threaded with a fixed seed).

    <out_dir>/corpus.jsonl                                the text, {"text": ...} per line
    <out_dir>/tokenizer/tokenizer.model                   sentencepiece (+ a copy and tokenizer_config.json
                                                          for PaddleNLP's AutoTokenizer)
    <out_dir>/data/embedded_text_document.{bin,idx}       the tokens
    <out_dir>/DONE.json                                   completion marker with the counts
"""

from __future__ import annotations

import ast
import io
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "data", "embedded")
PREFIX_NAME = "embedded_text_document"
VOCAB_SIZE = 512
SEED = 1234
# Tests, GUI demos, codecs tables and vendored code: little prose, much boilerplate.
SKIPPED_DIRS = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip", "encodings",
                "site-packages", "dist-packages", "__pycache__"}


# ----------------------------------------------------------------------------- text
def stdlib_python_files() -> list[tuple[str, str]]:
    """(module name, path) of the standard library's .py files, sorted by path."""
    root = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith(("config-", "_"))]
        for name in files:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(directory, name), root))
    modules = []
    for relative in sorted(found):
        parts = relative[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append((".".join(parts), os.path.join(root, relative)))
    return modules


def _docstrings(scope: str, body: list):
    """One document per documented class and function in `body`; not inside function bodies."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            name = f"{scope}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                yield f"class {name}\n\n{doc}"
            yield from _docstrings(name, node.body)  # methods right after their class
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield f"def {scope}.{node.name}({ast.unparse(node.args)})\n\n{doc}"


def stdlib_documents() -> list[str]:
    """The corpus text: deterministic for a given Python version."""
    documents = []
    for module, path in stdlib_python_files():
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are templates or other encodings
        doc = ast.get_docstring(tree)
        if doc:
            documents.append(f"Module {module}\n\n{doc}")
        documents.extend(_docstrings(module, tree.body))
    return documents


# ----------------------------------------------------------------------------- tokenizer
def train_sentencepiece(documents: list[str], model_file: str, vocab_size: int = VOCAB_SIZE) -> None:
    """A small BPE model that can encode any text (byte fallback) and decodes it back exactly."""
    import sentencepiece as spm

    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.set_random_generator_seed(SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995,  # rare characters become bytes, not <unk>
        normalization_rule_name="identity", remove_extra_whitespaces=False,  # keep text as is: exact round trip
        allow_whitespace_only_pieces=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,  # LLaMA's ids
        num_threads=1, minloglevel=2,  # one thread: the same model every time
    )
    with open(model_file, "wb") as f:
        f.write(model.getvalue())


# ----------------------------------------------------------------------------- build
def _paths(out_dir: str) -> dict:
    return {
        "input_dir": os.path.join(out_dir, "data"),
        "tokenizer": os.path.join(out_dir, "tokenizer"),
        "prefix": os.path.join(out_dir, "data", PREFIX_NAME),
    }


def _complete(out_dir: str) -> dict | None:
    """The marker's contents if the corpus is complete, else None."""
    paths = _paths(out_dir)
    needed = [os.path.join(out_dir, "DONE.json"), os.path.join(paths["tokenizer"], "tokenizer.model"),
              paths["prefix"] + ".bin", paths["prefix"] + ".idx"]
    if not all(os.path.isfile(path) for path in needed):
        return None
    try:
        with open(needed[0], encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure_embedded_corpus(out_dir: str = DEFAULT_OUT_DIR) -> dict:
    """Build the embedded corpus in out_dir unless DONE.json says it is there; return where it is.

    Returns {"input_dir", "tokenizer", "prefix", "documents", "tokens", "vocab_size"}. The files are
    built in a private staging directory and renamed into place, the marker last, so an interrupted
    or concurrent build never leaves a corpus that looks complete but is not.
    """
    out_dir = os.path.abspath(out_dir)
    done = _complete(out_dir)
    if done is None:
        os.makedirs(out_dir, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".build-", dir=out_dir)
        try:
            done = _build(staging)
            for relative in ("corpus.jsonl", "tokenizer/tokenizer.model", "tokenizer/sentencepiece.bpe.model",
                             "tokenizer/tokenizer_config.json",
                             f"data/{PREFIX_NAME}.bin", f"data/{PREFIX_NAME}.idx", "DONE.json"):
                target = os.path.join(out_dir, relative)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(os.path.join(staging, relative), target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {**_paths(out_dir), "documents": done["documents"], "tokens": done["tokens"],
            "vocab_size": done["vocab_size"]}


def _build(staging: str) -> dict:
    from llm_pretrain.data.prepare import prepare_jsonl

    start = time.time()
    documents = stdlib_documents()
    corpus = os.path.join(staging, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    tokenizer_dir = os.path.join(staging, "tokenizer")
    os.makedirs(tokenizer_dir)
    train_sentencepiece(documents, os.path.join(tokenizer_dir, "tokenizer.model"))
    # PaddleNLP's LlamaTokenizer looks for this name: with the config below, AutoTokenizer opens the
    # directory too and gives the same ids.
    shutil.copyfile(os.path.join(tokenizer_dir, "tokenizer.model"),
                    os.path.join(tokenizer_dir, "sentencepiece.bpe.model"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False}, f, indent=2)
    # Text as is (no PaddleNLP cleaning): the corpus, and every test's data, stays what it has always been.
    result = prepare_jsonl([corpus], tokenizer_dir, os.path.join(staging, "data", PREFIX_NAME), progress=False,
                           clean_text=False)
    summary = {"documents": result["documents"], "tokens": result["tokens"], "vocab_size": result["vocab_size"],
               "text_bytes": os.path.getsize(corpus), "python": sys.version.split()[0],
               "seconds": round(time.time() - start, 2)}
    with open(os.path.join(staging, "DONE.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary
