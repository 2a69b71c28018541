"""Train under parallel layouts and compare with one process: the harness that the parity tests
(tests/parity_utils.py, tests/launch_utils.py) and the GPU self-check (scripts/gpu_selfcheck.py)
share. It lives in the package so that the self-check runs from an installed copy.

A parity check trains the same model on the same data from the same initial weights once in a
single process and once under a parallel layout with the same global batch, then compares the
per-step loss and global gradient norm (train_log.jsonl) and the final weights (merged from every
rank's checkpoint shard).

The device is always passed in ("cpu" or "gpu"); nothing here reads it from the environment at
import time (the tests take it from LLM_PRETRAIN_TEST_DEVICE, the self-check from --device).
Launches run `python -m paddle.distributed.launch` in their own process session (killed whole on
timeout), with per-rank JSON results written by `write_result`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # llm_pretrain/
SOURCE_ROOT = PACKAGE_DIR.parent  # the directory holding llm_pretrain/ and models/ (a clone, or site-packages)
TRAIN_RUNS = PACKAGE_DIR / "selfcheck" / "parity_worker.py"
RUN_PRETRAIN = PACKAGE_DIR / "run_pretrain.py"
RESULT_DIR_ENV = "LAUNCH_RESULT_DIR"
TOLERANCE = 1e-5
DEVICES = ("cpu", "gpu")

# CPU: one thread per process, so that a few ranks share two cores without thrashing.
CPU_PROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# GPU: fp32 parity within 1e-5 needs IEEE fp32 matrix products (Ampere and later use TF32 in
# cuBLAS/cuDNN unless NVIDIA_TF32_OVERRIDE=0) and deterministic kernels, set as PaddleNLP's own
# parity scripts do (model_zoo/gpt-3/projects/gpt/auto_gpt_345M_st.sh).
GPU_PROCESS_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "FLAGS_cudnn_deterministic": "1", "FLAGS_embedding_deterministic": "1"}


def process_env(device: str) -> dict[str, str]:
    """Environment entries for training processes on the device (launched or single)."""
    return dict(GPU_PROCESS_ENV if device == "gpu" else CPU_PROCESS_ENV)


def visible_gpu_labels(environ=None) -> list[str] | None:
    """The GPU labels CUDA_VISIBLE_DEVICES lists ("4,5,6,7" -> ["4", "5", "6", "7"]); None when unset or "all"."""
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "all":
        return None
    return [label.strip() for label in visible.split(",") if label.strip()]


def launcher_process_args(nproc: int, device: str, first_device: int = 0, environ=None) -> list[str]:
    """paddle.distributed.launch arguments for nproc processes on this node: one GPU each (NCCL),
    or CPU processes (gloo).

    `--devices` names GPUs by their labels in CUDA_VISIBLE_DEVICES, not by position: Paddle 3.3.1's
    launcher reads the labels from it (paddle/distributed/launch/context/device.py:117-125) and maps
    each requested device with `self._labels.index(d)` (device.py:82-90), so with
    CUDA_VISIBLE_DEVICES=4,5,6,7 the first two GPUs are `--devices 4,5` ("0,1" raises ValueError)."""
    if device == "gpu":
        labels = visible_gpu_labels(environ)
        chosen = range(first_device, first_device + nproc)
        return ["--devices", ",".join(labels[i] if labels is not None else str(i) for i in chosen)]
    return ["--nproc_per_node", str(nproc)]


def write_result(data: dict, rank: int | None = None) -> Path:
    """Worker side: write this rank's JSON result (where launch() will read it)."""
    if rank is None:
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    path = Path(os.environ[RESULT_DIR_ENV]) / f"result.{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def catch_crashes() -> None:
    """Print every thread's Python stack if this worker dies of a fatal signal (SIGSEGV, SIGABRT). Enabled after
    Paddle is imported, whose own handler faulthandler then calls after its dump."""
    import faulthandler

    faulthandler.enable(all_threads=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    returncode: int | None  # None: killed on timeout
    nproc: int
    log_dir: Path
    result_dir: Path
    elapsed: float
    timed_out: bool
    output: str = field(repr=False)  # the launcher's own stdout + stderr

    def log(self, rank: int) -> str:
        """workerlog.<rank> ('' if missing)."""
        path = self.log_dir / f"workerlog.{rank}"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the launcher output and of every workerlog."""
        parts = [f"--- launcher (rc={self.returncode}, timed_out={self.timed_out}, {self.elapsed:.1f}s) ---"]
        parts += self.output.splitlines()[-lines:]
        for rank in range(self.nproc):
            parts.append(f"--- workerlog.{rank} ---")
            parts += self.log(rank).splitlines()[-lines:]
        return "\n".join(parts)

    def result(self, rank: int) -> dict:
        path = self.result_dir / f"result.{rank}.json"
        if not path.exists():
            raise AssertionError(f"rank {rank} wrote no result\n{self.logs_tail()}")
        return json.loads(path.read_text())

    def results(self) -> dict[int, dict]:
        return {rank: self.result(rank) for rank in range(self.nproc)}

    def check(self) -> LaunchResult:
        """Assert a clean exit and a result from every rank; the message carries all log tails."""
        if self.timed_out or self.returncode != 0:
            raise AssertionError(f"launch failed\n{self.logs_tail()}")
        missing = [r for r in range(self.nproc) if not (self.result_dir / f"result.{r}.json").exists()]
        if missing:
            raise AssertionError(f"ranks {missing} wrote no result\n{self.logs_tail()}")
        return self


def launch(
    script: str | os.PathLike,
    nproc: int,
    args: list[str] | tuple[str, ...] = (),
    *,
    log_dir: str | os.PathLike | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    master_port: int | None = None,
    device: str = "cpu",
    python_path: list[str] | tuple[str, ...] = (),
    cwd: str | os.PathLike | None = None,
) -> LaunchResult:
    """Run `python -m paddle.distributed.launch --nproc_per_node nproc script args...` on CPU
    (device "gpu": `--devices` with the first nproc visible GPUs, one GPU per process).

    `log_dir` (created; a fresh temporary directory if None) receives
    workerlog.N and the per-rank result.N.json files. `env` entries are added to
    the environment, `python_path` entries go first on PYTHONPATH (before the directory holding
    llm_pretrain/); `timeout` (s) bounds the whole launch. Never raises on a
    failed run: inspect or `.check()` the result.
    """
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="launch_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("result.*.json"):
        old.unlink()
    run_env = dict(os.environ)
    run_env.update(process_env(device))
    run_env.update(
        {
            "PYTHONUNBUFFERED": "1",
            RESULT_DIR_ENV: str(log_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, python_path), str(SOURCE_ROOT),
                                                        os.environ.get("PYTHONPATH")])),
        }
    )
    run_env.update(env or {})
    cmd = [
        sys.executable, "-m", "paddle.distributed.launch",
        *launcher_process_args(nproc, device),
        *(["--master", f"127.0.0.1:{master_port}"] if master_port else []),
        "--log_dir", str(log_dir),
        str(script), *map(str, args),
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except BaseException as exc:  # timeout, or the test run interrupted: end the launch
        timed_out = isinstance(exc, subprocess.TimeoutExpired)
        _kill_session(proc.pid)  # while the launcher is alive (not yet reaped) its pid is ours
        output, _ = proc.communicate()
        if not timed_out:
            raise
    return LaunchResult(
        returncode=None if timed_out else proc.returncode,
        nproc=nproc,
        log_dir=log_dir,
        result_dir=log_dir,
        elapsed=time.monotonic() - start,
        timed_out=timed_out,
        output=output.decode(errors="replace"),
    )


def _kill_session(pid: int) -> None:
    """Kill the launcher (pid) and every process it started.

    The launcher leads its own process group (start_new_session), but it starts
    each worker in a new session of its own, so a group kill alone would leave
    the workers running: they are found through /proc while the launcher is
    still their parent, then killed by pid (with their own process groups).
    """
    for child in reversed(_descendants(pid)):
        for kill in (os.killpg, os.kill):
            try:
                kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
def base_arguments(corpus: dict, work_dir: Path, device: str = "cpu", **overrides) -> dict:
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
        "device": device,
    }
    args.update(overrides)
    return args


def write_json(path: Path, data) -> Path:
    """Written whole or not at all (a new file renamed over the old): the tests' two workers may write the same
    argument file while a launch of the other reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)
    return path


