"""The data pipeline, ours vs PaddleNLP 2.8.1, stage by stage: preparation, index build, sample reads.

    python scripts/data_benchmark.py [--rounds 3 --prep-mb 40 --documents 4000000 --tokens 2.2e9 --out benchmarks/]

Every measurement is its own process (imports done before the clock starts), ours and PaddleNLP's
alternating, --rounds times each (this shared 2-core machine drifts; alternating lets both sides
see the same drift); tables give the median and the spread (min-max) of the rounds.

1. Preparation: JSON lines (the embedded corpus' text repeated to --prep-mb MB) tokenized with its
   sentencepiece tokenizer on 2 worker processes: our llm_pretrain.data.prepare_jsonl vs PaddleNLP's
   llm/tools/preprocess/create_pretraining_data.py (--append_eos). That tool is not in the paddlenlp
   wheel; `paddlenlp_create_pretraining_data` below runs its main() and Converter.encode on the
   paddlenlp pieces they call (AutoTokenizer, indexed_dataset.make_builder, multiprocessing.Pool
   imap in chunks of 256). Tokens per second of the call, and whether the outputs are byte-identical.
2. Index build: synthetic prefixes of --documents documents and --tokens tokens each (the .idx
   written in full, the .bin a sparse file of the right size), sequence 4096: one prefix for 1
   epoch, for 3 epochs, and a 3-way blend; our build_pretraining_datasets vs PaddleNLP's
   causal_dataset.build_train_valid_test_datasets (its compiled tool_helpers), fresh (empty cache)
   and cached (a new process finding the cache); wall time of the call and its peak memory (the
   process' peak RSS, VmHWM, reset just before the call, minus the RSS before it). The arrays of
   both sides are compared (equal: the run says so).
3. Sample reads: samples of 1024 + 1 tokens read in training order from the prepared corpus.

Writes OUT/data_pipeline.md and OUT/data_pipeline.json. About 15 minutes with the defaults; the
synthetic data needs ~250 MB of disk (the .bin files are sparse).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from llm_pretrain.observe import flops, perf  # (neither imports Paddle)
from llm_pretrain.errors import UsageArgumentParser

SEQ_INDEX, SEQ_READS, SEED = 4096, 1024, 1234
INDEX_CASES = {  # name -> (prefixes, samples as a multiple of one prefix's samples per epoch)
    "1 prefix, 1 epoch": (1, 0.99),
    "1 prefix, 3 epochs": (1, 2.9),
    "3-way blend": (3, 2.8),  # blended samples in all; each prefix gets its share x 1.005
}


# ----------------------------------------------------------------------------- PaddleNLP's preparation tool
def paddlenlp_create_pretraining_data(jsonl: str, tokenizer_dir: str, prefix: str, workers: int = 1,
                                      max_repeated_len: int = 100, json_key: str = "text") -> None:
    """PaddleNLP 2.8.1's llm/tools/preprocess/create_pretraining_data.py --append_eos, on one JSON-lines file.

    That tool is not part of the paddlenlp wheel; this is its main() with Converter.encode and
    IdentitySplitter on the paddlenlp pieces they call: per line json.loads, `remove_repeated_chars`
    (re.sub(r"(.)\\1{100,}", r"\\1", text)), `sentence.strip()`, tokenizer.tokenize +
    convert_tokens_to_ids, a document only when it has tokens, EOS appended to its last sentence;
    uint16 below 65535 tokens, else int32; Pool(workers).imap(encode, lines, 256).
    """
    from paddlenlp.data import indexed_dataset
    from paddlenlp.transformers import AutoTokenizer

    import numpy as np

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dtype = np.uint16 if tokenizer.vocab_size < 2**16 - 1 else np.int32
    builder = indexed_dataset.make_builder(prefix + ".bin", "mmap", dtype)
    encode = _PaddleNLPEncoder(tokenizer_dir, json_key, max_repeated_len)
    with open(jsonl, encoding="utf-8") as lines:
        if workers == 1:
            encode.initializer()
            documents = map(encode, lines)
            pool = None
        else:
            import multiprocessing

            pool = multiprocessing.Pool(workers, initializer=encode.initializer)
            documents = pool.imap(encode, lines, 256)
        for document in documents:
            if not document:
                continue
            for sentence in document:
                builder.add_item(sentence)
            builder.end_document()
        if pool is not None:
            pool.close()
    builder.finalize(prefix + ".idx")


class _PaddleNLPEncoder:
    """The tool's Converter (IdentitySplitter, no Chinese word segmentation), picklable for the pool."""

    tokenizer = None

    def __init__(self, tokenizer_dir: str, json_key: str, max_repeated_len: int):
        self.tokenizer_dir, self.json_key, self.max_repeated_len = tokenizer_dir, json_key, max_repeated_len

    def initializer(self):
        from paddlenlp.transformers import AutoTokenizer

        _PaddleNLPEncoder.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def __call__(self, json_line: str) -> list[list[int]]:
        import re

        tokenizer = _PaddleNLPEncoder.tokenizer
        text = json.loads(json_line)[self.json_key]
        text = re.sub(r"(.)\1{" + str(self.max_repeated_len) + ",}", r"\1", text)
        document = []
        for sentence in (text,):
            ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(sentence.strip()))
            if ids:
                document.append(ids)
        if document:
            document[-1].append(tokenizer.eos_token_id)
        return document


