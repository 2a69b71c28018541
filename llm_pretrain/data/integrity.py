"""Data integrity, checked once before training, so that damaged or mismatched files are one line
(exit code 2, naming the file) and never silent garbage or a traceback mid-run.

    check_data_integrity(input_dir, vocab_size, data_cache)   every prefix of input_dir:
        .bin size == what .idx describes; pointers == the running sum of sizes x the dtype's size;
        doc_idx starts at 0, never decreases, ends at the number of items; and the largest token
        id below the model's vocab_size (vectorized passes; the result is cached beside the sample
        index under the files' size and mtime, so a later run only opens the files)
    damaged_sample_index_files(datasets)   cached sample indices whose values are out of range
        (the trainer removes and rebuilds them)

Kept apart from indexed.py / samples.py so that their hot paths stay as they are; the integrity
check runs in the preflight (llm_pretrain/run/preflight.py, before Paddle is imported), the sample
index check where the datasets are opened (trainer.py).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from llm_pretrain.data.indexed import IndexedDataset, bin_path, idx_path
from llm_pretrain.data.inputs import resolve_sources
from llm_pretrain.errors import UsageError

TOKEN_SCAN_CHUNK = 1 << 26  # tokens per np.max call


CHECK_CHUNK = 1 << 24  # items per vectorized step (bounds the temporary arrays on huge corpora)


def check_index_consistency(data: IndexedDataset) -> None:
    """The .idx must describe its .bin exactly (a wrong dtype byte or another dataset's index does not)."""
    index, data_file = idx_path(data.prefix), bin_path(data.prefix)
    itemsize = data.dtype.itemsize
    position = 0  # byte offset of the next item in .bin
    for start in range(0, len(data.sizes), CHECK_CHUNK):
        sizes = np.asarray(data.sizes[start:start + CHECK_CHUNK], dtype=np.int64)
        if sizes.min() < 0:
            raise UsageError(f"input_dir: {index} is damaged: item {start + int(np.argmin(sizes))} has a negative size")
        ends = position + np.cumsum(sizes * itemsize)
        expected = np.concatenate([[position], ends[:-1]])
        mismatch = np.flatnonzero(np.asarray(data.pointers[start:start + CHECK_CHUNK]) != expected)
        if mismatch.size:
            i = start + int(mismatch[0])
            raise UsageError(f"input_dir: {index} is damaged or has the wrong dtype ({data.dtype.name}): pointer {i} "
                             f"is {int(data.pointers[i])}, the sizes before it give {int(expected[mismatch[0]])}")
        position = int(ends[-1])
    actual = os.path.getsize(data_file)
    if actual != position:
        raise UsageError(f"input_dir: {data_file} has {actual} bytes but its index {index} describes {position} "
                         f"({position // itemsize} tokens of {data.dtype.name}); the .bin and .idx do not belong together")
    doc_idx = data.doc_idx
    decreasing = any(np.diff(np.asarray(doc_idx[i:i + CHECK_CHUNK + 1])).min(initial=0) < 0
                     for i in range(0, len(doc_idx), CHECK_CHUNK))
    if doc_idx[0] != 0 or doc_idx[-1] != len(data.sizes) or decreasing:
        raise UsageError(f"input_dir: {index} is damaged: its document index must rise from 0 to the number of "
                         f"items {len(data.sizes)} (it runs from {int(doc_idx[0])} to {int(doc_idx[-1])})")


def max_token_id(data: IndexedDataset) -> int:
    tokens = data.tokens
    return max((int(tokens[i:i + TOKEN_SCAN_CHUNK].max()) for i in range(0, len(tokens), TOKEN_SCAN_CHUNK)),
               default=-1)


def _identity(prefix: str) -> dict:
    files = {}
    for path in (idx_path(prefix), bin_path(prefix)):
        stat = os.stat(path)
        files[os.path.basename(path)] = [stat.st_size, stat.st_mtime_ns]
    return {"prefix": os.path.abspath(prefix), "files": files}


def _checked_max_token_id(data: IndexedDataset, cache_dir: str) -> int:
    """Check a prefix's files and return its largest token id; both remembered beside its sample
    index, keyed by the files' size and mtime, so that later runs skip the passes."""
    identity = _identity(data.prefix)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, f"tokens_{key}.json")
    try:
        with open(path) as f:
            return int(json.load(f)["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    check_index_consistency(data)
    value = max_token_id(data)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**identity, "consistent": True, "max_token_id": value}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory only costs the passes next time
    return value


def check_data_integrity(input_dir: str, vocab_size: int, data_cache: str | None = None,
                         thorough: bool = True) -> None:
    """Every prefix of input_dir consistent and within the vocabulary, or a UsageError naming the file.

    `thorough` False (the other processes of a node) only opens the files: one process per node
    reads them through, and its error ends the launch."""
    for source in resolve_sources(input_dir):
        data = IndexedDataset(source.prefix)
        if not thorough:
            continue
        cache_dir = data_cache or os.path.join(os.path.dirname(os.path.abspath(source.prefix)), "index-cache")
        largest = _checked_max_token_id(data, cache_dir)
        if largest >= vocab_size:
            raise UsageError(f"input_dir: {bin_path(source.prefix)} holds token id {largest}, not below the model's "
                             f"vocab_size {vocab_size}; was it prepared with another tokenizer?")


def damaged_sample_index_files(datasets) -> list[str]:
    """Cached sample-index files whose values cannot be right, the damaged array's file first
    (every file of an affected dataset is listed: they are rebuilt together). Empty: all fine."""
    damaged = []
    for dataset in datasets:
        if dataset is None:
            continue
        for part in getattr(dataset, "datasets", [dataset]):  # a BlendedDataset's parts, or the dataset
            if hasattr(part, "sample_idx"):
                bad = _damaged_array(part)
                if bad is not None:
                    files = [f for f in part.cache_files if f.endswith(f"_{bad}.npy")]
                    damaged += files + [f for f in part.cache_files if f not in files]
    return damaged


def _damaged_array(dataset) -> str | None:
    """Which of doc_idx / sample_idx / shuffle_idx holds impossible values (None: none)."""
    doc_idx, sample_idx, shuffle_idx = (np.asarray(a) for a in (dataset.doc_idx, dataset.sample_idx,
                                                               dataset.shuffle_idx))
    if doc_idx.size == 0 or doc_idx.min() < 0 or doc_idx.max() >= dataset.data.num_documents:
        return "doc_idx"
    positions, offsets = sample_idx[:, 0].astype(np.int64), sample_idx[:, 1].astype(np.int64)
    if positions.min() < 0 or positions.max() >= len(doc_idx) or np.diff(positions).min(initial=0) < 0:
        return "sample_idx"
    if offsets.min() < 0 or (offsets > dataset.data.document_sizes[doc_idx[positions]]).any():
        return "sample_idx"
    if shuffle_idx.size and (int(shuffle_idx.min()) < 0 or int(shuffle_idx.max()) >= len(sample_idx) - 1):
        return "shuffle_idx"
    return None