def argv(args_file: Path, output_dir: Path, **overrides) -> list[str]:
    """run_pretrain.py arguments: the file, the output_dir and `--key value` overrides."""
    out = [str(args_file), "--output_dir", str(output_dir)]
    for key, value in overrides.items():
        out += [f"--{key}", json.dumps(value) if isinstance(value, (bool, list)) else str(value)]
    return out


def run_single(runs: list[list[str]], work_dir: Path, name: str, device: str = "cpu", timeout: int = 600,
               env: dict | None = None) -> None:
    """Several trainings one after the other in one plain process (no launcher), on `device`."""
    runs_file = write_json(work_dir / f"{name}.runs.json", runs)
    result = subprocess.run([sys.executable, str(TRAIN_RUNS), str(runs_file)], capture_output=True, text=True,
                            timeout=timeout, env={**single_process_env(device), **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def single_process_env(device: str) -> dict:
    env = dict(os.environ)
    env.pop("PADDLE_TRAINERS_NUM", None)
    env.update(process_env(device))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_launch(nproc: int, runs: list[list[str]], work_dir: Path, name: str, device: str = "cpu",
               timeout: int = 600, **kwargs):
    """Several trainings with the same parallel degrees in one `paddle.distributed.launch`."""
    runs_file = write_json(work_dir / f"{name}.runs.json", runs)
    result = launch(str(TRAIN_RUNS), nproc, [str(runs_file)], log_dir=work_dir / f"{name}.log", timeout=timeout,
                    device=device, **kwargs)
    result.check()
    return result


def train_records(output_dir: Path) -> list[dict]:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "train"]


def run_record(output_dir: Path) -> dict:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "run"][-1]


