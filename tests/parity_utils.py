"""The parity harness for tests: llm_pretrain/selfcheck/parity.py on the device under test.

A parity test trains the same model on the same data from the same initial weights once in a
single process and once under a parallel layout with the same global batch, then compares the
per-step loss and global gradient norm (train_log.jsonl) and the final weights (merged from every
rank's checkpoint shard) within 1e-5. The harness is the package's (shared with
scripts/gpu_selfcheck.py); here it is bound to DEVICE (launch_utils.device_under_test:
LLM_PRETRAIN_TEST_DEVICE, cpu by default), which the tests read when they are collected.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from launch_utils import device_under_test
from llm_pretrain.selfcheck import parity
from llm_pretrain.selfcheck.parity import (  # noqa: F401
    LAYOUTS, RUN_PRETRAIN, SAVE_STEP, TOLERANCE, TRAIN_RUNS, LayoutCheck, argv, assert_every_replica_matches,
    assert_same_training, final_weights, run_record, summary_records, train_records,
    training_differences, write_json,
)

DEVICE = device_under_test()


def base_arguments(corpus: dict, work_dir: Path, **overrides) -> dict:
    """parity.base_arguments on the device under test (a short run of a tiny model)."""
    return parity.base_arguments(corpus, work_dir, **{"device": DEVICE, **overrides})


def real_size_arguments(corpus: dict, work_dir: Path, **overrides) -> dict:
    return parity.real_size_arguments(corpus, work_dir, **{"device": DEVICE, **overrides})


def run_single(runs: list[list[str]], work_dir: Path, name: str, timeout: int = 600) -> None:
    """Several trainings one after the other in one plain process, on the device under test."""
    parity.run_single(runs, work_dir, name, DEVICE, timeout=timeout)


def run_launch(nproc: int, runs: list[list[str]], work_dir: Path, name: str, timeout: int = 600, **kwargs):
    """Several trainings with the same parallel degrees in one launch, on the device under test."""
    return parity.run_launch(nproc, runs, work_dir, name, DEVICE, timeout=timeout, **kwargs)


def assert_same_router_metrics(reference: Path, other: Path, tolerance: float = TOLERANCE) -> None:
    """A mixture-of-experts run's router metrics in train_log.jsonl (aux loss, max/min expert load, pairs
    dropped) at every logging step equal the single-process run's."""
    for ref, got in zip(train_records(reference), train_records(other), strict=True):
        assert abs(got["moe_aux_loss"] - ref["moe_aux_loss"]) <= tolerance, (other, got, ref)
        assert got["tokens_dropped"] == ref["tokens_dropped"], (other, got, ref)
        ratio, expected = got["expert_load_max_min_ratio"], ref["expert_load_max_min_ratio"]
        assert (ratio is None) == (expected is None), (other, got, ref)
        assert expected is None or abs(ratio - expected) <= tolerance, (other, got, ref)



def assert_same_router_biases(reference: Path, other: Path, step: int = 2,
                              expected: tuple[str, ...] = ("layers.1.mlp", "mtp.block.mlp")) -> None:
    """DeepSeek-V3's router biases (the main MoE layer's and the MTP block's; `expected`: the blocks holding one,
    ERNIE 4.5 MoE's layers.1.mlp) moved by the bias rule, and after the
    last step equal one process's: each a whole number of steps of the rate, so a rank that counted only its own
    half of the batch would differ by at least 2 x rate in some expert (the weights' check sees the rest)."""
    ref, got = final_weights(reference, step), final_weights(other, step)
    names = sorted(name for name in ref if name.endswith("e_score_correction_bias"))
    assert names == [f"{block}.e_score_correction_bias" for block in expected], names
    for name in names:
        assert np.abs(ref[name]).max() > 0, f"{name}: the bias never moved"
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-7, err_msg=name)

# The GPU kernels' branches through their CPU stand-ins (llm_pretrain/cpu/kernel_standins.py): a run with
# the four kernel options on, trained with LLM_PRETRAIN_KERNEL_STANDINS=1 (tests/workers/mechanism_runs.py
# sets a run's "env"), against one process on the plain path. (On a GPU the variable does nothing: the
# real kernels run.)
KERNEL_OPTIONS = dict(use_flash_attention=True, use_fused_rope=True, use_fused_rms_norm=True,
                      use_fast_layer_norm=True)
STANDIN_ENV = {"LLM_PRETRAIN_KERNEL_STANDINS": "1"}


def run_spec(name: str, run_argv: list[str]) -> dict:
    """A shared launch's run (tests/shared_launches.py); runs with the kernel options get STANDIN_ENV."""
    return {"name": name, "argv": run_argv, **({"env": STANDIN_ENV} if "--use_flash_attention" in run_argv else {})}


def assert_stand_ins_ran(observed: list[dict], output_dir: Path, kernels: tuple[str, ...],
                         counts: list[dict] | None = None) -> None:
    """A stand-in run on every rank called each of `kernels` (the worker's "kernel_calls"), and its run record
    names them as stand-ins; observed: each rank's observations of this run, in rank order. `counts`: each
    rank's expected number of calls of some kernels (the layers it holds x micro-batches x steps: a branch taken
    in some layers only, or on some ranks only, shows)."""
    if DEVICE != "cpu":
        return
    for rank, seen in enumerate(observed):
        assert all(seen["kernel_calls"].get(kernel, 0) > 0 for kernel in kernels), (rank, seen["kernel_calls"])
    for rank, (seen, expected) in enumerate(zip(observed, counts or [], strict=counts is not None)):
        assert {kernel: seen["kernel_calls"].get(kernel, 0) for kernel in expected} == expected, \
            (rank, seen["kernel_calls"], expected)
    assert set(kernels) <= set(run_record(output_dir)["built"]["kernels"]["stand_ins"])
