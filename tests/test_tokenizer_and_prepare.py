"""Local tokenizers (sentencepiece, tokenizer.json, vocab.json + merges.txt) and scripts/prepare_data.py."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from llm_pretrain.data import IndexedDataset, best_fitting_dtype, prepare_jsonl
from llm_pretrain.errors import UsageError
from llm_pretrain.data.tokenizer import load_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARE = os.path.join(REPO_ROOT, "scripts", "prepare_data.py")
TEXTS = [
    "Return the sum of a and b.",
    "Open the file and return a stream.",
    "The quick brown fox jumps over the lazy dog.",
    "Split the string at the first occurrence of sep, and return a 3-tuple.",
    "Raise ValueError when the value is not found.",
    "",
    "Ünïcödé text and numbers 12345 are fine too.",
] * 20


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    """One small tokenizer of each kind, trained offline in well under a second."""
    import sentencepiece as spm
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    (root / "sp").mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_prefix=str(root / "sp" / "tokenizer"), vocab_size=400,
        hard_vocab_limit=False, model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    (root / "hf").mkdir()
    bpe.save(str(root / "hf" / "tokenizer.json"))
    (root / "bpe").mkdir()
    bpe.save_model(str(root / "bpe"))  # vocab.json + merges.txt
    return root


@pytest.mark.parametrize("relative, eos", [
    ("sp", 2), ("sp/tokenizer.model", 2), ("hf", 0), ("hf/tokenizer.json", 0), ("bpe", 0), ("bpe/vocab.json", 0),
])
def test_load_each_kind(tokenizers_dir, relative, eos):
    tok = load_tokenizer(str(tokenizers_dir / relative))
    assert tok.eos_token_id == eos
    assert 256 <= tok.vocab_size <= 400
    for text in TEXTS[:7] + ["something entirely new: 数据 ∑"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert eos not in ids  # encode adds no special tokens
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]


def test_eos_from_tokenizer_config(tokenizers_dir, tmp_path):
    import shutil

    shutil.copy(tokenizers_dir / "hf" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert load_tokenizer(str(tmp_path)).eos_token_id == 0


def test_tokenizer_errors(tokenizers_dir, tmp_path):
    with pytest.raises(UsageError, match=r"^tokenizer_name_or_path: .*nowhere does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))
    looked_for = (r"looked for tokenizer\.model or \*\.model \(sentencepiece\), tokenizer\.json, "
                  r"or vocab\.json \+ merges\.txt")
    with pytest.raises(UsageError, match=r"^tokenizer_name_or_path: no tokenizer in .*" + looked_for):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"definitely not a protobuf")
    with pytest.raises(UsageError, match=r"^tokenizer_name_or_path: cannot load sentencepiece tokenizer"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.model").unlink()
    (tmp_path / "a.model").write_bytes(b"x")
    (tmp_path / "b.model").write_bytes(b"x")
    with pytest.raises(UsageError, match=r"several sentencepiece models \(a\.model, b\.model\)"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(UsageError, match=r"^--tokenizer: .*vocab\.json needs both"):
        only_vocab = tmp_path / "v"
        only_vocab.mkdir()
        (only_vocab / "vocab.json").write_text("{}")
        load_tokenizer(str(only_vocab / "vocab.json"), key="--tokenizer")
    with pytest.raises(UsageError, match=r"^tokenizer_name_or_path: not set"):
        load_tokenizer("")


def test_best_fitting_dtype():
    assert best_fitting_dtype(512) == np.uint16 and best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32 and best_fitting_dtype(152064) == np.int32


@pytest.mark.parametrize("kind", ["sp", "sp without the buffer call", "hf", "bpe"])
def test_encode_batch_flat_equals_encode(tokenizers_dir, kind):
    """The preparation's path: ids back to back and ids per text, EOS after each text when asked,
    empty texts included; sentencepiece's fast buffer call and its public fallback agree."""
    tok = load_tokenizer(str(tokenizers_dir / kind.split()[0]))
    if kind == "sp without the buffer call":
        class PublicOnly:  # a sentencepiece version without SentencePieceProcessor._EncodeAsBufferBatch
            _processor = object()
            encode = tok._sp.encode

        tok._sp = PublicOnly()
    texts = ["", *TEXTS[:7], "", "something entirely new: 数据 ∑", ""]
    expected = [tok.encode(text) for text in texts]
    for append_eos in (False, True):
        ids, sizes = tok.encode_batch_flat(texts, 1, append_eos)
        documents = [ids + [tok.eos_token_id] if append_eos else ids for ids in expected]
        assert ids.dtype == np.int32 and list(sizes) == [len(d) for d in documents]
        assert ids.tolist() == [i for d in documents for i in d]
    ids, sizes = tok.encode_batch_flat([], 1, True)
    assert ids.size == sizes.size == 0


