"""The data side: mmap format (and PaddleNLP compatibility), GPT samples, caching, blending, input checks,
the embedded corpus."""

import filecmp
import os

import numpy as np
import pytest

from llm_pretrain.data import (
    IndexedDataset, build_pretraining_datasets, check_data_inputs, ensure_embedded_corpus, split_document_ranges,
    write_documents,
)
from llm_pretrain.data import embedded, samples
from llm_pretrain.data.samples import BlendedDataset, build_blending_indices
from llm_pretrain.errors import UsageError


def random_documents(n, seed=0, max_len=60, vocab=500):
    rng = np.random.RandomState(seed)
    docs = [rng.randint(0, vocab, size=rng.randint(0, max_len)) for _ in range(n)]
    docs[0] = np.arange(5)  # at least some tokens
    return docs


def make_prefix(directory, name, docs, dtype=np.uint16):
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(str(directory), name)
    write_documents(prefix, docs, dtype)
    return prefix


@pytest.fixture(scope="module")
def paddlenlp_data():
    """PaddleNLP's reference implementation (imported once: it costs several seconds)."""
    indexed = pytest.importorskip("paddlenlp.data.indexed_dataset")
    from paddlenlp.data import causal_dataset

    return indexed, causal_dataset


# ----------------------------------------------------------------------------- mmap format
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, np.uint32])
def test_round_trip_with_empty_documents(tmp_path, dtype):
    docs = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([7]), np.array([]), np.arange(200) % 250]
    prefix = make_prefix(tmp_path, "x", docs, dtype)
    data = IndexedDataset(prefix)
    assert data.dtype == np.dtype(dtype)
    assert len(data) == data.num_documents == 5
    assert data.num_tokens == sum(len(d) for d in docs)
    assert list(data.document_sizes) == [len(d) for d in docs]
    for mine, expected in zip(data, docs):
        assert np.array_equal(mine, expected)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]  # temporaries renamed away


def test_only_empty_documents_and_no_documents(tmp_path):
    data = IndexedDataset(make_prefix(tmp_path, "empty_docs", [[], []]))
    assert (data.num_documents, data.num_tokens) == (2, 0) and data[1].size == 0
    data = IndexedDataset(make_prefix(tmp_path, "none", []))
    assert (data.num_documents, data.num_tokens) == (0, 0)


def test_paddlenlp_writes_we_read(tmp_path, paddlenlp_data):
    indexed, _ = paddlenlp_data
    prefix = str(tmp_path / "theirs")
    docs = random_documents(30, seed=1)
    builder = indexed.make_builder(prefix + ".bin", "mmap", np.uint16)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.add_item(np.array([9, 8]))  # a document of two sentences: we read it as one
    builder.add_item(np.array([7]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    data = IndexedDataset(prefix)
    assert data.num_documents == 31
    for i, doc in enumerate(docs):
        assert np.array_equal(data[i], doc)
    assert list(data[30]) == [9, 8, 7]
    # Looked up without the offsets array while documents are single items, through it after that.
    assert data.one_item_per_document(0, 30) and not data.one_item_per_document(0, 31)
    assert data._document_offsets is None and data.document_sizes_for(0, 30) is data.sizes
    for documents in (np.arange(30), np.arange(31), np.array([29, 3, 30, 0])):
        starts, ends = data.document_spans(documents)
        assert list(starts) == [data.document_start(d) for d in documents]
        assert list(ends - starts) == [len(data[d]) for d in documents]
    assert list(data.document_sizes_for(0, 31)) == [len(d) for d in docs] + [3]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_write_paddlenlp_reads(tmp_path, paddlenlp_data, dtype):
    indexed, _ = paddlenlp_data
    docs = random_documents(40, seed=2)
    prefix = make_prefix(tmp_path, "ours", docs, dtype)
    theirs = indexed.MMapIndexedDataset(prefix)
    assert len(theirs) == len(docs) and theirs._index.dtype == dtype
    assert list(theirs.doc_idx) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i], doc)


# ----------------------------------------------------------------------------- GPT samples
@pytest.fixture()
def corpus(tmp_path):
    return make_prefix(tmp_path / "data", "corpus_text_document", random_documents(200, seed=3))