# ----------------------------------------------------------------------------- measuring inside a worker
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux >= 4.0: write 5 to /proc/self/clear_refs); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def timed_call(function) -> tuple[object, dict]:
    """Run function(); its wall time and peak memory above the RSS before it."""
    import gc

    gc.collect()
    before = rss_bytes()
    exact = reset_peak_rss()
    start = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - start
    return result, {"seconds": seconds, "peak_mb": max(0, peak_rss_bytes() - before) / 2**20, "peak_exact": exact}


def digest(*arrays) -> str:
    """One hash of arrays' values (int64), so that both sides' dtypes compare by value."""
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.asarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def worker(spec: dict) -> dict:
    kind, side = spec["kind"], spec["side"]
    quiet = open(os.devnull, "w")
    if kind == "prep":
        if side == "ours":
            # Imported before the clock, as `import paddlenlp.transformers` imports them for PaddleNLP's side.
            import multiprocessing.pool  # noqa: F401
            import sentencepiece  # noqa: F401

            from llm_pretrain.data import prepare_jsonl

            run = lambda: prepare_jsonl([spec["jsonl"]], spec["tokenizer"], spec["prefix"], workers=spec["workers"],
                                        progress=False)
        else:
            import paddlenlp.transformers  # noqa: F401  (imported before the clock, as ours is)

            run = lambda: paddlenlp_create_pretraining_data(spec["jsonl"], spec["tokenizer"], spec["prefix"],
                                                            workers=spec["workers"])
        stdout, sys.stdout = sys.stdout, quiet
        try:
            _, figures = timed_call(run)
        finally:
            sys.stdout = stdout
        with open(spec["prefix"] + ".bin", "rb") as f:
            figures["bin_sha"] = hashlib.sha256(f.read()).hexdigest()[:16]
        with open(spec["prefix"] + ".idx", "rb") as f:
            figures["idx_sha"] = hashlib.sha256(f.read()).hexdigest()[:16]
        return figures

    prefixes, samples, seq = spec["prefixes"], spec["samples"], spec["seq"]
    if side == "ours":
        from llm_pretrain.data import build_pretraining_datasets

        input_dir = prefixes[0] if len(prefixes) == 1 else " ".join(f"1 {p}" for p in prefixes)
        build = lambda: build_pretraining_datasets(input_dir, "1,0,0", seq, SEED, (samples, 0, 0),
                                                   data_cache=spec["cache"])[0]
    else:
        from paddlenlp.data import causal_dataset

        data_prefix = prefixes if len(prefixes) == 1 else [x for p in prefixes for x in ("1", p)]
        build = lambda: causal_dataset.build_train_valid_test_datasets(
            data_prefix, "mmap", "1,0,0", [samples, 0, 0], seq, SEED, True, data_cache_path=spec["cache"])[0]
    stdout, sys.stdout = sys.stdout, quiet
    try:
        dataset, figures = timed_call(build)
    finally:
        sys.stdout = stdout
    if kind == "reads":
        count = min(spec["reads"], len(dataset))
        read = (lambda i: dataset[i]) if side == "ours" else (lambda i: dataset[i]["text"])
        read(0)
        start = time.perf_counter()
        total = 0
        for i in range(count):
            total += int(read(i)[-1])
        figures = {"samples_per_s": count / (time.perf_counter() - start), "samples": count, "check": total}
        return figures
    parts = dataset.datasets if hasattr(dataset, "datasets") else [dataset]
    figures["arrays"] = digest(*[a for part in parts for a in (part.doc_idx, part.sample_idx, part.shuffle_idx)],
                               # PaddleNLP blends the sum of the parts' sample counts, we the number asked
                               # for: the greedy order does not depend on the length, so compare that many.
                               *([dataset.dataset_index[:samples], dataset.dataset_sample_index[:samples]]
                                 if len(parts) > 1 else []))
    figures["samples"] = len(dataset)
    return figures


