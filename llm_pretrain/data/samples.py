"""GPT-style training samples over the mmap data, cached on disk, and blending.

The semantics are Megatron's / PaddleNLP's GPTDataset (paddlenlp/data/causal_dataset.py),
so the same data, split, seq_length and seed give the same samples in the same order:

  * the documents of a prefix are split into train/valid/test ranges (inputs.split_document_ranges);
  * doc_idx: the split's documents repeated for as many epochs as num_samples needs, shuffled
    with np.random.RandomState(seed) (the last epoch shuffled on its own when it is mostly unused);
  * sample_idx: the shuffled documents are read as one token stream; sample k is the window of
    seq_length + 1 tokens starting at token k * seq_length (neighbours share one token, because
    the trainer uses x = s[:-1], y = s[1:]); sample_idx[k] = (position in doc_idx, offset) of its start;
  * shuffle_idx: a permutation of the samples, drawn from the same RandomState.

The three arrays are saved as .npy files whose names hash everything they depend on,
written atomically, and memory-mapped on the next run. Several prefixes are mixed by
BlendedDataset with Megatron's greedy blending index.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
from numpy.random import RandomState  # numpy loads numpy.random lazily: at import, not inside the timed build

from llm_pretrain.data.indexed import IndexedDataset, idx_path
from llm_pretrain.data.inputs import open_sources, parse_split, split_document_ranges
from llm_pretrain.errors import UsageError

# Part of every cache key: bump it when the arrays' meaning or layout changes.
CACHE_FORMAT = "llm-pretrain-gpt-index-v1"
SPLIT_NAMES = ("train", "valid", "test")


# ----------------------------------------------------------------------------- index arrays
def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give num_samples windows: (epochs * tokens - 1) // seq_length >= num_samples."""
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """Document ids for every epoch, shuffled (all epochs together, or the last one on its own)."""
    if separate_last_epoch and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        return np.concatenate([first, build_doc_idx(documents, 1, rng, False)])
    dtype = np.int32 if documents.size == 0 or documents.max() < 2**31 else np.int64
    doc_idx = np.tile(documents.astype(dtype, copy=False), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(document_sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                     num_samples: int, longest: int | None = None) -> np.ndarray:
    """[num_samples + 1, 2]: (position in doc_idx, token offset) where each window starts.

    Vectorized form of Megatron's build_sample_idx loop: window k starts at stream token
    k * seq_length, found by a binary search over the documents' cumulative ends. The end of
    window k is the start of window k + 1 (inclusive), hence the extra row.

    The stream is walked in blocks of documents, each block's windows written straight into
    the result: memory beyond the result is a few block-sized arrays (PaddleNLP's C++ loop
    needs none either), and the gathered sizes stay in their own dtype (int32).
    """
    if longest is None:  # the longest document in doc_idx: it bounds every offset
        longest = int(document_sizes[np.unique(doc_idx)].max(initial=0))
    dtype = np.int32 if max(len(doc_idx), longest) < 2**31 else np.int64
    compiled = compiled_helpers()
    if (compiled is not None and dtype == np.int32 and document_sizes.dtype == np.int32 and doc_idx.dtype == np.int32
            and document_sizes.flags.c_contiguous and doc_idx.flags.c_contiguous):
        # Megatron's loop in C (helpers.c): no temporary at all, 3x the NumPy blocks below.
        sample_idx = np.zeros((num_samples + 1, 2), np.int32)
        compiled.build_sample_idx_int32(document_sizes.ctypes.data, doc_idx.ctypes.data, seq_length, num_samples,
                                        sample_idx.ctypes.data)
        return sample_idx
    sample_idx = np.zeros((num_samples + 1, 2), dtype)  # row 0 is (0, 0), as the loop records its start
    block = 1 << 20
    first_window, stream_start = 1, 0  # next window to place, tokens before this block
    for begin in range(0, len(doc_idx), block):
        if first_window > num_samples:
            break
        lengths = document_sizes[doc_idx[begin:begin + block]]
        ends = np.cumsum(lengths, dtype=np.int64)
        ends += stream_start
        stream_end = int(ends[-1])
        last_window = min(num_samples, (stream_end - 1) // seq_length)  # windows starting inside this block
        if last_window >= first_window:
            starts = np.arange(first_window, last_window + 1, dtype=np.int64) * seq_length
            # side="right" skips empty documents, as the loop does.
            position = np.searchsorted(ends, starts, side="right")
            sample_idx[first_window:last_window + 1, 1] = starts - (ends[position] - lengths[position])
            position += begin
            sample_idx[first_window:last_window + 1, 0] = position
            first_window = last_window + 1
        stream_start = stream_end
    return sample_idx


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) followed by a permutation of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_index_arrays(document_sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                       seq_length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """doc_idx, sample_idx, shuffle_idx for `num_samples` windows over `documents` (Megatron's rules)."""
    contiguous = len(documents) and int(documents[-1]) - int(documents[0]) + 1 == len(documents)
    epoch_sizes = document_sizes[int(documents[0]):int(documents[-1]) + 1] if contiguous else document_sizes[documents]
    tokens_per_epoch, longest = int(epoch_sizes.sum()), int(epoch_sizes.max(initial=0))
    del epoch_sizes
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last_epoch = False
    if num_epochs > 1:
        # When the last epoch is used less than 80%, shuffle it separately so that the samples
        # actually trained on cover the earlier epochs uniformly.
        from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = num_samples - from_full_epochs < int(0.80 * per_epoch)
    rng = RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(document_sizes, doc_idx, seq_length, total, longest)
    shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(shuffled, total, rng)
    return doc_idx, sample_idx, shuffle_idx


@functools.lru_cache(maxsize=None)
def compiled_helpers():
    """helpers.c (the blending and sample-index loops) through ctypes, compiled on first use; None without cc.

    Megatron builds its helpers at run time the same way; PaddleNLP ships them compiled
    (tool_helpers). The library is cached under ~/.cache/llm_pretrain (XDG_CACHE_HOME) by the
    source's hash; the compiler is $CC or cc, with FMA contraction off so that the
    arithmetic is the Python loop's to the last bit.
    """
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.c")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm_pretrain")
    library = os.path.join(cache, f"helpers-{digest}.so")
    if not os.path.isfile(library):
        try:
            os.makedirs(cache, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-", suffix=".so")
            os.close(fd)
            command = [os.environ.get("CC", "cc"), "-O2", "-ffp-contract=off", "-shared", "-fPIC", source, "-o", tmp]
            built = subprocess.run(command, capture_output=True, timeout=120).returncode == 0
            if built:
                os.replace(tmp, library)  # atomic: concurrent builders all end with a complete file
            elif os.path.exists(tmp):
                os.remove(tmp)
        except (OSError, subprocess.SubprocessError):
            return None
        if not os.path.isfile(library):
            return None
    try:
        library = ctypes.CDLL(library)
    except OSError:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.build_blending_indices.restype = library.build_sample_idx_int32.restype = None
    library.build_blending_indices.argtypes = [p, i64, i64, p, ctypes.c_int, p, p]
    library.build_sample_idx_int32.argtypes = [p, p, ctypes.c_int32, i64, p]
    return library


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending: sample s comes from the dataset furthest behind its share.

    Returns (dataset_index, dataset_sample_index): which dataset, and which of its samples.
    At every position each dataset's count stays within two samples of weight * position.
    The loop runs in C (helpers.c, ~10 ms per million samples) when a C compiler is there,
    else in Python (~0.35 s per million for two datasets); it runs once, then is cached.
    """
    compiled = compiled_helpers()
    if compiled is not None:
        weights_array = np.ascontiguousarray(weights, dtype=np.float64)
        wide = len(weights_array) >= 256  # uint8 dataset ids like Megatron while they fit
        dataset_index = np.zeros(size, np.int64 if wide else np.uint8)
        dataset_sample_index = np.zeros(size, np.int64)
        counts = np.zeros(len(weights_array), np.int64)
        compiled.build_blending_indices(weights_array.ctypes.data, len(weights_array), size,
                                        dataset_index.ctypes.data, int(wide), dataset_sample_index.ctypes.data,
                                        counts.ctypes.data)
        return dataset_index, dataset_sample_index
    return blending_indices_python(weights, size)


def blending_indices_python(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """build_blending_indices as a plain Python loop (no C compiler; and the reference the tests use)."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    code = "B" if len(weights) < 256 else "q"  # uint8 dataset ids like Megatron while they fit
    dataset_index = array.array(code, bytes(size * array.array(code).itemsize))
    dataset_sample_index = array.array("q", bytes(8 * size))
    others = range(1, len(weights))
    for s in range(size):
        target = s if s > 1 else 1  # as Megatron: sample 0 is judged like sample 1
        best, best_lag = 0, weights[0] * target - counts[0]
        for i in others:  # strictly greater: the first dataset wins ties, as in Megatron
            lag = weights[i] * target - counts[i]
            if lag > best_lag:
                best, best_lag = i, lag
        dataset_index[s] = best
        dataset_sample_index[s] = counts[best]
        counts[best] += 1
    return np.array(dataset_index), np.frombuffer(dataset_sample_index, np.int64).copy()


# ----------------------------------------------------------------------------- disk cache
def cache_name(kind: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True).encode()).hexdigest()
    return f"{kind}_{digest[:20]}"


def _save_atomic(path: str, array: np.ndarray) -> None:
    """np.save to a temporary file in the same directory, then rename: readers see all or nothing."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _load_all(paths: list[str]) -> list[np.ndarray] | None:
    """Memory-map every file, or None if any is missing or unreadable (then it is rebuilt)."""
    try:
        return [np.load(path, mmap_mode="r", allow_pickle=False) for path in paths]
    except (OSError, ValueError, EOFError):
        return None


def load_or_build(cache_dir: str, name: str, parts: tuple[str, ...], build, valid) -> tuple[list[np.ndarray], bool]:
    """Cached arrays `name_<part>.npy` in cache_dir: loaded if present and `valid(arrays)`, else built and saved.

    Returns (arrays, loaded_from_cache). Each file is replaced atomically and the arrays are
    deterministic, so processes building the same cache at once all end with the same files.
    """
    paths = [os.path.join(cache_dir, f"{name}_{part}.npy") for part in parts]
    arrays = _load_all(paths)
    if arrays is not None:
        if valid(*arrays):
            return arrays, True
        print(f"warning: the cached sample index {paths[0]} does not fit its inputs (damaged); rebuilding it",
              file=sys.stderr, flush=True)
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for path, values in zip(paths, arrays):
            _save_atomic(path, values)
    except OSError as error:
        raise UsageError(f"data_cache: cannot write the sample index cache in {cache_dir} "
                         f"({error.strerror or error}); set data_cache to a writable directory") from None
    loaded = _load_all(paths)  # memory-mapped like a cache hit, so both runs behave the same
    return (loaded if loaded is not None else list(arrays)), False


def _file_identity(path: str) -> list[int]:
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


# ----------------------------------------------------------------------------- datasets
class GPTDataset:
    """Windows of seq_length + 1 token ids from one prefix's split (see the module docstring)."""

    def __init__(self, data: IndexedDataset, split_name: str, documents: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir: str):
        self.data, self.split_name, self.seq_length, self.documents = data, split_name, seq_length, documents
        self._single_items = None
        start, end = documents
        key = {"prefix": os.path.abspath(data.prefix), "idx": _file_identity(idx_path(data.prefix)),
               "documents": [start, end], "num_samples": num_samples, "seq_length": seq_length, "seed": seed}
        self.cache_key = cache_name(f"gpt_{split_name}", key)

        def build():  # the sizes are read only here: a cached index never touches them
            documents = np.arange(start, end, dtype=np.int32 if end < 2**31 else np.int64)
            return build_index_arrays(data.document_sizes_for(start, end), documents, num_samples, seq_length, seed)

        def valid(doc_idx, sample_idx, shuffle_idx):
            return (sample_idx.ndim == 2 and sample_idx.shape[1] == 2 and len(shuffle_idx) == len(sample_idx) - 1
                    and len(shuffle_idx) >= num_samples and len(doc_idx) > 0)

        arrays, self.loaded_from_cache = load_or_build(
            cache_dir, self.cache_key, ("doc_idx", "sample_idx", "shuffle_idx"), build, valid)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self.cache_files = [os.path.join(cache_dir, f"{self.cache_key}_{p}.npy")
                            for p in ("doc_idx", "sample_idx", "shuffle_idx")]

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def _window_spans(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ranges [starts, ends) in the .bin of the pieces of documents that make window i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        k = int(self.shuffle_idx[i])
        (first, start), (last, end) = self.sample_idx[k], self.sample_idx[k + 1]
        documents = self.doc_idx[first:last + 1]
        if self._single_items is None:  # checked once, on the first read (opening stays header-only)
            self._single_items = self.data.one_item_per_document(*self.documents)
        starts, ends = self.data.document_spans(documents, self._single_items)
        ends[-1] = starts[-1] + end + 1  # the window ends inside its last document (inclusive)...
        starts[0] += start  # ...and starts inside its first
        return starts, ends

    def __getitem__(self, i: int) -> np.ndarray:
        starts, ends = self._window_spans(i)
        tokens = self.data.tokens
        if len(starts) == 1:
            return tokens[starts[0]:ends[0]].astype(np.int64)
        return np.concatenate([tokens[a:b] for a, b in zip(starts.tolist(), ends.tolist())]).astype(np.int64)

    def document_pieces(self, i: int) -> np.ndarray:
        """Lengths of the pieces of .idx documents window i is made of, in order (they sum to seq_length + 1):
        where its documents start (llm_pretrain/data/documents.py)."""
        starts, ends = self._window_spans(i)
        return ends - starts


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights (Megatron's BlendableDataset)."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir: str):
        self.datasets, self.weights, self.size = datasets, list(weights), size
        key = {"datasets": [d.cache_key for d in datasets], "weights": self.weights, "size": size}
        self.cache_key = cache_name(f"blend_{datasets[0].split_name}", key)

        def out_of_range(dataset_index, dataset_sample_index) -> str | None:
            """What in the blending indices cannot be right (None: they fit the datasets)."""
            if len(dataset_index) != size or len(dataset_sample_index) != size:
                return f"{len(dataset_index)} entries for {size} samples"
            if size and (int(dataset_index.min()) < 0 or int(dataset_index.max()) >= len(datasets)):
                return f"a dataset number outside 0-{len(datasets) - 1}"
            for i, dataset in enumerate(datasets):
                used = dataset_sample_index[dataset_index == i]
                if used.size and (int(used.min()) < 0 or int(used.max()) >= len(dataset)):
                    return f"sample {int(used.max())} of dataset {i}, which has {len(dataset)}"
            return None

        arrays, self.loaded_from_cache = load_or_build(
            cache_dir, self.cache_key, ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.weights, size), lambda *arrays: out_of_range(*arrays) is None)
        self.dataset_index, self.dataset_sample_index = arrays
        # A cache was checked on loading; fresh indices fit by the 1.005 margin, a bug if not.
        problem = None if self.loaded_from_cache else out_of_range(*arrays)
        if problem:
            raise RuntimeError(f"blending indices built out of range: {problem}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range ({self.size} samples)")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def document_pieces(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range ({self.size} samples)")
        return self.datasets[int(self.dataset_index[i])].document_pieces(int(self.dataset_sample_index[i]))


# ----------------------------------------------------------------------------- entry point
def build_pretraining_datasets(input_dir: str, split: str, seq_length: int, seed: int,
                               num_samples: tuple[int, int, int], data_cache: str | None = None,
                               skip_warmup: bool = True):
    """(train, valid, test) datasets of seq_length + 1 token windows; None where a split is unused.

    A split is unused when its share in `split` is 0 or its num_samples is 0. With several
    prefixes each one is built for ceil(n * weight * 1.005) samples (Megatron's margin) and
    blended into exactly n. Index caches go to data_cache, or to index-cache/ next to each
    prefix (the blend's next to the first prefix).
    """
    shares = parse_split(split)
    sources = open_sources(input_dir)
    if seq_length < 1:
        raise UsageError(f"max_seq_length: {seq_length} must be at least 1")
    if not 0 <= seed < 2**32:  # np.random.RandomState's range
        raise UsageError(f"seed: {seed} must be between 0 and 4294967295 for the data order")
    if not skip_warmup:
        for _, data in sources:
            data.warmup()

    def cache_dir_of(prefix):
        return data_cache or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")

    def one_prefix(source, data, split_index, count):
        start, end = split_document_ranges(split, data.num_documents)[split_index]
        name = SPLIT_NAMES[split_index]
        if end == start or data.document_start(end) == data.document_start(start):
            raise UsageError(f"split: '{split}' leaves the {name} split of {source.prefix} without tokens "
                             f"({end - start} of its {data.num_documents} documents); "
                             f"give {name} a larger share or use more data")
        return GPTDataset(data, name, (start, end), count, seq_length, seed, cache_dir_of(source.prefix))

    datasets = []
    for split_index, count in enumerate(num_samples):
        if shares[split_index] == 0 or count == 0:
            datasets.append(None)
        elif len(sources) == 1:
            datasets.append(one_prefix(*sources[0], split_index, count))
        else:
            parts = [one_prefix(source, data, split_index, int(math.ceil(count * source.weight * 1.005)))
                     for source, data in sources]
            weights = [source.weight for source, _ in sources]
            datasets.append(BlendedDataset(parts, weights, count, cache_dir_of(sources[0][0].prefix)))
    return tuple(datasets)