# ----------------------------------------------------------------------------- prepare_data
@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(TEXTS):
            f.write(json.dumps({"id": i, "text": f"{i}: {text}"}, ensure_ascii=False) + "\n")
        f.write("\n")  # blank lines are skipped
    return path


def run_prepare(*args, cwd):
    return subprocess.run([sys.executable, PREPARE, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_prepare_data_two_workers_equals_one(tokenizers_dir, jsonl, tmp_path):
    # From another directory, with a relative output prefix: the script finds its own package.
    two = run_prepare("--input", jsonl, "--tokenizer", tokenizers_dir / "sp", "--output_prefix",
                      "out/two_text_document", "--workers", 2, "--chunk_bytes", 97, cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert f"{len(TEXTS)} documents" in two.stdout.strip().splitlines()[-1]
    one = prepare_jsonl([str(jsonl)], str(tokenizers_dir / "sp"), str(tmp_path / "one"), workers=1, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / "out" / f"two_text_document{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()

    data = IndexedDataset(str(tmp_path / "out" / "two_text_document"))
    tok = load_tokenizer(str(tokenizers_dir / "sp"))
    assert data.dtype == np.uint16 and data.num_documents == len(TEXTS) == one["documents"]
    for i, text in enumerate(TEXTS):
        assert data[i][-1] == tok.eos_token_id
        assert list(data[i][:-1]) == tok.encode(f"{i}: {text}")


def test_prepare_data_options(tokenizers_dir, jsonl, tmp_path):
    result = prepare_jsonl([str(jsonl), str(jsonl)], str(tokenizers_dir / "hf"), str(tmp_path / "x"),
                           append_eos=False, progress=False)
    data = IndexedDataset(str(tmp_path / "x"))
    tok = load_tokenizer(str(tokenizers_dir / "hf"))
    assert result["documents"] == data.num_documents == 2 * len(TEXTS)
    assert list(data[len(TEXTS) + 3]) == tok.encode(f"3: {TEXTS[3]}")  # no EOS; second file after the first
    (tmp_path / "body.jsonl").write_text('{"body": "hello there"}\n')
    prepare_jsonl([str(tmp_path / "body.jsonl")], str(tokenizers_dir / "bpe"), str(tmp_path / "y"),
                  json_key="body", progress=False)
    assert list(IndexedDataset(str(tmp_path / "y"))[0]) == tok.encode("hello there") + [0]


@pytest.mark.parametrize("content, pattern", [
    ('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n', r"line 3: invalid JSON"),
    ('{"text": "fine"}\n{"title": "no text"}\n', r"line 2: no key 'text' \(keys: title\); choose it with --json_key"),
    ('{"text": 5}\n', r"line 1: 'text' is int, not text"),
    ('["text"]\n', r"line 1: no key 'text'"),
    ("\n\n", r"no documents in"),
])
def test_prepare_data_bad_input_is_one_line_exit_2(tokenizers_dir, tmp_path, content, pattern):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = run_prepare("--input", bad, "--tokenizer", tokenizers_dir / "sp", "--output_prefix", tmp_path / "out",
                         "--workers", 2, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --input: ") and re.search(pattern, lines[0])
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]  # nothing half-written


def test_prepare_data_missing_file_and_tokenizer(tokenizers_dir, jsonl, tmp_path):
    missing = run_prepare("--input", tmp_path / "nope.jsonl", "--tokenizer", tokenizers_dir / "sp",
                          "--output_prefix", tmp_path / "o", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --input: ") and "nope.jsonl" in missing.stderr
    for tokenizer, pattern in ((tmp_path, "error: --tokenizer: no tokenizer in"),
                               (tmp_path / "gone", "error: --tokenizer: ")):
        result = run_prepare("--input", jsonl, "--tokenizer", tokenizer, "--output_prefix", tmp_path / "o",
                             cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.startswith(pattern)
        assert len(result.stderr.strip().splitlines()) == 1
    usage = run_prepare("--input", jsonl, cwd=tmp_path)
    assert usage.returncode == 2 and usage.stderr.startswith("error: the following arguments are required")


def test_prepare_requires_eos_unless_disabled(tmp_path, jsonl):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=60, hard_vocab_limit=False, eos_id=-1, minloglevel=2,
                                   num_threads=1)
    with pytest.raises(UsageError, match=r"^--tokenizer: .*no end-of-text token; .*--no_append_eos"):
        prepare_jsonl([str(jsonl)], str(tmp_path / "noeos.model"), str(tmp_path / "o"), progress=False)
    result = prepare_jsonl([str(jsonl)], str(tmp_path / "noeos.model"), str(tmp_path / "o"), append_eos=False,
                           progress=False)
    assert result["documents"] == len(TEXTS)


# ----------------------------------------------------------------------------- identical to PaddleNLP's tool
# Whitespace at either end, runs of repeated characters below, at and above PaddleNLP's limit (a run
# of more than 100 becomes one character; newlines never do), texts that clean to nothing.
MESSY_TEXTS = [
    "  Leading and trailing spaces.  ", "\n\tTabs and newlines around\n\n", "no change at all",
    "a" * 101 + " one hundred and one a", "b" * 100 + " exactly one hundred b (kept)", "x" + "=" * 250 + "x",
    "long " + "ü" * 120 + " multi-byte run", "inner\n" + "\n" * 150 + "newlines stay", "-" * 300, "   ", "",
    " \u3000 ideographic space  ", "mixed" + "!" * 99 + "?" * 101 + " end ",
] * 3


def paddlenlp_create_pretraining_data(jsonl: str, tokenizer_dir: str, prefix: str, max_repeated_len: int = 100):
    """PaddleNLP 2.8.1's llm/tools/preprocess/create_pretraining_data.py with --append_eos, step by step.

    That tool is not part of the paddlenlp wheel; this runs its main() and Converter.encode on the
    paddlenlp pieces they call (AutoTokenizer, indexed_dataset.make_builder): per line json.loads,
    `remove_repeated_chars` (re.sub(r"(.)\\1{100,}", r"\\1", text)), IdentitySplitter, `sentence.strip()`,
    tokenizer.tokenize + convert_tokens_to_ids, a document only if it has tokens, EOS appended;
    uint16 below 65535 tokens else int32.
    """
    import re as regex

    from paddlenlp.data import indexed_dataset
    from paddlenlp.transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    builder = indexed_dataset.make_builder(prefix + ".bin", "mmap", np.uint16 if tokenizer.vocab_size < 2**16 - 1
                                           else np.int32)
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            text = regex.sub(r"(.)\1{" + str(max_repeated_len) + ",}", r"\1", text)
            ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text.strip()))
            if not ids:
                continue
            builder.add_item(ids + [tokenizer.eos_token_id])
            builder.end_document()
    builder.finalize(prefix + ".idx")


def test_prepare_is_byte_identical_to_paddlenlp_tool(embedded_corpus, tmp_path):
    pytest.importorskip("paddlenlp")
    tokenizer = embedded_corpus["tokenizer"]  # sentencepiece + LlamaTokenizer config: paddlenlp opens it too
    path = tmp_path / "messy.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in MESSY_TEXTS + TEXTS[:7]:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    paddlenlp_create_pretraining_data(str(path), tokenizer, str(tmp_path / "paddlenlp"))
    ours = prepare_jsonl([str(path)], tokenizer, str(tmp_path / "ours"), workers=2, chunk_bytes=300, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"paddlenlp{ext}").read_bytes()
    lines = len(MESSY_TEXTS) + 7
    assert ours["documents"] <= lines - 2 * 3  # "   " and "" are no documents

    # The switch keeps every text as it is: more tokens, one document per line, different bytes.
    kept = prepare_jsonl([str(path)], tokenizer, str(tmp_path / "kept"), clean_text=False, progress=False)
    assert kept["documents"] == lines and kept["tokens"] > ours["tokens"]
    tok = load_tokenizer(tokenizer)
    assert list(IndexedDataset(str(tmp_path / "kept"))[3][:-1]) == tok.encode(MESSY_TEXTS[3])
    assert list(IndexedDataset(str(tmp_path / "ours"))[3][:-1]) == tok.encode("a one hundred and one a")


def test_prepare_cleaning_options_on_the_command_line(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"text": "  " + "z" * 12 + "  "}) + "\n")
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS + ["z" * 12]), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=80, hard_vocab_limit=False, eos_id=2, minloglevel=2, num_threads=1)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    for extra, text in ((["--max_repeated_len", "5"], "z"), ([], "z" * 12), (["--keep_text_as_is"], "  " + "z" * 12 + "  ")):
        result = run_prepare("--input", path, "--tokenizer", tmp_path / "sp.model", "--output_prefix", tmp_path / "o",
                             *extra, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert list(IndexedDataset(str(tmp_path / "o"))[0][:-1]) == tok.encode(text)
    bad = run_prepare("--input", path, "--tokenizer", tmp_path / "sp.model", "--output_prefix", tmp_path / "o",
                      "--max_repeated_len", "0", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --max_repeated_len: must be at least 1")


# ----------------------------------------------------------------------------- the fast paths equal the plain ones
@pytest.mark.parametrize("max_repeated_len", [100, 37, 7, 4, 3, 2, 1])
def test_repeated_characters_prefilter_equals_the_full_rule(max_repeated_len):
    """RepeatedCharacters runs PaddleNLP's re.sub only on texts whose sample text[::stride] holds 4 equal
    characters in a row: runs one shorter, as long as and longer than the limit, at every offset
    modulo the stride, of letters, newlines (never cut), spaces and multi-byte characters, give
    exactly re.sub's result; so do random texts full of runs."""
    import random

    from llm_pretrain.data.prepare import RepeatedCharacters

    rule = RepeatedCharacters(max_repeated_len)
    pattern = re.compile(r"(.)\1{" + str(max_repeated_len) + ",}")
    limit, stride = max_repeated_len, max(rule.stride, 1)
    alphabet = ["a", "b", " ", "\n", "ü", "語", "😀", "\t"]
    rng = random.Random(max_repeated_len)
    checked = cut = 0

    def filler(length, char):  # no two equal neighbours and no `char`: the run alone can be cut
        chosen = [char]
        for _ in range(length):
            chosen.append(rng.choice([c for c in alphabet if c not in (char, chosen[-1])]))
        return "".join(chosen[1:])

    for char in ("a", "\n", " ", "ü", "😀"):
        for length in range(max(limit - 1, 1), limit + 3):
            for offset in range(2 * stride + 1):
                before, after = filler(offset, char), filler(rng.randint(0, 3 * stride), char)
                text = before + char * length + after
                assert rule.sub(text) == pattern.sub(r"\1", text), (char, length, offset)
                checked += 1
                if char != "\n" and length > limit:
                    assert rule.sub(text) == before + char + after  # the run became one character
                    cut += 1
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(0, 5)):
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 2 * stride))))
            parts.append(rng.choice(alphabet) * rng.randint(0, limit + 3))
        text = "".join(parts)
        assert rule.sub(text) == pattern.sub(r"\1", text)
    assert checked > cut > 0
    # The prefilter is what makes it fast: ordinary text never reaches the full pattern.
    if rule.sampled is not None:
        prose = " ".join(TEXTS) * 3
        assert not rule.sampled.search(prose[::rule.stride]) and rule.sub(prose) == prose