# ----------------------------------------------------------------------------- from the parent
def run_worker(root: str, spec: dict) -> dict:
    path = os.path.join(root, f"spec-{time.time_ns()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"worker failed ({done.returncode}) for {spec}:\n{done.stderr[-3000:]}")
    with open(path + ".out", encoding="utf-8") as f:
        return json.load(f)


def write_synthetic_prefix(prefix: str, documents: int, tokens: int, seed: int) -> None:
    """A .idx of `documents` documents totalling about `tokens` tokens (uint16), and a sparse .bin that size."""
    import numpy as np

    from llm_pretrain.data.indexed import _HEADER, MAGIC, VERSION, _dtype_code

    rng = np.random.default_rng(seed)
    mean = tokens / documents
    sizes = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, documents)).astype(np.int64)
    sizes = np.minimum(sizes, 200_000).astype(np.int32)
    pointers = np.zeros(documents, np.int64)
    np.cumsum(sizes[:-1], out=pointers[1:])
    pointers *= 2
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(np.uint16), documents, documents + 1))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(documents + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.sum()) * 2)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def fmt(s: dict, digits: int = 2, scale: float = 1.0) -> str:
    return (f"{s['median'] * scale:,.{digits}f} ({s['min'] * scale:,.{digits}f}-{s['max'] * scale:,.{digits}f})")