def test_samples_identical_to_paddlenlp_gpt_dataset(corpus, tmp_path, paddlenlp_data):
    pytest.importorskip("tool_helpers")  # PaddleNLP's compiled index builder
    _, causal_dataset = paddlenlp_data
    counts = (300, 40, 12)
    theirs = causal_dataset.build_train_valid_test_datasets(
        [corpus], "mmap", "8,1,1", list(counts), 16, 1234, True, data_cache_path=str(tmp_path / "their-cache"))
    ours = build_pretraining_datasets(corpus, "8,1,1", 16, 1234, counts, data_cache=str(tmp_path / "our-cache"))
    for mine, reference in zip(ours, theirs):
        assert len(mine) == len(reference)
        for i in range(len(mine)):
            assert np.array_equal(mine[i], reference[i]["text"])


@pytest.mark.parametrize("epochs", [1, 3, 2.3])  # 2.3: the last epoch shuffled on its own
def test_index_arrays_equal_paddlenlp_over_epochs_and_blends(tmp_path, paddlenlp_data, epochs):
    """doc_idx, sample_idx, shuffle_idx (and a 3-way blend's indices) equal PaddleNLP's, value by value."""
    pytest.importorskip("tool_helpers")
    _, causal_dataset = paddlenlp_data
    prefixes = [make_prefix(tmp_path / "d", f"p{i}", random_documents(300, seed=10 + i, max_len=90))
                for i in range(3)]
    per_epoch = (IndexedDataset(prefixes[0]).num_tokens - 1) // 32
    count = int(per_epoch * epochs)
    ours = build_pretraining_datasets(prefixes[0], "1,0,0", 32, 99, (count, 0, 0), data_cache=str(tmp_path / "o"))[0]
    theirs = causal_dataset.build_train_valid_test_datasets([prefixes[0]], "mmap", "1,0,0", [count, 0, 0], 32, 99,
                                                            True, data_cache_path=str(tmp_path / "t"))[0]
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name
    assert len(ours) == len(theirs)

    blend = " ".join(f"{w} {p}" for w, p in zip((0.5, 0.2, 0.3), prefixes))
    ours = build_pretraining_datasets(blend, "1,0,0", 32, 99, (count, 0, 0), data_cache=str(tmp_path / "o"))[0]
    theirs = causal_dataset.build_train_valid_test_datasets(
        [x for w, p in zip(("0.5", "0.2", "0.3"), prefixes) for x in (w, p)], "mmap", "1,0,0", [count, 0, 0], 32, 99,
        True, data_cache_path=str(tmp_path / "t"))[0]
    # PaddleNLP blends the sum of its parts' counts (a few more); the greedy order does not depend on it.
    assert np.array_equal(ours.dataset_index, theirs.dataset_index[:count])
    assert np.array_equal(ours.dataset_sample_index, theirs.dataset_sample_index[:count])
    for mine, reference in zip(ours.datasets, theirs.datasets):
        for name in ("doc_idx", "sample_idx", "shuffle_idx"):
            assert np.array_equal(getattr(mine, name), getattr(reference, name)), name
    for i in range(0, count, max(1, count // 50)):
        assert np.array_equal(ours[i], theirs[i]["text"])


def test_compiled_helpers_equal_the_numpy_and_python_versions():
    assert samples.compiled_helpers() is not None  # a C compiler is part of this test machine
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300, 5000).astype(np.int32)
    sizes[::7] = 0  # empty documents are skipped
    doc_idx = np.tile(np.arange(100, 5000, dtype=np.int32), 3)
    rng.shuffle(doc_idx)
    total = (int(sizes[doc_idx].sum()) - 1) // 64
    compiled = samples.build_sample_idx(sizes, doc_idx, 64, total, int(sizes.max()))  # int32: the C loop
    blocks = samples.build_sample_idx(sizes, doc_idx.astype(np.int64), 64, total, int(sizes.max()))  # NumPy
    assert compiled.dtype == blocks.dtype == np.int32 and np.array_equal(compiled, blocks)
    rng = np.random.default_rng(0)
    for weights, size in (([0.5, 0.2, 0.3], 50000), ([1 / 3] * 3, 50000), (rng.dirichlet(np.ones(7)), 50000),
                          (rng.dirichlet(np.ones(300)), 3000)):  # 300: int64 dataset ids
        compiled = build_blending_indices(weights, size)
        reference = samples.blending_indices_python(weights, size)
        for a, b in zip(compiled, reference):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_samples_are_overlapping_windows_of_the_shuffled_document_stream(corpus, tmp_path):
    train, valid, test = build_pretraining_datasets(corpus, "8,1,1", 16, 7, (500, 30, 30),
                                                    data_cache=str(tmp_path / "c"))
    data = IndexedDataset(corpus)
    for dataset in (train, valid, test):
        stream = np.concatenate([data[d] for d in dataset.doc_idx]).astype(np.int64)
        assert len(dataset) >= 30
        for i in range(len(dataset)):
            sample = dataset[i]
            assert sample.dtype == np.int64 and sample.shape == (17,)
            k = int(dataset.shuffle_idx[i])
            assert np.array_equal(sample, stream[k * 16:k * 16 + 17])
    assert sorted(train.shuffle_idx[:len(train)]) == list(range(len(train)))  # a permutation


def test_splits_use_disjoint_documents(corpus, tmp_path):
    datasets = build_pretraining_datasets(corpus, "8,1,1", 8, 1, (100, 100, 100), data_cache=str(tmp_path / "c"))
    ranges = split_document_ranges("8,1,1", 200)
    assert ranges == [(0, 160), (160, 180), (180, 200)]
    used = [set(np.asarray(d.doc_idx).tolist()) for d in datasets]
    for documents, (start, end) in zip(used, ranges):
        assert documents <= set(range(start, end))
    assert not (used[0] & used[1]) and not (used[1] & used[2]) and not (used[0] & used[2])


def test_deterministic_and_seeded(corpus, tmp_path):
    def samples_of(seed, cache):
        cache_dir = str(tmp_path / cache)
        train, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, seed, (200, 0, 0), data_cache=cache_dir)
        return np.stack([train[i] for i in range(200)])

    assert np.array_equal(samples_of(5, "a"), samples_of(5, "b"))
    assert not np.array_equal(samples_of(5, "a"), samples_of(6, "a"))