@pytest.mark.parametrize("line", [
    '{"text": "plain"}', '  {"text": "leading space"}', '{"text": "trailing"}  \t\r', '\ufeff{"text": "bom"}',
    '{"text": "a"} {"text": "b"}', '{"text": "dup", "text": "last wins"}', '{"text": "raw \u2028 separator"}',
    '{"text": "esc\\u00fc\\n"}', '[1, 2]', '"just a string"', '{"text": broken', '{"a": 1e999}', 'nan', '',
])
def test_parse_line_equals_json_loads(line):
    from llm_pretrain.data import prepare

    prepare._worker["scan"] = json.JSONDecoder().scan_once
    try:
        expected = json.loads(line)
    except ValueError as error:
        with pytest.raises(type(error), match=re.escape(str(error))):
            prepare._parse_line(line)
    else:
        assert prepare._parse_line(line) == expected


def text_mode_documents(path, tokenizer):
    """What PaddleNLP's tool sees: the lines of a text-mode file, cleaned, EOS after each."""
    tok = load_tokenizer(tokenizer)
    documents = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids = tok.encode(re.sub(r"(.)\1{100,}", r"\1", json.loads(line)["text"]).strip())
                if ids:
                    documents.append(ids + [tok.eos_token_id])
    return documents


def test_byte_ranges_read_lines_as_text_mode_does(tokenizers_dir, tmp_path):
    """Workers read byte ranges cut after a newline: \n, \r\n and lone \r line ends, blank lines, multi-byte
    characters and a last line without a newline give text mode's lines, for any range size and worker count."""
    endings = ["\n", "\r\n", "\r", "\n\n", "\r\n  \r\n", "\n"]
    records = [json.dumps({"text": f"{i} {TEXTS[i % 7]} ü語😀" + "x" * (i % 5) * 60}, ensure_ascii=i % 2 == 0)
               for i in range(60)]
    body = "".join(record + endings[i % len(endings)] for i, record in enumerate(records))
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(body.rstrip("\r\n").encode("utf-8"))  # the last line has no line end
    tokenizer = str(tokenizers_dir / "sp")
    expected = text_mode_documents(path, tokenizer)
    assert len(expected) == 60
    outputs = []
    for chunk_bytes, workers in ((1, 1), (7, 2), (150, 2), (333, 1), (1 << 20, 1)):
        prefix = str(tmp_path / f"out{chunk_bytes}")
        result = prepare_jsonl([str(path)], tokenizer, prefix, workers=workers, chunk_bytes=chunk_bytes,
                               progress=False)
        data = IndexedDataset(prefix)
        assert result["documents"] == 60 and [list(data[i]) for i in range(60)] == expected
        outputs.append(open(prefix + ".bin", "rb").read() + open(prefix + ".idx", "rb").read())
    assert len(set(outputs)) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_names_its_line_across_byte_ranges(tokenizers_dir, tmp_path, monkeypatch, workers):
    """A worker only knows a bad line's place in its byte range; the error still names the file's line,
    counted as text mode counts (\r\n and lone \r end one line each, also across the counting blocks)."""
    from llm_pretrain.data import prepare

    monkeypatch.setattr(prepare, "_COUNT_BLOCK", 5)  # a \r\n split between two counting blocks
    good = [json.dumps({"text": f"line {i}"}) + ("\r\n", "\r", "\n")[i % 3] for i in range(40)]
    cases = [
        ("".join(good) + '{"text": broken\n{"text": "after"}\n', b"", r"line 41: invalid JSON"),
        ("".join(good[:25]) + '{"title": "x"}\r\n' + "".join(good[25:]), b"", r"line 26: no key 'text'"),
        ("".join(good[:22]), b'{"text": "bad \xff byte"}\n', r"near line 23 is not UTF-8 text"),
    ]
    for text, tail, pattern in cases:
        path = tmp_path / "bad.jsonl"
        path.write_bytes(text.encode("utf-8") + tail + "".join(good).encode("utf-8"))
        with pytest.raises(UsageError, match=f"^--input: {re.escape(str(path))} {pattern}"):
            prepare_jsonl([str(path)], str(tokenizers_dir / "sp"), str(tmp_path / "o"), workers=workers,
                          chunk_bytes=64, progress=False)
        assert not [name for name in os.listdir(tmp_path) if name.startswith("o.")]