def final_weights(output_dir: Path, step: int = 5) -> dict[str, np.ndarray]:
    from llm_pretrain.checkpoint.checkpointer import merge_checkpoint

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
    shared: dict = field(default_factory=dict)  # keys the one-process reference trains with too (the model)

    def launch_key(self) -> tuple:
        degrees = {k: v for k, v in self.overrides.items() if k in LAUNCH_DEGREE_KEYS}
        # sep and cp both give fleet its sep group (llm_pretrain/parallel/distributed.py build_strategy): one launch
        sequence = self.overrides.get("sep_parallel_degree", 1) * self.overrides.get("context_parallel_degree", 1)
        if sequence > 1:
            degrees.pop("context_parallel_degree", None)
            degrees["sep_parallel_degree"] = sequence
        return self.nproc, "sharding" in self.overrides, json.dumps(degrees, sort_keys=True)


LAUNCH_DEGREE_KEYS = ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_pp_degree",
                      "sharding_parallel_degree", "sep_parallel_degree", "context_parallel_degree",
                      "expert_parallel_degree")
_TP2, _PP2 = {"tensor_parallel_degree": 2}, {"pipeline_parallel_degree": 2}
_HALF, _QUARTER = {"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 1}
_MOE = {"model_name_or_path": "mixtral-real"}  # 4 experts of 1024 x 2816, top 2, 2 layers
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
    LayoutCheck("cp2", 2, {"context_parallel_degree": 2}),
    *[LayoutCheck(f"{name}2sd2_stage{stage}", 4, {key: 2, "sharding": f"stage{stage}", **_HALF})
      for stage in (2, 3) for name, key in (("sep", "sep_parallel_degree"), ("cp", "context_parallel_degree"))],
    # Production shapes the rows above do not reach (issue 33, finding 10):
    LayoutCheck("tp2cp2", 4, {**_TP2, "sequence_parallel": True, "context_parallel_degree": 2}),
    LayoutCheck("pp4vpp2", 4, {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2},
                # 8 layers for 2 chunks a stage; 8 micro-batches of 1 (2 x pp: fleet's interleaved 1F1B, not FthenB)
                {"num_hidden_layers": 8, "gradient_accumulation_steps": 8}),
    LayoutCheck("pp3_uneven", 3, {"pipeline_parallel_degree": 3, "pipeline_layers_per_stage": [1, 2, 1]},
                {"num_hidden_layers": 4}),
    LayoutCheck("dp2_async_save", 2, {**_HALF, "async_save": True}),  # the resume reads the async-written files
    LayoutCheck("ep2", 2, {"expert_parallel_degree": 2, **_HALF}, _MOE),  # experts over the data replicas
    # experts over sharding: the moe_sharding group has one rank (finding 1's case under amp_master_grad)
    LayoutCheck("ep2sd2_stage1", 2, {"expert_parallel_degree": 2, "sharding": "stage1", **_HALF}, _MOE),
]}
SAVE_STEP = 2