def test_unused_splits_are_none(corpus, tmp_path):
    cache = str(tmp_path / "c")
    train, valid, test = build_pretraining_datasets(corpus, "1,0,0", 16, 1, (10, 10, 10), data_cache=cache)
    assert train is not None and valid is None and test is None
    train, valid, test = build_pretraining_datasets(corpus, "949,50,1", 16, 1, (10, 0, 0), data_cache=cache)
    assert len(train) >= 10 and valid is None and test is None


def test_split_without_documents_is_a_usage_error(tmp_path):
    prefix = make_prefix(tmp_path, "tiny", [[1, 2, 3]] * 10)
    with pytest.raises(UsageError, match=r"^split: .*valid split"):
        build_pretraining_datasets(prefix, "949,50,1", 4, 1, (5, 5, 5), data_cache=str(tmp_path / "c"))


# ----------------------------------------------------------------------------- cache
def test_cache_is_written_next_to_the_data_and_reused(corpus, monkeypatch):
    first = build_pretraining_datasets(corpus, "8,1,1", 16, 3, (100, 10, 10))
    cache_dir = os.path.join(os.path.dirname(corpus), "index-cache")
    files = sorted(os.listdir(cache_dir))
    assert len(files) == 9 and not first[0].loaded_from_cache
    assert all(name.endswith(".npy") and not name.startswith(".tmp") for name in files)

    def no_building(*args, **kwargs):
        raise AssertionError("the index was built again instead of loaded")

    monkeypatch.setattr(samples, "build_index_arrays", no_building)
    second = build_pretraining_datasets(corpus, "8,1,1", 16, 3, (100, 10, 10))
    assert all(d.loaded_from_cache for d in second)
    assert isinstance(second[0].sample_idx, np.memmap)
    for a, b in zip(first, second):
        assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    # Different inputs, different files.
    monkeypatch.undo()
    build_pretraining_datasets(corpus, "8,1,1", 32, 3, (100, 10, 10))
    assert len(os.listdir(cache_dir)) == 18


