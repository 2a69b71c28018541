r"""JSON lines -> prefix.bin/.idx: one document per line, tokenized by a local tokenizer.

The main process cuts each file into byte ranges of whole lines (chunk_bytes) and sends the
ranges to worker processes, which read, parse, clean and tokenize them; their tokens are
written in input order, so the output is identical for any number of workers.
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

import collections
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from llm_pretrain.data.indexed import IndexedWriter, best_fitting_dtype
from llm_pretrain.errors import UsageError
from llm_pretrain.data.tokenizer import load_tokenizer

# Set in each worker by _init_worker (and in the main process for workers=1).
_worker = {}


def repeated_characters(max_repeated_len: int) -> re.Pattern:
    """PaddleNLP's `remove_repeated_chars` pattern: a character followed by max_repeated_len or more copies."""
    return re.compile(r"(.)\1{" + str(max_repeated_len) + ",}")


class RepeatedCharacters:
    r"""PaddleNLP's rule, `re.sub(r"(.)\1{L,}", r"\1", text)`, run only on texts that can match.

    The full pattern costs ~19 ns a character (15 % of the preparation) and almost never matches.
    A run of L + 1 or more equal characters covers at least 4 consecutive multiples of
    stride = (L + 1) // 4, so text[::stride] then holds 4 equal consecutive characters (the run's
    own, not a newline, which `.` skips in both patterns): a text whose sample has none cannot
    match and is returned as it is; any other text gets the full substitution. The sample is a
    25th of the text for L = 100; tests/test_tokenizer_and_prepare.py checks the equality.
    """

    def __init__(self, max_repeated_len: int):
        self.pattern = repeated_characters(max_repeated_len)
        self.stride = (max_repeated_len + 1) // 4
        self.sampled = re.compile(r"(.)\1\1\1") if self.stride > 1 else None

    def sub(self, text: str) -> str:
        if self.sampled is not None and not self.sampled.search(text[::self.stride]):
            return text
        return self.pattern.sub(r"\1", text)


class _BadLine(Exception):
    """Bad input seen in a worker, which knows its line only relative to its byte range: the main
    process counts the lines before the range and raises UsageError(f"--input: {path} {before}{line}{after}")."""

    def __init__(self, path: str, range_start: int, line_in_range: int, before: str, after: str):
        super().__init__(path, range_start, line_in_range, before, after)


def _line_breaks(data: bytes) -> int:
    r"""Lines ended in data, counted as text mode reads them (\n, \r\n and \r each end one)."""
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


_COUNT_BLOCK = 1 << 24  # bytes read at a time when counting lines for an error message


def _line_number(path: str, range_start: int, line_in_range: int) -> int:
    """1-based number of a line given its byte range's start (a line start) and its index inside the range."""
    lines = 0
    with open(path, "rb") as f:
        previous_cr = False
        for offset in range(0, range_start, _COUNT_BLOCK):
            block = f.read(min(_COUNT_BLOCK, range_start - offset))
            lines += _line_breaks(block) - (previous_cr and block[:1] == b"\n")  # \r\n across two blocks
            previous_cr = block[-1:] == b"\r"
    return lines + line_in_range + 1


def _init_worker(tokenizer_path: str, json_key: str, append_eos: bool, dtype: str,
                 max_repeated_len: int | None, tokenizer_threads: int) -> None:
    _worker.update(tokenizer=load_tokenizer(tokenizer_path, key="--tokenizer"), json_key=json_key,
                   append_eos=append_eos, dtype=np.dtype(dtype), threads=tokenizer_threads,
                   # json.loads minus its Python wrapper (a third of the parse time); see _parse_line
                   scan=json.JSONDecoder().scan_once,
                   repeated=None if max_repeated_len is None else RepeatedCharacters(max_repeated_len))


def _parse_line(line: str):
    """json.loads(line): the decoder's scanner directly; anything unusual (leading whitespace, a BOM,
    trailing data, an error) goes through json.loads itself, so results and errors are its own."""
    try:
        record, stop = _worker["scan"](line, 0)
        if stop == len(line) or not line[stop:].strip(" \t\n\r"):  # json's whitespace
            return record
    except (StopIteration, ValueError):
        pass
    return json.loads(line)


