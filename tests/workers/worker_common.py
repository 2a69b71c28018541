"""Shared by the worker scripts that tests/test_cpu_compat.py launches (one process per rank)."""

from __future__ import annotations

import sys
import time
import traceback

START = time.monotonic()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

from launch_utils import write_result  # noqa: E402  (tests/launch_utils.launch puts the repo and tests/ on PYTHONPATH)
from llm_pretrain.cpu.compat import apply_cpu_compat  # noqa: E402


def init_fleet(**hybrid_configs):
    """apply_cpu_compat() then fleet.init with these hybrid degrees; returns (hcg, seconds)."""
    paddle.set_device("cpu")
    apply_cpu_compat()
    strategy = fleet.DistributedStrategy()
    pipeline_configs = hybrid_configs.pop("pipeline_configs", None)
    sharding_configs = hybrid_configs.pop("sharding_configs", {})
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, **hybrid_configs}
    for key, value in sharding_configs.items():
        setattr(strategy.hybrid_configs["sharding_configs"], key, value)
    if pipeline_configs:
        strategy.pipeline_configs = pipeline_configs
    start = time.monotonic()
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group(), strategy, time.monotonic() - start


def randn(shape, seed, scale=1.0):
    return paddle.to_tensor((np.random.RandomState(seed).randn(*shape) * scale).astype("float32"))


def leaf(tensor):
    out = tensor.detach().clone()
    out.stop_gradient = False
    return out


def max_err(actual, expected) -> float:
    actual = actual.numpy() if isinstance(actual, paddle.Tensor) else np.asarray(actual)
    expected = expected.numpy() if isinstance(expected, paddle.Tensor) else np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != expected {expected.shape}")
    return float(np.abs(actual.astype("float64") - expected.astype("float64")).max()) if actual.size else 0.0


class Checks:
    """Named checks; each returns {metric: max abs error}; exceptions are recorded, not raised."""

    def __init__(self):
        self.errors: dict[str, dict[str, float]] = {}
        self.failures: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def run(self, name, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            self.errors[name] = {k: float(v) for k, v in fn(*args, **kwargs).items()}
        except Exception:  # noqa: BLE001 - reported to the test through the JSON result
            self.failures[name] = traceback.format_exc()
            print(self.failures[name], file=sys.stderr, flush=True)
        self.seconds[name] = round(time.monotonic() - start, 3)

    def write(self, **extra):
        write_result(
            {
                "errors": self.errors,
                "failures": self.failures,
                "seconds": self.seconds,
                "rank": dist.get_rank(),
                "total_seconds": round(time.monotonic() - START, 3),
                **extra,
            }
        )
        # every compat worker writes last: leave without the interpreter's teardown, which crashes launched workers
        # now and then after their results (llm_pretrain/run/run_control.py exit_after_results)
        from llm_pretrain.run.run_control import exit_after_results

        exit_after_results(0)
