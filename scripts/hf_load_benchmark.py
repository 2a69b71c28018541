"""Peak host memory and time of training's load from a Hugging Face directory (models/hf_directory.py).

    python scripts/hf_load_benchmark.py [--model Qwen/Qwen2-0.5B] [--dtype bfloat16] [--max-shard-size 300MB]

A Hugging Face directory of the model (config.json as its class writes it, safetensors shards of at most
--max-shard-size, pseudo-random values) is synthesized tensor by tensor with the exporter's writer
(llm_pretrain/checkpoint/hf_export.py). Then, in a child process, the model is built (float32, as a CPU run
builds it) and `load_weights_file` maps the directory into it, as `model_name_or_path: HF_DIR` does at the
start of training. The parent samples the child's /proc/<pid>/status every 50 ms (scripts/hf_export_benchmark.py):
the growth of RssAnon over the built model is what loading allocates. Writes the section "## Training from a
Hugging Face directory" of benchmarks/checkpoint_io.md (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from hf_export_benchmark import _status_kib, write_section

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Training from a Hugging Face directory"


def synthesize_hf_directory(model_name: str, dtype: str, max_shard_bytes: int, path: str) -> dict:
    """The model's Hugging Face directory with pseudo-random weights; {"parameters", "bytes", "largest", "shards"}."""
    import numpy as np

    from llm_pretrain.checkpoint.hf_export import (INDEX_NAME, SAFETENSORS_CODES, _storage, _their_shape, shard,
                                                   shard_names, write_safetensors_file)
    from models.families import get_family
    from models.paddlenlp_interop import _expand, canonical_shapes
    from models.registry import ARCHITECTURES

    config = ARCHITECTURES[model_name]
    target = get_family(config.family).hugging_face
    ours = canonical_shapes(config)
    planned = []
    for rule in _expand(target.table(config), config.num_hidden_layers):
        if rule.export_only:
            continue
        shape = _their_shape(rule.join, [tuple(ours[name]) for name in rule.ours])
        planned.append({"name": rule.theirs, "shape": shape, "dtype": dtype,
                        "bytes": math.prod(shape) * np.dtype(_storage(dtype)).itemsize})
    rng = np.random.default_rng(0)
    pool = rng.integers(0x3C00, 0x3D00, size=1 << 22).astype(np.uint16) if dtype == "bfloat16" else \
        (0.02 * rng.standard_normal(1 << 22)).astype(dtype)
    shards = shard(planned, max_shard_bytes)
    names = shard_names(len(shards))
    os.makedirs(path)
    for name, tensors in zip(names, shards):
        write_safetensors_file(os.path.join(path, name), tensors,
                               lambda t: np.resize(pool, t["shape"]).astype(_storage(t["dtype"])))
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": sum(t["bytes"] for t in planned)},
                       "weight_map": {t["name"]: n for n, ts in zip(names, shards) for t in ts}}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**target.config_json(config), "torch_dtype": dtype}, f, indent=2)
    assert dtype in SAFETENSORS_CODES
    return {"parameters": sum(math.prod(t["shape"]) for t in planned),
            "bytes": sum(t["bytes"] for t in planned), "largest": max(t["bytes"] for t in planned),
            "shards": [sum(t["bytes"] for t in ts) for ts in shards]}


CHILD = """
import json, time
import paddle
from models.decoder import CausalLM
from models.registry import resolve_model
from models.weights import load_weights_file
config, weights_file = resolve_model({directory!r})
model = CausalLM(config)
built = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")][0]
print("BUILT", flush=True)
start = time.perf_counter()
load_weights_file(model, config, weights_file)
print(json.dumps({{"load_s": time.perf_counter() - start, "built_kib": built,
                  "model_bytes": sum(p.numel().item() * 4 for p in model.parameters())}}))
"""


def measure_load(directory: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(directory=directory)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    peaks = {"RssAnon": 0, "RssFile": 0}

    def sample():
        while child.poll() is None:
            for key, value in _status_kib(child.pid).items():
                if key in peaks:
                    peaks[key] = max(peaks[key], value)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    stdout, stderr = child.communicate()
    sampler.join()
    if child.returncode != 0:
        sys.exit(f"load failed: {stderr[-3000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), **{k: v * 1024 / 1e9 for k, v in peaks.items()}}


def main() -> None:
    from llm_pretrain.checkpoint.hf_export import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2-0.5B")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-shard-size", default="300MB")
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "checkpoint_io.md"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="hf_load_bench_", dir=args.work)
    try:
        made = synthesize_hf_directory(args.model, args.dtype, parse_size(args.max_shard_size),
                                       os.path.join(work, "hf"))
        result = measure_load(os.path.join(work, "hf"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0]
    built = result["built_kib"] * 1024 / 1e9
    text = "\n".join([
        SECTION,
        "",
        f"`python scripts/hf_load_benchmark.py --model {args.model} --dtype {args.dtype} --max-shard-size "
        f"{args.max_shard_size}` ({time.strftime('%Y-%m-%d')}): `model_name_or_path` set to a synthesized Hugging "
        "Face directory of the model; the model is built in float32 (as a CPU run builds it), then "
        "`models/weights.py` `load_weights_file` maps the directory into it (models/hf_directory.py: one Hugging "
        "Face tensor at a time). Peaks are sampled every 50 ms from the process's /proc status.",
        "",
        "| model | stored dtype | parameters | directory | largest shard | largest tensor (stored) | model built "
        "(RssAnon) | peak RssAnon while loading | loading allocated | peak RssFile | load s | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {args.model} | {args.dtype} | {made['parameters'] / 1e9:.3f} B | {len(made['shards'])} files, "
        f"{made['bytes'] / 1e9:.2f} GB | {max(made['shards']) / 1e9:.2f} GB | {made['largest'] / 1e9:.2f} GB | "
        f"{built:.2f} GB | {result['RssAnon']:.2f} GB | {result['RssAnon'] - built:.2f} GB | "
        f"{result['RssFile']:.2f} GB | {result['load_s']:.1f} | {load:.1f} |",
        "",
        "- \"Loading allocated\" is the peak growth of anonymous memory over the built model: the Hugging Face",
        "  tensor being read (its stored bytes, bfloat16 widened to float32) and our tensor made of it, before",
        "  the parameter takes it. It is bounded by a few times the largest tensor (the embedding), not by a",
        "  shard or the model: nothing else of a file is read (seek + read of one tensor's bytes).",
        "- RssFile is the page cache of the files the process touched (none is memory-mapped: near zero).",
        "",
    ])
    write_section(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
