"""JSON lines -> prefix.bin/.idx: one document per line, tokenized by a local tokenizer.

Lines are read in the main process and sent to worker processes in chunks; Pool.imap
returns the chunks in input order, so the output is identical for any number of workers.
Every document gets EOS appended (unless append_eos=False), as PaddleNLP's
create_pretraining_data.py does. Blank lines are skipped.

By default each text is cleaned exactly as PaddleNLP's tool does before tokenizing
(llm/tools/preprocess/create_pretraining_data.py, `Converter.encode` and
`remove_repeated_chars`): a run of more than `max_repeated_len` (100) equal characters
(newlines excepted: the pattern is `(.)\1{100,}`) becomes one character, then leading and
trailing whitespace is stripped, and a text with no tokens left is no document at all. Given
the same tokenizer and input, the .bin/.idx are then byte-identical to the tool's
(tests/test_tokenizer_and_prepare.py). `clean_text=False` tokenizes every text as it is.
One difference stays: a literal special-token string in the text ("</s>") is tokenized as
characters here, as that one token by PaddleNLP's tokenizers.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import time

import numpy as np

from llm_pretrain.data.indexed import IndexedWriter, best_fitting_dtype
from llm_pretrain.errors import UsageError
from llm_pretrain.tokenizer import load_tokenizer

# Set in each worker by _init_worker (and in the main process for workers=1).
_worker = {}


def repeated_characters(max_repeated_len: int) -> re.Pattern:
    """PaddleNLP's `remove_repeated_chars` pattern: a character followed by max_repeated_len or more copies."""
    return re.compile(r"(.)\1{" + str(max_repeated_len) + ",}")


def _init_worker(tokenizer_path: str, json_key: str, eos_id: int | None, dtype: str,
                 max_repeated_len: int | None) -> None:
    _worker.update(tokenizer=load_tokenizer(tokenizer_path, key="--tokenizer"), json_key=json_key,
                   eos_id=eos_id, dtype=np.dtype(dtype),
                   repeated=None if max_repeated_len is None else repeated_characters(max_repeated_len))


def _encode_chunk(chunk: tuple[str, int, list[str]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(path, number of the first line, lines) -> (tokens back to back, tokens per document, bytes read)."""
    path, first_line, lines = chunk
    key = _worker["json_key"]
    texts = []
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise UsageError(f"--input: {path} line {number}: invalid JSON ({getattr(error, 'msg', error)})") from None
        if not isinstance(record, dict) or key not in record:
            found = f"keys: {', '.join(list(record)[:5])}" if isinstance(record, dict) else type(record).__name__
            raise UsageError(f"--input: {path} line {number}: no key '{key}' ({found}); choose it with --json_key")
        if not isinstance(record[key], str):
            raise UsageError(f"--input: {path} line {number}: '{key}' is {type(record[key]).__name__}, not text")
        texts.append(record[key])
    repeated = _worker["repeated"]
    if repeated is not None:  # PaddleNLP's cleaning; its tool writes nothing for a text without tokens
        texts = [repeated.sub(r"\1", text).strip() for text in texts]
    documents = _worker["tokenizer"].encode_batch(texts) if texts else []
    if repeated is not None:
        documents = [ids for ids in documents if ids]
    # One pass over all ids (np.fromiter over the chained lists), not an array per document:
    # converting was a third of the tokenizer's own time.
    sizes = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
    ids = np.fromiter(itertools.chain.from_iterable(documents), dtype=np.int64, count=int(sizes.sum()))
    if _worker["eos_id"] is not None:  # EOS after each document
        sizes += 1
        ends = np.cumsum(sizes) - 1
        tokens = np.full(int(sizes.sum()), _worker["eos_id"], dtype=np.int64)
        body = np.ones(len(tokens), dtype=bool)
        body[ends] = False
        tokens[body] = ids
    else:
        tokens = ids
    nbytes = sum(len(line.encode("utf-8")) for line in lines)
    return tokens.astype(_worker["dtype"]), sizes, nbytes


def _read_chunks(paths: list[str], chunk_size: int):
    for path in paths:
        lines, first = [], 1
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    lines.append(line)
                    if len(lines) == chunk_size:
                        yield path, first, lines
                        lines, first = [], number + 1
        except UnicodeDecodeError as error:
            line = first + len(lines)
            raise UsageError(f"--input: {path} near line {line} is not UTF-8 text ({error.reason})") from None
        if lines:
            yield path, first, lines


def prepare_jsonl(inputs: list[str], tokenizer: str, output_prefix: str, json_key: str = "text",
                  workers: int = 1, append_eos: bool = True, chunk_size: int = 256,
                  progress: bool | None = None, clean_text: bool = True, max_repeated_len: int = 100) -> dict:
    """Tokenize JSON-lines files into output_prefix.bin/.idx; returns {documents, tokens, seconds, ...}.

    clean_text: PaddleNLP's cleaning (runs of more than max_repeated_len equal characters cut to one,
    whitespace stripped, texts without tokens dropped); False tokenizes every text as it is.

    progress: a tqdm bar on stderr (None: only when stderr is a terminal).
    Bad input raises UsageError; the output files then do not appear.
    """
    start = time.time()
    if not inputs:
        raise UsageError("--input: give at least one JSON-lines file")
    for path in inputs:
        if not os.path.isfile(path):
            raise UsageError(f"--input: {path} does not exist or is not a file")
    if workers < 1 or chunk_size < 1:
        raise UsageError(f"--workers/--chunk_size: must be at least 1 (got {workers}, {chunk_size})")
    if max_repeated_len < 1:
        raise UsageError(f"--max_repeated_len: must be at least 1 (got {max_repeated_len})")
    tok = load_tokenizer(tokenizer, key="--tokenizer")
    if append_eos and tok.eos_token_id is None:
        raise UsageError(f"--tokenizer: {tok.source} has no end-of-text token; "
                         "use a tokenizer with one or pass --no_append_eos")
    dtype = np.dtype(best_fitting_dtype(tok.vocab_size))
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)

    from tqdm import tqdm

    init_args = (tokenizer, json_key, tok.eos_token_id if append_eos else None, dtype.str,
                 max_repeated_len if clean_text else None)
    total_bytes = sum(os.path.getsize(path) for path in inputs)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None if progress is None
               else not progress, dynamic_ncols=True)
    chunks = _read_chunks(inputs, chunk_size)
    pool = None
    try:
        with IndexedWriter(output_prefix, dtype) as writer:
            if workers == 1:
                _init_worker(*init_args)
                results = map(_encode_chunk, chunks)
            else:
                # Each process has one tokenizer and does its own work; Rust-side threads would only compete.
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=init_args)
                results = pool.imap(_encode_chunk, chunks)  # ordered: output independent of `workers`
            for tokens, sizes, nbytes in results:
                writer.add_documents(tokens, sizes)
                bar.update(nbytes)
            if writer.num_documents == 0:
                raise UsageError(f"--input: no documents in {', '.join(inputs)} (every line is blank)")
            documents, tokens = writer.num_documents, writer.num_tokens
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return {"prefix": output_prefix, "documents": documents, "tokens": tokens, "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "seconds": time.time() - start}
