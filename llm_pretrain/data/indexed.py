"""The Megatron / PaddleNLP "mmap" token format: prefix.bin + prefix.idx.

prefix.bin holds every token id back to back in one dtype (uint16 when the
vocabulary has fewer than 65500 entries, else int32). prefix.idx describes it,
little-endian:

    b"MMIDIDX\\x00\\x00"      magic, 9 bytes
    uint64 version = 1
    uint8  dtype code        (DTYPE_CODES below, PaddleNLP's numbering)
    uint64 n_items           sequences; this toolkit writes one per document
    uint64 n_doc_idx         documents + 1
    int32[n_items]  sizes    tokens per item
    int64[n_items]  pointers byte offset of each item in .bin
    int64[n_doc_idx] doc_idx first item of each document; the last entry is n_items

Items are stored in order without gaps, so a document is one contiguous slice of
.bin. Files written here are read by paddlenlp.data.indexed_dataset.MMapIndexedDataset
and files written by its make_builder are read here (tests/test_data.py checks both).
"""

from __future__ import annotations

import array
import os
import struct

import numpy as np

from llm_pretrain.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
    6: np.float64, 7: np.float32, 8: np.uint16, 9: np.uint32, 10: np.uint64,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n_items, n_doc_idx


def best_fitting_dtype(vocab_size: int) -> type:
    """The dtype PaddleNLP picks for token ids: uint16 while every id fits, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _dtype_code(dtype) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an mmap index")


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDataset:
    """Read-only, memory-mapped view of prefix.bin/.idx. Indexing is by document.

    `dataset[d]` is document d (all its items concatenated) as a read-only array
    of the stored dtype; `tokens` is the whole .bin; `document_start(d)` is the
    token position where document d starts (d = num_documents: the total).
    Bad files raise UsageError naming input_dir and the file.

    Opening reads only the header: a document's start is looked up when it is needed
    (doc_idx, then pointers), and `document_sizes` is the index's own int32 `sizes`
    (no copy) when there is one item per document, as this toolkit and PaddleNLP's
    create_pretraining_data.py write it. `document_offsets` builds the whole array.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        path = idx_path(prefix)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise UsageError(f"input_dir: {path} is too short to be an mmap index (a broken or unfinished file?)")
        magic, version, code, n_items, n_doc_idx = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or code not in DTYPE_CODES:
            raise UsageError(f"input_dir: {path} is not a PaddleNLP/Megatron mmap index (magic MMIDIDX, version 1)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n_items + 8 * n_items + 8 * n_doc_idx
        if n_doc_idx < 1:
            raise UsageError(f"input_dir: {path} has no document index (doc_idx is empty)")
        if os.path.getsize(path) < expected:
            raise UsageError(f"input_dir: {path} is truncated ({os.path.getsize(path)} bytes, expected {expected})")

        index = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(index, np.int32, n_items, offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(index, np.int64, n_items, offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(index, np.int64, n_doc_idx, offset)
        self._doc_idx_offset = offset

        # Items are contiguous, so the end of the last item is the number of tokens.
        self.num_tokens = int(self.pointers[-1] // self.dtype.itemsize + self.sizes[-1]) if n_items else 0
        data = bin_path(prefix)
        if os.path.getsize(data) < self.num_tokens * self.dtype.itemsize:
            raise UsageError(f"input_dir: {data} is shorter than its index {path} says "
                             f"({self.num_tokens} tokens of {self.dtype.name}); was it copied completely?")
        # np.memmap refuses empty files.
        self.tokens = (np.memmap(data, mode="r", dtype=self.dtype, shape=(self.num_tokens,))
                       if self.num_tokens else np.zeros(0, self.dtype))
        self._document_offsets = None

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def document_offsets(self) -> np.ndarray:
        """int64[num_documents + 1]: where each document starts in `tokens`, then the total."""
        if self._document_offsets is None:
            item_starts = np.append(self.pointers // self.dtype.itemsize, self.num_tokens)
            self._document_offsets = item_starts[self.doc_idx]
        return self._document_offsets

    def document_start(self, d: int) -> int:
        """Where document d starts in `tokens` (d = num_documents: the number of tokens); reads two entries."""
        item = int(self.doc_idx[d])
        return int(self.pointers[item]) // self.dtype.itemsize if item < len(self.sizes) else self.num_tokens

    def one_item_per_document(self, start: int = 0, end: int | None = None) -> bool:
        """Documents start..end-1 are items start..end-1 (doc_idx[start:end+1] counts up by one).

        Only that part of doc_idx is read, a block at a time with pread rather than through the
        memory map, so that it does not stay in this process' memory (it is used once).
        """
        end = self.num_documents if end is None else end
        if end >= len(self.doc_idx) or end - start > len(self.sizes):
            return False
        block = 1 << 20
        with open(idx_path(self.prefix), "rb") as f:
            for b in range(start, end + 1, block):
                count = min(block, end + 1 - b)
                values = np.frombuffer(os.pread(f.fileno(), 8 * count, self._doc_idx_offset + 8 * b), np.int64)
                if not np.array_equal(values, np.arange(b, b + count)):
                    return False
        return True

    def document_sizes_for(self, start: int, end: int) -> np.ndarray:
        """Tokens per document, right for the documents start..end-1 (indexed by document id).

        The index's own int32 `sizes`, no copy and nothing read but those entries, when those
        documents are one item each (as this toolkit and PaddleNLP's create_pretraining_data.py
        write them); else computed for all documents from the offsets.
        """
        return self.sizes if self.one_item_per_document(start, end) else self.document_sizes

    @property
    def document_sizes(self) -> np.ndarray:
        return np.diff(self.document_offsets)

    def document_spans(self, documents: np.ndarray, single_items: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) in `tokens` of several documents at once (int64).

        single_items: whether these documents are one item each, when the caller already knows
        (GPTDataset checks its range once); None: checked here from doc_idx.
        """
        documents = np.asarray(documents, dtype=np.int64)
        if single_items is None:
            single_items = bool(len(self.sizes)) and np.array_equal(self.doc_idx[documents], documents) \
                and np.array_equal(self.doc_idx[documents + 1], documents + 1)
        if single_items:
            starts = self.pointers[documents] // self.dtype.itemsize  # one item each: no offsets array needed
            return starts, starts + self.sizes[documents]
        offsets = self.document_offsets
        return offsets[documents], offsets[documents + 1]

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, d: int) -> np.ndarray:
        if not -self.num_documents <= d < self.num_documents:
            raise IndexError(f"document {d} out of range ({self.num_documents} documents)")
        d %= self.num_documents
        return self.tokens[self.document_start(d):self.document_start(d + 1)]

    def warmup(self) -> None:
        """Read the files once so the page cache holds them (PaddleNLP's skip_warmup=False)."""
        for path in (idx_path(self.prefix), bin_path(self.prefix)):
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


class IndexedWriter:
    """Writes prefix.bin/.idx, one item per document.

    Data goes to temporary files that get their final names only in finalize(),
    so a crash never leaves a .bin/.idx pair that looks complete. Use as a
    context manager: leaving the block normally finalizes, an exception discards.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)  # fail early on an unstorable dtype
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp, self._idx_tmp = bin_path(prefix) + suffix, idx_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = array.array("i")  # compact: corpora can hold many millions of documents
        self.num_tokens = 0

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, [tokens.size])

    def add_documents(self, tokens: np.ndarray, sizes) -> None:
        """Several documents at once: `tokens` back to back, `sizes` tokens each."""
        tokens = np.asarray(tokens)
        if tokens.size and self.dtype.kind in "iu" and (
                tokens.min() < np.iinfo(self.dtype).min or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside {self.dtype.name}: [{tokens.min()}, {tokens.max()}]")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.extend(int(size) for size in sizes)
        self.num_tokens += int(tokens.size)

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if self._sizes else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(sizes), len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
        # .bin first: a reader that sees the new .idx also sees its data.
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def discard(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


def write_documents(prefix: str, documents, dtype) -> None:
    """Convenience: write an iterable of token sequences as prefix.bin/.idx."""
    with IndexedWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add_document(tokens)
