"""Run `python -m paddle.distributed.launch` from tests, with logs and per-rank JSON results.

In a test::

    from tests.launch_utils import launch

    result = launch(WORKER, nproc=2, args=["--steps", "5"], log_dir=tmp_path / "logs", timeout=180)
    result.check()                      # AssertionError with every workerlog's tail on failure
    ranks = result.results()            # {rank: dict} written by the workers

In a worker (tests/workers/*.py)::

    from launch_utils import write_result   # tests/ is put on PYTHONPATH by launch()
    write_result({"loss": 1.0})              # -> $LAUNCH_RESULT_DIR/result.<rank>.json

Ports: by default the launcher picks its own free ports (its rendezvous server
and the workers' TCPStore: random start in 35100-64000, each checked by
binding), so concurrent launches do not collide; `master_port=` pins the
rendezvous server instead (`--master 127.0.0.1:PORT`; the launcher then sleeps
up to 2 s before starting it). Each launch runs in its own process session (on
timeout the whole session is killed), with one thread per process
(OMP_NUM_THREADS=1) so that a few ranks share two cores without thrashing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
RESULT_DIR_ENV = "LAUNCH_RESULT_DIR"

# The device of the parity tests, from the environment: `LLM_PRETRAIN_TEST_DEVICE=gpu python -m
# pytest tests` runs them on the visible GPUs (NCCL), one GPU per process. This is the one place
# that decides it; parity_utils and scripts/gpu_selfcheck.py ask here.
TEST_DEVICE_ENV = "LLM_PRETRAIN_TEST_DEVICE"
DEVICES = ("cpu", "gpu")
# CPU: one thread per process, so that a few ranks share two cores without thrashing.
CPU_PROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# GPU: fp32 parity within 1e-5 needs IEEE fp32 matrix products (Ampere and later use TF32 in
# cuBLAS/cuDNN unless NVIDIA_TF32_OVERRIDE=0) and deterministic kernels, set as PaddleNLP's own
# parity scripts do (model_zoo/gpt-3/projects/gpt/auto_gpt_345M_st.sh).
GPU_PROCESS_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "FLAGS_cudnn_deterministic": "1", "FLAGS_embedding_deterministic": "1"}


def device_under_test() -> str:
    """'cpu' (the default) or 'gpu', from LLM_PRETRAIN_TEST_DEVICE."""
    device = os.environ.get(TEST_DEVICE_ENV) or "cpu"
    if device not in DEVICES:
        raise ValueError(f"{TEST_DEVICE_ENV}={device!r}: allowed values are {', '.join(DEVICES)}")
    return device


def process_env(device: str) -> dict[str, str]:
    """Environment entries for training processes on the device (launched or single)."""
    return dict(GPU_PROCESS_ENV if device == "gpu" else CPU_PROCESS_ENV)


def launcher_process_args(nproc: int, device: str, first_device: int = 0) -> list[str]:
    """paddle.distributed.launch arguments for nproc processes on this node: one GPU each (NCCL),
    or CPU processes (gloo)."""
    if device == "gpu":
        return ["--devices", ",".join(str(first_device + i) for i in range(nproc))]
    return ["--nproc_per_node", str(nproc)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_result(data: dict, rank: int | None = None) -> Path:
    """Worker side: write this rank's JSON result (where launch() will read it)."""
    if rank is None:
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    path = Path(os.environ[RESULT_DIR_ENV]) / f"result.{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


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
) -> LaunchResult:
    """Run `python -m paddle.distributed.launch --nproc_per_node nproc script args...` on CPU
    (device "gpu": `--devices 0,...,nproc-1`, one GPU per process).

    `log_dir` (created; a fresh temporary directory if None) receives
    workerlog.N and the per-rank result.N.json files. `env` entries are added to
    the environment; `timeout` (s) bounds the whole launch. Never raises on a
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
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
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
        cmd, cwd=REPO_ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
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
