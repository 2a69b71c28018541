"""Run trainings (one process or a fleet launch) and compare them step by step.

A parity test trains the same model on the same data from the same initial
weights once in a single process and once under a parallel layout with the
same global batch, then compares the per-step loss and global gradient norm
(train_log.jsonl) and the final weights (merged from every rank's checkpoint
shard) within 1e-5.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from launch_utils import REPO_ROOT, launch

TRAIN_RUNS = REPO_ROOT / "tests" / "workers" / "train_runs.py"
RUN_PRETRAIN = REPO_ROOT / "llm_pretrain" / "run_pretrain.py"
TOLERANCE = 1e-5


def base_arguments(corpus: dict, work_dir: Path, **overrides) -> dict:
    """A short run of a tiny model: 5 optimizer steps of 8 samples x 32 tokens, clipping active.

    adam_epsilon is 1e-5 rather than 1e-8: with 1e-8 Adam turns the last-bit summation-order
    differences of near-zero gradients into updates of a sizeable fraction of the learning rate,
    so weights could differ by 1e-4 after a few steps while losses and norms agree to 1e-7.
    """
    args = {
        "model_name_or_path": "llama-tiny", "num_hidden_layers": 8,
        "tokenizer_name_or_path": corpus["tokenizer"], "input_dir": corpus["input_dir"],
        "data_cache": str(work_dir / "index-cache"), "split": "949,50,1",
        "max_seq_length": 32, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
        "per_device_eval_batch_size": 2, "learning_rate": 0.003, "min_learning_rate": 0.0003,
        "warmup_steps": 1, "max_steps": 5, "logging_steps": 1, "save_steps": 5, "max_grad_norm": 1.0,
        "weight_decay": 0.01, "adam_epsilon": 1e-5, "do_eval": False, "disable_tqdm": True, "seed": 7,
        "device": "cpu",
    }
    args.update(overrides)
    return args


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def argv(args_file: Path, output_dir: Path, **overrides) -> list[str]:
    """run_pretrain.py arguments: the file, the output_dir and `--key value` overrides."""
    out = [str(args_file), "--output_dir", str(output_dir)]
    for key, value in overrides.items():
        out += [f"--{key}", json.dumps(value) if isinstance(value, (bool, list)) else str(value)]
    return out


def run_single(runs: list[list[str]], work_dir: Path, name: str, timeout: int = 600) -> None:
    """Several trainings one after the other in one plain process (no launcher)."""
    runs_file = write_json(work_dir / f"{name}.runs.json", runs)
    result = subprocess.run([sys.executable, str(TRAIN_RUNS), str(runs_file)], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO_ROOT, env=_single_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def _single_env() -> dict:
    import os

    env = dict(os.environ)
    env.pop("PADDLE_TRAINERS_NUM", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])
    return env


def run_launch(nproc: int, runs: list[list[str]], work_dir: Path, name: str, timeout: int = 600, **kwargs):
    """Several trainings with the same parallel degrees in one `paddle.distributed.launch`."""
    runs_file = write_json(work_dir / f"{name}.runs.json", runs)
    result = launch(str(TRAIN_RUNS), nproc, [str(runs_file)], log_dir=work_dir / f"{name}.log", timeout=timeout,
                    **kwargs)
    result.check()
    return result


def train_records(output_dir: Path) -> list[dict]:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "train"]


def run_record(output_dir: Path) -> dict:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "run"][-1]


def final_weights(output_dir: Path, step: int = 5) -> dict[str, np.ndarray]:
    from llm_pretrain.checkpoint import merge_checkpoint

    return merge_checkpoint(str(Path(output_dir) / f"checkpoint-{step}"))


def assert_same_training(reference: Path, other: Path, step: int = 5, tolerance: float = TOLERANCE) -> dict:
    """Per-step loss and grad norm, then the final weights, equal within tolerance. Returns the diffs."""
    ref, got = train_records(reference), train_records(other)
    assert [r["step"] for r in got] == [r["step"] for r in ref], f"{other}: steps differ"
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, got))
    assert loss_diff <= tolerance, f"{other}: losses {[r['loss'] for r in got]} vs {[r['loss'] for r in ref]}"
    assert all(r["grad_norm"] is not None for r in got), f"{other}: no grad norm logged"
    norm_diff = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(ref, got))
    assert norm_diff <= tolerance, f"{other}: grad norms {[r['grad_norm'] for r in got]} vs " \
                                   f"{[r['grad_norm'] for r in ref]}"
    ref_weights, weights = final_weights(reference, step), final_weights(other, step)
    assert sorted(weights) == sorted(ref_weights), f"{other}: parameter names differ"
    weight_diffs = {name: float(np.abs(weights[name] - value).max()) for name, value in ref_weights.items()}
    worst = max(weight_diffs, key=weight_diffs.get)
    assert weight_diffs[worst] <= tolerance, f"{other}: {worst} differs by {weight_diffs[worst]}"
    return {"loss": loss_diff, "grad_norm": norm_diff, "weights": weight_diffs[worst]}


def assert_every_replica_matches(reference: Path, other: Path, step: int = 5, tolerance: float = TOLERANCE) -> dict:
    """Every rank's copy of every weight and of its optimizer state equals the single-process one.

    `final_weights` merges one copy of each parameter (tensor-parallel rank 0's norms, the first
    stage's tied embedding); here each shard file of the checkpoint is compared on its own: the
    replicated norms of every tensor-parallel rank, both pipeline ends' copies of a tied embedding,
    and each rank's AdamW moments (sliced like its weights; under sharding every state held by
    some rank). Tensors whose shape is not a tensor-parallel slice of the full one (stage-3 flat
    slices) are counted and returned, not compared. Returns the largest differences.
    """
    import paddle

    from llm_pretrain.checkpoint import SPLIT_KEY
    from models.weights import local_slice

    def load(path):
        return paddle.load(str(path), return_numpy=True)

    ref_dir, got_dir = Path(reference) / f"checkpoint-{step}", Path(other) / f"checkpoint-{step}"
    ref_weights = load(ref_dir / "model_state.tp00_pp00.pdparams")
    ref_weights.pop(SPLIT_KEY)
    ref_optimizer = {k: v for k, v in load(ref_dir / "optimizer.tp00_pp00.pdopt").items()
                     if isinstance(v, np.ndarray)}
    model_files = sorted(got_dir.glob("model_state.*.pdparams"))
    tp_degree = len({re.search(r"tp(\d+)", f.name).group(1) for f in model_files})
    tags: dict[tuple[str, str], object] = {}  # (tp_pp tag, canonical name) -> split tags
    worst = {"weights": 0.0, "optimizer": 0.0}
    not_slices, held_states = [], set()

    def compare(kind, where, full, got, param):
        expected = full if got.shape == full.shape else local_slice(  # whole (replicated, Adam's beta powers)
            full, param, int(re.search(r"tp(\d+)", where).group(1)), tp_degree)
        if expected.shape != got.shape:
            not_slices.append(where)
            return
        diff = float(np.abs(expected - got).max()) if got.size else 0.0
        assert diff <= tolerance, f"{other}: {where} differs from one process by {diff}"
        worst[kind] = max(worst[kind], diff)

    for file in model_files:
        shard = re.search(r"(tp\d+_pp\d+)", file.name).group(1)
        state = load(file)
        for name, (axis, parts, _replica) in state.pop(SPLIT_KEY).items():
            param = SimpleNamespace(tp_split_axis=axis, tp_split_parts=parts)
            tags[shard, name] = param
            compare("weights", f"{file.name}:{name}", ref_weights[name], state[name], param)
    for file in sorted(got_dir.glob("optimizer.*.pdopt")):
        shard = re.search(r"(tp\d+_pp\d+)", file.name).group(1)
        names = sorted({name for s, name in tags if s == shard}, key=len, reverse=True)
        for key, value in load(file).items():
            if not isinstance(value, np.ndarray):
                continue  # the schedule, master weights (none in fp32)
            name = next((n for n in names if key.startswith(n + "_")), None)
            if name is None or key not in ref_optimizer:
                not_slices.append(f"{file.name}:{key}")
                continue
            held_states.add(key)
            compare("optimizer", f"{file.name}:{key}", ref_optimizer[key], value, tags[shard, name])
    if not any("_sd" in f.name for f in model_files):  # not stage 3: every state is held and compared
        assert not not_slices, f"{other}: not comparable with one process: {not_slices[:5]}"
        assert held_states == set(ref_optimizer), \
            f"{other}: optimizer states held by no rank: {sorted(set(ref_optimizer) - held_states)[:5]}"
    return {**worst, "not_compared": len(not_slices)}