def real_size_arguments(corpus: dict, work_dir: Path, device: str = "cpu", **overrides) -> dict:
    """llama-real (2 layers, matrices above 2**20 elements, embedding and head above 2**23) for 4 steps
    of 4 samples x 32 tokens (one sample per micro-batch: the layouts keep their accumulation steps).

    weight_decay is large (1.0) so that decay is a visible part of every update: a layout that
    decayed other parameters than one process would differ by far more than the tolerance (a
    stage-3 run without decay on its sliced matrices differs in loss by 3e-4 at step 2)."""
    return base_arguments(corpus, work_dir, device, **{"model_name_or_path": "llama-real", "num_hidden_layers": 2,
                                                       "per_device_train_batch_size": 1,
                                                       "max_steps": 4, "save_steps": SAVE_STEP, "save_total_limit": 1,
                                                       "weight_decay": 1.0, **overrides})


def garbage_corpus(corpus: dict, work: Path, args_file: Path, steps: list[int], first_samples: int | None = None) -> str:
    """A copy of the corpus whose samples of the given global steps (1-based) are one unused token
    (only the first `first_samples` of each step's global batch when given): the loss of such a step jumps
    well above the running mean, a loss spike (tests/test_resilience.py, the self-check's rollback row)."""
    from llm_pretrain.data import build_pretraining_datasets

    args = json.loads(args_file.read_text())
    directory = work / "garbage"
    directory.mkdir(exist_ok=True)
    for path in Path(corpus["input_dir"]).iterdir():
        if path.suffix in (".bin", ".idx"):
            shutil.copy(path, directory / path.name)
    batch = args["per_device_train_batch_size"] * args["gradient_accumulation_steps"]
    train, _, _ = build_pretraining_datasets(
        input_dir=str(directory), split=args["split"], seq_length=args["max_seq_length"], seed=args["seed"],
        num_samples=(args["max_steps"] * batch, 0, 0), data_cache=str(work / "garbage-index"), skip_warmup=True)
    data = train.data
    vocab_size = corpus.get("vocab_size") or int(np.max(data.tokens)) + 2  # without it: an id above every token
    counts = np.bincount(np.asarray(data.tokens), minlength=vocab_size)
    unused = int(np.argmin(counts[:vocab_size]))
    tokens = np.memmap(next(directory.glob("*.bin")), dtype=data.dtype, mode="r+")
    for step in steps:
        start = (step - 1) * batch
        for i in range(start, start + (first_samples or batch)):  # the spans GPTDataset.__getitem__ reads
            k = int(train.shuffle_idx[i])
            (first, start), (last, end) = train.sample_idx[k], train.sample_idx[k + 1]
            starts, ends = data.document_spans(train.doc_idx[first:last + 1])
            ends[-1] = starts[-1] + end + 1
            starts[0] += start
            for a, b in zip(starts.tolist(), ends.tolist()):
                tokens[a:b] = unused
    tokens.flush()
    return str(directory)


def summary_records(output_dir: Path) -> list[dict]:
    with open(Path(output_dir) / "train_log.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["event"] == "summary"]


def assert_every_replica_matches(reference: Path, other: Path, step: int = 5, tolerance: float = TOLERANCE) -> dict:
    """Every rank's copy of every weight and of its optimizer state equals the single-process one.

    In two parts, since a checkpoint stores each replicated tensor once (llm_pretrain/checkpoint/dist_checkpoint.py):
    - what was written: every slice of every tensor in the checkpoint's index (tensor-parallel
      slices, stage-3 flat slices, the one copy of each replica; weights and AdamW states) equals
      the same box of the single-process checkpoint, and every tensor of that one (every optimizer
      state) is in this one, and no other;
    - the copies not written: each run (the first part of a resumed run too) reports in its summary
      that its replica check (llm_pretrain/checkpoint/replica_check.py) found every replica of every box (data-
      parallel replicas, tensor-parallel norms, both pipeline ends' tied embedding, parameters whole
      on every sharding rank, and their optimizer states) bitwise identical to the copy written.
    Returns the largest differences and the number of replica groups of the last run.
    """
    from llm_pretrain.checkpoint.dist_checkpoint import CheckpointReader

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