def render(results: dict) -> str:
    env, prep, index, reads = results["environment"], results["prep"], results["index"], results["reads"]
    lines = ["# Data pipeline: ours vs PaddleNLP 2.8.1", "",
             f"`python scripts/data_benchmark.py {results['command']}`, {env['date']}: {env['cpu_count']} cores of "
             f"{env['cpu_model']}, Python {env['python']}, NumPy {env['numpy']}, PaddleNLP {env['paddlenlp']}. "
             f"Raw figures: `data_pipeline.json`. Each figure: median (min-max) of {results['rounds']} rounds, ours "
             "and PaddleNLP's alternating, each measurement its own process with its imports done before the "
             "clock starts. This 2-vCPU machine is shared with other jobs: compare the two sides of a row, "
             "not rows of different runs.", "",
             "## Preparation (JSON lines -> .bin/.idx, 2 worker processes)", "",
             f"{prep['megabytes']:.0f} MB of JSON lines ({prep['documents']:,} documents, the embedded corpus' text "
             f"repeated), its sentencepiece tokenizer (vocab 512); PaddleNLP: its create_pretraining_data.py's "
             "steps on its own tokenizer and builder (`paddlenlp_create_pretraining_data`).", "",
             "| | seconds | tokens/s |", "|---|---|---|"]
    for side in ("ours", "paddlenlp"):
        lines.append(f"| {side} | {fmt(prep[side]['seconds'])} | {fmt(prep[side]['tokens_per_s'], 0)} |")
    lines += ["", f"Ours / PaddleNLP: **{prep['ratio']:.1f}x** tokens/s (medians). Outputs byte-identical: "
              f"**{'yes' if prep['identical'] else 'NO'}** ({prep['tokens']:,} tokens).", "",
              f"## Sample-index build (seq {SEQ_INDEX}; synthetic prefixes of {index['documents']:,} documents, "
              f"{index['tokens_per_prefix']:,} tokens each)", "",
              "The build call: our `build_pretraining_datasets` vs PaddleNLP's "
              "`causal_dataset.build_train_valid_test_datasets` (C++ tool_helpers). Fresh: empty cache directory; "
              "cached: a new process finds the cache. Peak memory: the process' peak RSS during the call (VmHWM "
              "reset before it) minus its RSS before.", "",
              "| case | samples | side | fresh s | cached s | fresh peak MB | same arrays |", "|---|---|---|---|---|---|---|"]
    for name, case in index["cases"].items():
        for side in ("ours", "paddlenlp"):
            r = case[side]
            lines.append(f"| {name} | {case['samples']:,} | {side} | {fmt(r['fresh_s'], 3)} | {fmt(r['cached_s'], 3)} "
                         f"| {fmt(r['fresh_peak_mb'], 0)} | {'yes' if case['same_arrays'] else 'NO'} |")
        lines.append(f"| | | ours / PaddleNLP time | **{case['fresh_speedup']:.2f}x faster** | "
                     f"**{case['cached_speedup']:.2f}x faster** | | |")
    lines += ["", f"## Sample reads ({SEQ_READS} + 1 tokens, training order, prepared corpus above)", "",
              "| side | samples/s |", "|---|---|"]
    for side in ("ours", "paddlenlp"):
        lines.append(f"| {side} | {fmt(reads[side], 0)} |")
    lines += ["", f"Ours / PaddleNLP: **{reads['ratio']:.2f}x**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = UsageArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per side (default 3)")
    parser.add_argument("--prep-mb", type=float, default=40, help="MB of JSON lines to prepare (default 40)")
    parser.add_argument("--documents", type=int, default=4_000_000, help="documents per synthetic prefix")
    parser.add_argument("--tokens", type=float, default=2.2e9, help="tokens per synthetic prefix")
    parser.add_argument("--reads", type=int, default=20000, help="samples read per run (default 20000)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks"), help="for the .md and .json")
    parser.add_argument("--work-dir", help="data and caches; kept (default: a temporary directory, removed)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        with open(options.worker, encoding="utf-8") as f:
            result = worker(json.load(f))
        with open(options.worker + ".out", "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    if options.rounds < 1 or options.documents < 10 or options.tokens < options.documents or options.prep_mb <= 0:
        parser.error("--rounds >= 1, --documents >= 10, --tokens >= --documents, --prep-mb > 0")

    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.data.embedded import DEFAULT_OUT_DIR

    root = options.work_dir or tempfile.mkdtemp(prefix="data_bench_")
    os.makedirs(root, exist_ok=True)
    corpus = ensure_embedded_corpus(DEFAULT_OUT_DIR if os.path.isfile(os.path.join(DEFAULT_OUT_DIR, "DONE.json"))
                                    else os.path.join(root, "embedded"))
    sides = ("ours", "paddlenlp")

    # 1. preparation
    jsonl = os.path.join(root, "prep.jsonl")
    with open(os.path.join(os.path.dirname(corpus["input_dir"]), "corpus.jsonl"), encoding="utf-8") as f:
        text = f.read()
    with open(jsonl, "w", encoding="utf-8") as f:
        written = 0
        while written < options.prep_mb * 1e6:
            f.write(text)
            written += len(text.encode("utf-8"))
    documents = sum(1 for _ in open(jsonl, encoding="utf-8"))
    prep_runs = {side: [] for side in sides}
    for round_ in range(options.rounds):
        for side in sides:
            spec = {"kind": "prep", "side": side, "jsonl": jsonl, "tokenizer": corpus["tokenizer"], "workers": 2,
                    "prefix": os.path.join(root, f"prep-{side}")}
            prep_runs[side].append(run_worker(root, spec))
            print(f"[prep {round_ + 1}] {side}: {prep_runs[side][-1]['seconds']:.1f} s", flush=True)
    from llm_pretrain.data import IndexedDataset

    tokens = IndexedDataset(os.path.join(root, "prep-ours")).num_tokens
    prep = {"megabytes": written / 1e6, "documents": documents, "tokens": tokens,
            "identical": all(len({r[k] for side in sides for r in prep_runs[side]}) == 1 for k in ("bin_sha", "idx_sha"))}
    for side in sides:
        prep[side] = {"seconds": summary([r["seconds"] for r in prep_runs[side]]),
                      "tokens_per_s": summary([tokens / r["seconds"] for r in prep_runs[side]]), "runs": prep_runs[side]}
    prep["ratio"] = prep["ours"]["tokens_per_s"]["median"] / prep["paddlenlp"]["tokens_per_s"]["median"]
    print(f"prep: ours/PaddleNLP {prep['ratio']:.1f}x, identical {prep['identical']}", flush=True)

    # 2. index build
    synthetic = os.path.join(root, "synthetic")
    os.makedirs(synthetic, exist_ok=True)
    prefixes = [os.path.join(synthetic, f"part{i}_text_document") for i in range(3)]
    for i, prefix in enumerate(prefixes):
        if not os.path.isfile(prefix + ".idx"):
            write_synthetic_prefix(prefix, options.documents, int(options.tokens), seed=i)
    per_epoch = (IndexedDataset(prefixes[0]).num_tokens - 1) // SEQ_INDEX
    index = {"documents": options.documents, "tokens_per_prefix": IndexedDataset(prefixes[0]).num_tokens, "cases": {}}
    for name, (count, multiple) in INDEX_CASES.items():
        samples = int(per_epoch * multiple)
        runs = {side: [] for side in sides}
        for round_ in range(options.rounds):
            for side in sides:
                cache = os.path.join(root, "cache", f"{side}-{len(index['cases'])}-{round_}")
                shutil.rmtree(cache, ignore_errors=True)
                spec = {"kind": "index", "side": side, "prefixes": prefixes[:count], "samples": samples,
                        "seq": SEQ_INDEX, "cache": cache}
                fresh = run_worker(root, spec)
                cached = run_worker(root, spec)
                runs[side].append({"fresh": fresh, "cached": cached})
                shutil.rmtree(cache, ignore_errors=True)
                print(f"[{name} {round_ + 1}] {side}: fresh {fresh['seconds']:.3f} s {fresh['peak_mb']:.0f} MB, "
                      f"cached {cached['seconds']:.3f} s", flush=True)
        case = {"samples": samples, "same_arrays": len({r[k]["arrays"] for side in sides for r in runs[side]
                                                         for k in ("fresh", "cached")}) == 1}
        for side in sides:
            case[side] = {"fresh_s": summary([r["fresh"]["seconds"] for r in runs[side]]),
                          "cached_s": summary([r["cached"]["seconds"] for r in runs[side]]),
                          "fresh_peak_mb": summary([r["fresh"]["peak_mb"] for r in runs[side]]), "runs": runs[side]}
        case["fresh_speedup"] = case["paddlenlp"]["fresh_s"]["median"] / case["ours"]["fresh_s"]["median"]
        case["cached_speedup"] = case["paddlenlp"]["cached_s"]["median"] / case["ours"]["cached_s"]["median"]
        index["cases"][name] = case

    # 3. sample reads (the prepared corpus; its index built once per side before the timed reads)
    reads = {side: [] for side in sides}
    for side in sides:  # PaddleNLP's cache name does not change with --prep-mb: a kept --work-dir would reuse it
        shutil.rmtree(os.path.join(root, "cache", f"reads-{side}"), ignore_errors=True)
    for round_ in range(options.rounds):
        for side in sides:
            spec = {"kind": "reads", "side": side, "prefixes": [os.path.join(root, f"prep-{side}")],
                    "samples": options.reads, "seq": SEQ_READS, "reads": options.reads,
                    "cache": os.path.join(root, "cache", f"reads-{side}")}
            reads[side].append(run_worker(root, spec)["samples_per_s"])
            print(f"[reads {round_ + 1}] {side}: {reads[side][-1]:.0f} samples/s", flush=True)
    reads = {side: summary(values) for side, values in reads.items()}
    reads["ratio"] = reads["ours"]["median"] / reads["paddlenlp"]["median"]

    from importlib.metadata import version

    import numpy

    results = {"command": " ".join(argv), "rounds": options.rounds, "prep": prep, "index": index, "reads": reads,
               "environment": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "cpu_model": perf.cpu_model_name(), "cpu_count": flops.cpu_count(),
                               "python": platform.python_version(), "numpy": numpy.__version__,
                               "paddlenlp": version("paddlenlp")}}
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, "data_pipeline.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    markdown = render(results)
    perf.write_keeping_findings(os.path.join(options.out, "data_pipeline.md"), markdown)
    print("\n" + markdown, flush=True)
    if not options.work_dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
