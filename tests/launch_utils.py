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

import os
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
if str(REPO_ROOT) not in sys.path:  # a worker started by path (tests/workers/*.py) imports the clone's package
    sys.path.insert(0, str(REPO_ROOT))

from llm_pretrain.selfcheck import parity  # noqa: E402
# The launcher and the device environment are the package's (llm_pretrain/selfcheck/parity.py), shared with
# scripts/gpu_selfcheck.py; re-exported here for the tests.
from llm_pretrain.selfcheck.parity import (  # noqa: E402,F401
    CPU_PROCESS_ENV, DEVICES, GPU_PROCESS_ENV, RESULT_DIR_ENV, LaunchResult, _descendants, _kill_session, free_port,
    launcher_process_args, process_env, write_result,
)

# The device of the parity tests, from the environment: `LLM_PRETRAIN_TEST_DEVICE=gpu python -m
# pytest tests` runs them on the visible GPUs (NCCL), one GPU per process. This is the one place
# that decides it for the tests; scripts/gpu_selfcheck.py takes --device instead.
TEST_DEVICE_ENV = "LLM_PRETRAIN_TEST_DEVICE"


def device_under_test() -> str:
    """'cpu' (the default) or 'gpu', from LLM_PRETRAIN_TEST_DEVICE."""
    device = os.environ.get(TEST_DEVICE_ENV) or "cpu"
    if device not in DEVICES:
        raise ValueError(f"{TEST_DEVICE_ENV}={device!r}: allowed values are {', '.join(DEVICES)}")
    return device


def use_test_device_in_this_process() -> None:
    """In-process tests on GPU get what launched processes get (parity.GPU_PROCESS_ENV): IEEE fp32
    matrix products and deterministic kernels. NVIDIA_TF32_OVERRIDE is read by cuBLAS/cuDNN when
    they initialize, so this must run before the first CUDA call (tests/conftest.py, at collection);
    the FLAGS_ are also set in Paddle for the case that it was imported earlier."""
    if device_under_test() != "gpu":
        return
    os.environ.update(GPU_PROCESS_ENV)
    if "paddle" in sys.modules:  # imported already: its flags were read from the environment before
        import paddle

        for key in (k for k in GPU_PROCESS_ENV if k.startswith("FLAGS_")):
            try:
                paddle.set_flags({key: True})
            except ValueError:  # a CPU build of Paddle has no cuDNN flags
                pass


def launch(script, nproc: int, args=(), *, log_dir=None, timeout: float = 300, env: dict | None = None,
           master_port: int | None = None, device: str = "cpu") -> LaunchResult:
    """parity.launch with tests/ on PYTHONPATH (workers import launch_utils) from the repository root."""
    return parity.launch(script, nproc, args, log_dir=log_dir, timeout=timeout, env=env, master_port=master_port,
                         device=device, python_path=[REPO_ROOT, TESTS_DIR], cwd=REPO_ROOT)