def test_broken_cache_files_are_ignored_or_rebuilt(corpus, tmp_path):
    cache = tmp_path / "cache"
    train, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, 3, (50, 0, 0), data_cache=str(cache))
    reference = [train[i] for i in range(50)]
    # A crashed writer's temporary file, and a truncated cache file.
    (cache / ".tmp-abc123.npy").write_bytes(b"\x93NUMPY garbage")
    sample_file = train.cache_files[1]
    del train  # release its memory maps before cutting the file
    with open(sample_file, "r+b") as f:
        f.truncate(100)
    again, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, 3, (50, 0, 0), data_cache=str(cache))
    assert not again.loaded_from_cache  # the truncated file was detected and rebuilt
    assert all(np.array_equal(again[i], reference[i]) for i in range(50))
    third, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, 3, (50, 0, 0), data_cache=str(cache))
    assert third.loaded_from_cache


def test_cache_key_follows_the_data_file(corpus, tmp_path):
    cache = str(tmp_path / "c")
    train, _, _ = build_pretraining_datasets(corpus, "1", 16, 3, (20, 0, 0), data_cache=cache)
    make_prefix(os.path.dirname(corpus), os.path.basename(corpus), random_documents(200, seed=99))
    os.utime(corpus + ".idx", ns=(1, 1))  # a different mtime even on coarse-grained file systems
    rebuilt, _, _ = build_pretraining_datasets(corpus, "1", 16, 3, (20, 0, 0), data_cache=cache)
    assert not rebuilt.loaded_from_cache and rebuilt.cache_key != train.cache_key


def _build_and_fingerprint(args):
    corpus, cache = args
    train, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, 11, (300, 0, 0), data_cache=cache)
    return np.stack([train[i] for i in range(300)]).tobytes()


def test_concurrent_builds_of_one_cache(corpus, tmp_path):
    import multiprocessing

    cache = str(tmp_path / "shared")
    # spawn, not fork: this process may already run Paddle's threads (from the PaddleNLP fixture).
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_build_and_fingerprint, [(corpus, cache)] * 3)
    assert results[0] == results[1] == results[2] == _build_and_fingerprint((corpus, cache))
    assert sorted(os.listdir(cache)) == sorted(n for n in os.listdir(cache) if not n.startswith(".tmp"))


def test_unwritable_cache_is_a_usage_error(corpus, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UsageError, match=r"^data_cache: cannot write the sample index cache in .*a_file"):
        build_pretraining_datasets(corpus, "1", 16, 1, (10, 0, 0), data_cache=str(tmp_path / "a_file" / "cache"))