def _encode_range(work: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(path, start, end): a byte range of whole lines -> (tokens back to back, tokens per document, bytes).

    Each worker reads its own range, so the main process sends three numbers a chunk, not its text.
    """
    path, start, end = work
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _BadLine(path, start, _line_breaks(data[:error.start]), "near line ",
                       f" is not UTF-8 text ({error.reason})") from None
    if "\r" in text:  # lines as text mode reads them (PaddleNLP's tool iterates a text-mode file)
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    key = _worker["json_key"]
    texts = []
    for index, line in enumerate(text.split("\n")):
        if not line or line.isspace():  # a blank line (line.strip() would copy the line)
            continue
        try:
            record = _parse_line(line)
        except ValueError as error:
            raise _BadLine(path, start, index, "line ", f": invalid JSON ({getattr(error, 'msg', error)})") from None
        if not isinstance(record, dict) or key not in record:
            found = f"keys: {', '.join(list(record)[:5])}" if isinstance(record, dict) else type(record).__name__
            raise _BadLine(path, start, index, "line ", f": no key '{key}' ({found}); choose it with --json_key")
        if not isinstance(record[key], str):
            raise _BadLine(path, start, index, "line ", f": '{key}' is {type(record[key]).__name__}, not text")
        texts.append(record[key])
    repeated = _worker["repeated"]
    if repeated is not None:  # PaddleNLP's cleaning; its tool writes nothing for a text without tokens
        texts = [repeated.sub(text).strip() for text in texts]
    append_eos = _worker["append_eos"]
    ids, sizes = _worker["tokenizer"].encode_batch_flat(texts, _worker["threads"], append_eos)
    if repeated is not None:
        empty = sizes == (1 if append_eos else 0)
        if empty.any():
            if append_eos:  # an empty document's ids are its EOS alone
                ids = np.delete(ids, (np.cumsum(sizes) - 1)[empty])
            sizes = sizes[~empty]
    tokens = ids.astype(_worker["dtype"])
    return tokens, sizes, end - start


def _byte_ranges(paths: list[str], chunk_bytes: int):
    r"""(path, start, end) of consecutive ranges of about chunk_bytes, each ending after a newline (or at the end).

    Only b"\n" ends a range: a file whose lines end in a lone \r is one range (the same output, one worker).
    """
    for path in paths:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = 0
            while start < size:
                f.seek(start + chunk_bytes - 1)
                f.readline()  # to the end of the line that holds the range's last byte
                end = min(f.tell(), size)
                yield path, start, end
                start = end


def _in_order(pool: ProcessPoolExecutor, chunks, ahead: int):
    """_encode_range over chunks in the pool, results in input order, at most `ahead` chunks in flight.

    Not multiprocessing.Pool.imap: its worker-handler thread spins while results wait in the pipe
    (Pool._wait_for_updates wakes on the result pipe it does not read), 6 % of all CPU time here;
    nor Executor.map, which submits every chunk of the input at once.
    """
    pending = collections.deque()
    for work in chunks:
        pending.append(pool.submit(_encode_range, work))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def prepare_jsonl(inputs: list[str], tokenizer: str, output_prefix: str, json_key: str = "text",
                  workers: int = 1, append_eos: bool = True, chunk_bytes: int = 1 << 18,
                  progress: bool | None = None, clean_text: bool = True, max_repeated_len: int = 100) -> dict:
    """Tokenize JSON-lines files into output_prefix.bin/.idx; returns {documents, tokens, seconds, ...}.

    workers: processes, each reading, parsing and tokenizing byte ranges of about chunk_bytes of
    whole lines with a single-threaded tokenizer; 1: all in this process, the tokenizer using its
    own threads. The output is the same for any workers and chunk_bytes.
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
    if workers < 1 or chunk_bytes < 1:
        raise UsageError(f"--workers/--chunk_bytes: must be at least 1 (got {workers}, {chunk_bytes})")
    if max_repeated_len < 1:
        raise UsageError(f"--max_repeated_len: must be at least 1 (got {max_repeated_len})")
    tok = load_tokenizer(tokenizer, key="--tokenizer")
    if append_eos and tok.eos_token_id is None:
        raise UsageError(f"--tokenizer: {tok.source} has no end-of-text token; "
                         "use a tokenizer with one or pass --no_append_eos")
    dtype = np.dtype(best_fitting_dtype(tok.vocab_size))
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)

    # One process: the tokenizer may use every core itself (sentencepiece's and tokenizers' own
    # threads); several: one single-threaded tokenizer per process, as threads would only compete.
    init_args = (tokenizer, json_key, append_eos, dtype.str,
                 max_repeated_len if clean_text else None, -1 if workers == 1 else 1)
    total_bytes = sum(os.path.getsize(path) for path in inputs)
    if progress is None:  # tqdm's own rule for disable=None
        progress = sys.stderr is not None and sys.stderr.isatty()
    bar = None
    if progress:  # tqdm imported only then: its import is a twentieth of preparing 10 MB
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True)
    chunks = _byte_ranges(inputs, chunk_bytes)
    pool = None
    try:
        with IndexedWriter(output_prefix, dtype) as writer:
            if workers == 1:
                _init_worker(*init_args)
                results = map(_encode_range, chunks)
            else:
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init_args)
                results = _in_order(pool, chunks, ahead=4 * workers)  # output independent of `workers`
            try:
                for tokens, sizes, nbytes in results:
                    writer.add_documents(tokens, sizes)
                    if bar is not None:
                        bar.update(nbytes)
            except _BadLine as bad:
                path, range_start, line_in_range, before, after = bad.args
                line = _line_number(path, range_start, line_in_range)
                raise UsageError(f"--input: {path} {before}{line}{after}") from None
            if writer.num_documents == 0:
                raise UsageError(f"--input: no documents in {', '.join(inputs)} (every line is blank)")
            documents, tokens = writer.num_documents, writer.num_tokens
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return {"prefix": output_prefix, "documents": documents, "tokens": tokens, "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "seconds": time.time() - start}
