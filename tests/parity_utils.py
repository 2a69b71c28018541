"""Run trainings (one process or a fleet launch) and compare them step by step.

A parity test trains the same model on the same data from the same initial
weights once in a single process and once under a parallel layout with the
same global batch, then compares the per-step loss and global gradient norm
(train_log.jsonl) and the final weights (merged from every rank's checkpoint
shard) within 1e-5.

The device is DEVICE (launch_utils.device_under_test: LLM_PRETRAIN_TEST_DEVICE, cpu by default).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launch_utils import REPO_ROOT, device_under_test, launch, process_env

TRAIN_RUNS = REPO_ROOT / "tests" / "workers" / "train_runs.py"
RUN_PRETRAIN = REPO_ROOT / "llm_pretrain" / "run_pretrain.py"
TOLERANCE = 1e-5
DEVICE = device_under_test()


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
        "device": DEVICE,
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
    env.update(process_env(DEVICE))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])
    return env


def run_launch(nproc: int, runs: list[list[str]], work_dir: Path, name: str, timeout: int = 600, **kwargs):
    """Several trainings with the same parallel degrees in one `paddle.distributed.launch`."""
    runs_file = write_json(work_dir / f"{name}.runs.json", runs)
    result = launch(str(TRAIN_RUNS), nproc, [str(runs_file)], log_dir=work_dir / f"{name}.log", timeout=timeout,
                    device=DEVICE, **kwargs)
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


def training_differences(reference: Path, other: Path, step: int = 5, weights: bool = True) -> dict:
    """Largest absolute differences of the per-step loss and grad norm, and (`weights`) of the final
    weights (checkpoint-<step>), between two runs; `worst_weight` names the parameter that differs most."""
    ref, got = train_records(reference), train_records(other)
    assert [r["step"] for r in got] == [r["step"] for r in ref], f"{other}: steps differ"
    assert all(r["grad_norm"] is not None for r in got), f"{other}: no grad norm logged"
    diffs = {"loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, got)),
             "relative_loss": max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref, got)),
             "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(ref, got))}
    if weights:
        ref_weights, got_weights = final_weights(reference, step), final_weights(other, step)
        assert sorted(got_weights) == sorted(ref_weights), f"{other}: parameter names differ"
        weight_diffs = {name: float(np.abs(got_weights[name] - value).max()) for name, value in ref_weights.items()}
        diffs["worst_weight"] = max(weight_diffs, key=weight_diffs.get)
        diffs["weights"] = weight_diffs[diffs["worst_weight"]]
    return diffs


def assert_same_training(reference: Path, other: Path, step: int = 5, tolerance: float = TOLERANCE) -> dict:
    """Per-step loss and grad norm, then the final weights, equal within tolerance. Returns the diffs."""
    diffs = training_differences(reference, other, step)
    ref, got = train_records(reference), train_records(other)
    assert diffs["loss"] <= tolerance, f"{other}: losses {[r['loss'] for r in got]} vs {[r['loss'] for r in ref]}"
    assert diffs["grad_norm"] <= tolerance, f"{other}: grad norms {[r['grad_norm'] for r in got]} vs " \
                                            f"{[r['grad_norm'] for r in ref]}"
    assert diffs["weights"] <= tolerance, f"{other}: {diffs['worst_weight']} differs by {diffs['weights']}"
    return {key: diffs[key] for key in ("loss", "grad_norm", "weights")}


# ----------------------------------------------------------------------------- layout checks
# A layout check (tests/test_real_size.py, scripts/gpu_selfcheck.py) trains one model under a
# parallel layout in two parts, stopping with a checkpoint after SAVE_STEP and resuming from it,
# and compares every step with one uninterrupted process. Layouts that give fleet the same
# degrees run one after the other in one launch.

@dataclass(frozen=True)
class LayoutCheck:
    name: str        # the strategy name the run record reports
    nproc: int
    overrides: dict  # run_pretrain keys; the global batch stays the same (4 accumulation steps / data replicas)

    def launch_key(self) -> tuple:
        degrees = {k: v for k, v in self.overrides.items() if k in LAUNCH_DEGREE_KEYS}
        return self.nproc, "sharding" in self.overrides, json.dumps(degrees, sort_keys=True)


LAUNCH_DEGREE_KEYS = ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_pp_degree",
                      "sharding_parallel_degree", "sep_parallel_degree")
_TP2, _PP2 = {"tensor_parallel_degree": 2}, {"pipeline_parallel_degree": 2}
_HALF, _QUARTER = {"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 1}
LAYOUTS = {layout.name: layout for layout in [
    LayoutCheck("dp2", 2, _HALF),
    LayoutCheck("tp2", 2, _TP2),
    LayoutCheck("tp2_sp", 2, {**_TP2, "sequence_parallel": True}),
    LayoutCheck("pp2", 2, _PP2),
    *[LayoutCheck(f"sd2_stage{stage}", 2, {"sharding": f"stage{stage}", **_HALF}) for stage in (1, 2, 3)],
    LayoutCheck("tp2dp2_sp", 4, {**_TP2, "sequence_parallel": True, **_HALF}),
    LayoutCheck("pp2tp2", 4, {**_PP2, **_TP2}),
    *[LayoutCheck(f"tp2sd2_stage{stage}", 4, {**_TP2, "sharding": f"stage{stage}", **_HALF}) for stage in (1, 2)],
    LayoutCheck("dp2sd2_stage1", 4, {"sharding": "stage1", "sharding_parallel_degree": 2, **_QUARTER}),
    LayoutCheck("sep2", 2, {"sep_parallel_degree": 2}),  # sep ranks share samples: accumulation unchanged
]}
SAVE_STEP = 2
# bf16 against fp32 (GPU only): bf16 keeps 8 significant bits, so each rounding of an operand is
# off by up to 2**-9 (0.2 %) relative; with fp32 master weights and an fp32 loss, a few steps from
# the same weights stay within a few roundings. The bound is set by that reasoning, not measured:
# no GPU has run it here.
BF16_RELATIVE_LOSS_BOUND = 2e-2
BF16_ARGUMENTS = {"bf16": True, "fp16_opt_level": "O2"}


def real_size_arguments(corpus: dict, work_dir: Path, **overrides) -> dict:
    """llama-real (2 layers, matrices above 2**20 elements, embedding and head above 2**23) for 4 steps
    of 4 samples x 32 tokens (one sample per micro-batch: the layouts keep their accumulation steps).

    weight_decay is large (1.0) so that decay is a visible part of every update: a layout that
    decayed other parameters than one process would differ by far more than the tolerance (a
    stage-3 run without decay on its sliced matrices differs in loss by 3e-4 at step 2)."""
    return base_arguments(corpus, work_dir, **{"model_name_or_path": "llama-real", "num_hidden_layers": 2,
                                               "per_device_train_batch_size": 1,
                                               "max_steps": 4, "save_steps": SAVE_STEP, "save_total_limit": 1,
                                               "weight_decay": 1.0, **overrides})


def layout_output(work_dir: Path, layout: str, dtype: str) -> Path:
    return work_dir / "runs" / dtype / layout


def run_layout_checks(args_file: Path, work_dir: Path, layouts: list[str], dtypes: list[str],
                      timeout: int = 1200) -> list[dict]:
    """The single-process fp32 reference, then every layout in every dtype (each stopped after
    SAVE_STEP and resumed), compared with the reference (bf16: with the same layout in fp32,
    so fp32 of each layout runs too). Returns one row per layout and dtype."""
    max_steps = json.loads(args_file.read_text())["max_steps"]
    reference = work_dir / "runs" / "single"
    run_single([argv(args_file, reference)], work_dir, "single", timeout=timeout)
    runs_by_dtype = {"fp32": {}, **({"bf16": BF16_ARGUMENTS} if "bf16" in dtypes else {})}
    groups: dict[tuple, list[list[str]]] = {}
    for name in layouts:
        layout = LAYOUTS[name]
        for dtype, extra in runs_by_dtype.items():
            output = layout_output(work_dir, name, dtype)
            runs = groups.setdefault(layout.launch_key(), [])
            runs += [argv(args_file, output, **layout.overrides, **extra, exit_interval=SAVE_STEP),
                     argv(args_file, output, **layout.overrides, **extra)]
    failed = {}  # launch key -> the failure, with every rank's log tail
    for i, (key, runs) in enumerate(groups.items()):
        try:
            run_launch(key[0], runs, work_dir, f"launch{i}", timeout=timeout)
        except AssertionError as error:
            failed[key] = f"launch {work_dir / f'launch{i}.log'} failed"
            print(error, file=sys.stderr, flush=True)
    rows = []
    for name in layouts:
        for dtype in dtypes:
            row = {"layout": name, "processes": LAYOUTS[name].nproc, "dtype": dtype,
                   "output_dir": str(layout_output(work_dir, name, dtype))}
            try:
                if LAYOUTS[name].launch_key() in failed:
                    raise AssertionError(failed[LAYOUTS[name].launch_key()])
                rows.append({**row, **compare_layout_run(reference, work_dir, name, dtype, max_steps)})
            except AssertionError as error:  # the launch failed, or the run logged other steps
                rows.append({**row, "bound": "-", "passed": False, "error": str(error)})
    return rows


def compare_layout_run(reference: Path, work_dir: Path, name: str, dtype: str, step: int) -> dict:
    """The differences of one layout check from its reference, and whether they are within bounds."""
    output = layout_output(work_dir, name, dtype)
    if dtype == "fp32":
        diffs = training_differences(reference, output, step)
        return {**diffs, "bound": f"loss, grad norm, weights <= {TOLERANCE:g}",
                "passed": max(diffs["loss"], diffs["grad_norm"], diffs["weights"]) <= TOLERANCE}
    diffs = training_differences(layout_output(work_dir, name, "fp32"), output, step, weights=False)
    return {**diffs, "bound": f"loss within {BF16_RELATIVE_LOSS_BOUND:.0%} of fp32",
            "passed": diffs["relative_loss"] <= BF16_RELATIVE_LOSS_BOUND}


def summary_records(output_dir: Path) -> list[dict]:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "summary"]


def assert_every_replica_matches(reference: Path, other: Path, step: int = 5, tolerance: float = TOLERANCE) -> dict:
    """Every rank's copy of every weight and of its optimizer state equals the single-process one.

    In two parts, since a checkpoint stores each replicated tensor once (llm_pretrain/dist_checkpoint.py):
    - what was written: every slice of every tensor in the checkpoint's index (tensor-parallel
      slices, stage-3 flat slices, the one copy of each replica; weights and AdamW states) equals
      the same box of the single-process checkpoint, and every tensor of that one (every optimizer
      state) is in this one, and no other;
    - the copies not written: each run (the first part of a resumed run too) reports in its summary
      that its replica check (llm_pretrain/replica_check.py) found every replica of every box (data-
      parallel replicas, tensor-parallel norms, both pipeline ends' tied embedding, parameters whole
      on every sharding rank, and their optimizer states) bitwise identical to the copy written.
    Returns the largest differences and the number of replica groups of the last run.
    """
    from llm_pretrain.dist_checkpoint import CheckpointReader

    ref_dir, got_dir = Path(reference) / f"checkpoint-{step}", Path(other) / f"checkpoint-{step}"
    worst = {"weights": 0.0, "optimizer": 0.0}
    slices = 0
    with CheckpointReader(str(ref_dir)) as ref, CheckpointReader(str(got_dir)) as got:
        missing, extra = sorted(set(ref.tensors) - set(got.tensors)), sorted(set(got.tensors) - set(ref.tensors))
        assert not missing and not extra, f"{other}: tensors missing {missing[:5]}, not in one process {extra[:5]}"
        for name, entry in got.tensors.items():
            assert entry["shape"] == ref.tensors[name]["shape"], f"{other}: {name} has shape {entry['shape']}"
            for s in entry["slices"]:
                expected = ref.read(name, s["offsets"], s["shape"])
                value = got.read(name, s["offsets"], s["shape"])
                diff = float(np.abs(value.astype(np.float64) - expected).max()) if value.size else 0.0
                assert diff <= tolerance, \
                    f"{other}: {name} at {s['offsets']} ({s['file']}) differs from one process by {diff}"
                kind = "optimizer" if "/" in name else "weights"
                worst[kind] = max(worst[kind], diff)
                slices += 1
    summaries = summary_records(other)
    assert summaries, f"{other}: no summary record"
    for summary in summaries:
        check = summary.get("replica_check")
        assert check and check["identical"], f"{other}: the run reports no replica check: {summary}"
    layout = run_record(other)["layout"]
    if max(layout["data_parallel_degree"], layout["tensor_parallel_degree"], layout["sharding_degree"]) > 1:
        assert check["replica_groups"] > 0, f"{other}: a layout with replicas compared none: {check}"
    return {**worst, "slices": slices, "replica_groups": check["replica_groups"]}