# ----------------------------------------------------------------------------- blending
def test_blend_string_fractions_match_weights(tmp_path, monkeypatch):
    make_prefix(tmp_path / "d", "a", random_documents(100, seed=4))
    make_prefix(tmp_path / "d", "b", random_documents(100, seed=5, vocab=100) + [np.full(40, 499)])
    monkeypatch.chdir(tmp_path)  # relative prefixes are relative to the current directory
    train, valid, _ = build_pretraining_datasets("0.7 d/a 0.3 d/b", "9,1,0", 8, 1, (4000, 200, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 4000
    for dataset, n in ((train, 4000), (valid, 200)):
        fraction_a = np.mean(np.asarray(dataset.dataset_index) == 0)
        assert abs(fraction_a - 0.7) < 0.01
    for i in range(0, 4000, 97):  # every blended sample is the named sample of its component
        component = train.datasets[int(train.dataset_index[i])]
        assert np.array_equal(train[i], component[int(train.dataset_sample_index[i])])
    assert os.path.isdir(tmp_path / "d" / "index-cache")


def test_damaged_blend_cache_is_rebuilt_with_a_warning(tmp_path, monkeypatch, capsys):
    """Blending indices damaged on disk (same length, values out of range) are rebuilt, not trusted."""
    make_prefix(tmp_path / "d", "a", random_documents(100, seed=4))
    make_prefix(tmp_path / "d", "b", random_documents(100, seed=5))
    monkeypatch.chdir(tmp_path)
    build = lambda: build_pretraining_datasets("0.6 d/a 0.4 d/b", "1,0,0", 8, 1, (500, 0, 0))[0]
    first = build()
    expected = np.array(first.dataset_sample_index)
    path = next((tmp_path / "d" / "index-cache").glob("blend_*_dataset_sample_index.npy"))
    damaged = expected.copy()
    damaged[7] = 10**9  # a sample no dataset has
    np.save(path, damaged)
    capsys.readouterr()
    again = build()
    assert not again.loaded_from_cache and np.array_equal(again.dataset_sample_index, expected)
    assert f"warning: the cached sample index {tmp_path / 'd' / 'index-cache'}" in capsys.readouterr().err
    assert build().loaded_from_cache  # the rebuilt cache is used from then on


def test_blending_matches_megatron_greedy():
    weights = [0.5, 0.2, 0.3]
    index, sample_index = build_blending_indices(weights, 3000)
    counts = np.zeros(3)
    for s in range(3000):  # the textbook loop, written independently
        best = int(np.argmax([w * max(s, 1) - c for w, c in zip(weights, counts)]))
        assert index[s] == best and sample_index[s] == counts[best]
        counts[best] += 1
    try:
        from tool_helpers import helpers
    except ImportError:
        return
    ref_index, ref_sample = np.zeros(3000, np.uint8), np.zeros(3000, np.int64)
    helpers.build_blending_indices(ref_index, ref_sample, np.array(weights), 3, 3000, False)
    assert np.array_equal(index, ref_index) and np.array_equal(sample_index, ref_sample)


def test_directory_mode_blends_every_prefix_by_tokens(tmp_path):
    directory = tmp_path / "many"
    sizes = {}
    for i, n in enumerate((50, 100, 150)):
        prefix = make_prefix(directory, f"part{i}_text_document", random_documents(n, seed=10 + i))
        sizes[prefix] = IndexedDataset(prefix).num_tokens
    (directory / "notes.txt").write_text("not data")
    train, _, _ = build_pretraining_datasets(str(directory), "1", 8, 1, (3000, 0, 0))
    assert [d.data.prefix for d in train.datasets] == sorted(sizes)
    expected = np.array([sizes[p] for p in sorted(sizes)], dtype=float)
    assert np.allclose(train.weights, expected / expected.sum())
    realized = np.bincount(np.asarray(train.dataset_index), minlength=3) / 3000
    assert np.abs(realized - expected / expected.sum()).max() < 0.01


# ----------------------------------------------------------------------------- input checks
def test_check_data_inputs_accepts_directory_prefix_and_blend(corpus):
    check_data_inputs(os.path.dirname(corpus), "949,50,1")
    check_data_inputs(corpus, "1")
    check_data_inputs(corpus + ".bin", "1,1")
    check_data_inputs(f"2 {corpus} 1 {corpus}", "949/50/1")


@pytest.mark.parametrize("case, split, pattern", [
    ("missing", "949,50,1", r"^input_dir: .*missing_dir does not exist"),
    ("nodata", "949,50,1", r"^input_dir: no prefix\.bin \+ prefix\.idx pair in directory .*nodata"),
    ("bin_only", "949,50,1", r"^input_dir: .*lonely\.bin has no index .*lonely\.idx"),
    ("empty", "949,50,1", r"^input_dir: empty data in .*hollow"),
    ("zero_tokens", "949,50,1", r"^input_dir: empty data in .*blank"),
    ("bad_weight", "949,50,1", r"^input_dir: blend weight '-1' .*not a positive number"),
    ("ok", "949,50", None),
    ("ok", "a,b,c", r"^split: 'a,b,c' must be 1-3 non-negative numbers"),
    ("ok", "1,2,3,4", r"^split: '1,2,3,4'"),
    ("ok", "0,0,0", r"^split: '0,0,0'.*not all zero"),
    ("ok", "1,-1", r"^split: '1,-1'"),
    ("ok", "", r"^split: ''"),
])
def test_check_data_inputs_errors(tmp_path, corpus, case, split, pattern):
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "readme.md").write_text("x")
    (tmp_path / "bin_only").mkdir()
    (tmp_path / "bin_only" / "lonely.bin").write_bytes(b"\0\0")
    make_prefix(tmp_path / "empty", "hollow", [])
    make_prefix(tmp_path / "zero_tokens", "blank", [[], []])
    input_dir = {"missing": str(tmp_path / "missing_dir"), "bad_weight": f"-1 {corpus} 1 {corpus}",
                 "ok": corpus}.get(case, str(tmp_path / case))
    if pattern is None:
        check_data_inputs(input_dir, split)
        return
    with pytest.raises(UsageError, match=pattern) as error:
        check_data_inputs(input_dir, split)
    assert "\n" not in str(error.value)


def test_corrupt_index_is_a_usage_error(tmp_path):
    prefix = str(tmp_path / "junk")
    (tmp_path / "junk.bin").write_bytes(b"\0" * 8)
    (tmp_path / "junk.idx").write_bytes(b"not an index at all, no no no" * 3)
    with pytest.raises(UsageError, match=r"^input_dir: .*junk\.idx is not a PaddleNLP/Megatron mmap index"):
        check_data_inputs(prefix, "1")
    good = make_prefix(tmp_path, "cut", [[1, 2, 3, 4]])
    with open(good + ".bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(UsageError, match=r"^input_dir: .*cut\.bin is shorter than its index"):
        check_data_inputs(good, "1")


# ----------------------------------------------------------------------------- embedded corpus
def test_embedded_corpus_contents(embedded_corpus):
    from llm_pretrain.data.tokenizer import load_tokenizer
    import json

    assert embedded_corpus["documents"] > 5000 and embedded_corpus["tokens"] > 500_000
    data = IndexedDataset(embedded_corpus["prefix"])
    assert (data.num_documents, data.num_tokens) == (embedded_corpus["documents"], embedded_corpus["tokens"])
    assert os.path.dirname(embedded_corpus["prefix"]) == embedded_corpus["input_dir"]
    assert embedded_corpus["prefix"].endswith("embedded_text_document")
    tok = load_tokenizer(embedded_corpus["tokenizer"])
    assert tok.vocab_size == embedded_corpus["vocab_size"] == 512 and tok.eos_token_id is not None
    out_dir = os.path.dirname(embedded_corpus["input_dir"])
    with open(os.path.join(out_dir, "corpus.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(50)]
    for i, text in enumerate(texts):  # documents end with EOS and decode back to the exact text
        assert data[i][-1] == tok.eos_token_id and tok.decode(data[i][:-1]) == text
    assert tok.decode(tok.encode("naïve ∑ 数据")) == "naïve ∑ 数据"  # byte fallback: any text encodes
    check_data_inputs(embedded_corpus["input_dir"], "949,50,1")
    train, valid, _ = build_pretraining_datasets(embedded_corpus["input_dir"], "949,50,1", 64, 1, (100, 10, 0))
    assert train[99].shape == (65,) and train[99].max() < 512 and valid[9].shape == (65,)


def test_embedded_corpus_is_built_once_and_deterministically(embedded_corpus, tmp_path, monkeypatch):
    out_dir = os.path.dirname(embedded_corpus["input_dir"])
    rebuilt = ensure_embedded_corpus(str(tmp_path / "again"))
    again = os.path.dirname(rebuilt["input_dir"])
    for relative in ("data/embedded_text_document.bin", "data/embedded_text_document.idx",
                     "tokenizer/tokenizer.model", "corpus.jsonl"):
        assert filecmp.cmp(os.path.join(out_dir, relative), os.path.join(again, relative), shallow=False), relative
    assert not [name for name in os.listdir(again) if name.startswith(".build-")]

    def no_building(staging):
        raise AssertionError("rebuilt although DONE.json exists")

    monkeypatch.setattr(embedded, "_build", no_building)
    assert ensure_embedded_corpus(again) == rebuilt


def test_sample_reads_agree_with_and_without_the_single_item_shortcut(corpus, tmp_path):
    train, _, _ = build_pretraining_datasets(corpus, "8,1,1", 16, 7, (300, 0, 0), data_cache=str(tmp_path / "c"))
    fast = [train[i] for i in range(len(train))]
    assert train._single_items is True and train.data._document_offsets is None
    train._single_items = False  # what a prefix with multi-item documents takes: spans from the offsets
    assert all(np.array_equal(train[i], sample) for i, sample in enumerate(fast))
    assert train.data._document_offsets is not None  # the offsets path ran
