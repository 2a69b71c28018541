"""Data integrity, checked once before training, so that damaged or mismatched files are one line
(exit code 2, naming the file) and never silent garbage or a traceback mid-run.

    check_data_integrity(input_dir, vocab_size, data_cache)   every prefix of input_dir:
        .bin size == what .idx describes; pointers == the running sum of sizes x the dtype's size;
        doc_idx starts at 0, never decreases, ends at the number of items; and the largest token
        id below the model's vocab_size (one vectorized pass over .bin, cached beside the sample index)
    damaged_sample_index_files(datasets)   cached sample indices whose values are out of range
        (the trainer removes and rebuilds them)

Kept apart from indexed.py / samples.py so that their hot paths stay as they are; the checks
are called where the datasets are opened (trainer.py).
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


def check_index_consistency(data: IndexedDataset) -> None:
    """The .idx must describe its .bin exactly (a wrong dtype byte or another dataset's index does not)."""
    index, data_file = idx_path(data.prefix), bin_path(data.prefix)
    itemsize = data.dtype.itemsize
    sizes = np.asarray(data.sizes, dtype=np.int64)
    if sizes.size and sizes.min() < 0:
        raise UsageError(f"input_dir: {index} is damaged: item {int(np.argmin(sizes))} has a negative size")
    expected = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1] * itemsize, out=expected[1:])
    mismatch = np.flatnonzero(np.asarray(data.pointers) != expected)
    if mismatch.size:
        i = int(mismatch[0])
        raise UsageError(f"input_dir: {index} is damaged or has the wrong dtype ({data.dtype.name}): pointer {i} is "
                         f"{int(data.pointers[i])}, the sizes before it give {int(expected[i])}")
    described = int(sizes.sum()) * itemsize
    actual = os.path.getsize(data_file)
    if actual != described:
        raise UsageError(f"input_dir: {data_file} has {actual} bytes but its index {index} describes {described} "
                         f"({int(sizes.sum())} tokens of {data.dtype.name}); the .bin and .idx do not belong together")
    doc_idx = np.asarray(data.doc_idx)
    if doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or (doc_idx.size > 1 and np.diff(doc_idx).min() < 0):
        raise UsageError(f"input_dir: {index} is damaged: its document index must rise from 0 to the number of "
                         f"items {len(sizes)} (it runs from {int(doc_idx[0])} to {int(doc_idx[-1])})")


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


def _cached_max_token_id(data: IndexedDataset, cache_dir: str) -> int:
    """The largest token id of a prefix, remembered beside its sample index (keyed by the files' size and mtime)."""
    identity = _identity(data.prefix)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, f"tokens_{key}.json")
    try:
        with open(path) as f:
            return int(json.load(f)["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = max_token_id(data)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**identity, "max_token_id": value}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory only costs the scan next time
    return value


def check_data_integrity(input_dir: str, vocab_size: int, data_cache: str | None = None,
                         scan_tokens: bool = True) -> None:
    """Every prefix of input_dir consistent and within the vocabulary, or a UsageError naming the file."""
    for source in resolve_sources(input_dir):
        data = IndexedDataset(source.prefix)
        check_index_consistency(data)
        if not scan_tokens:
            continue
        cache_dir = data_cache or os.path.join(os.path.dirname(os.path.abspath(source.prefix)), "index-cache")
        largest = _cached_max_token_id(data, cache_dir)
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
