"""The order in which each of fleet's pipeline schedules runs one training step on a stage, as the
mechanism probe records it (tests/workers/mechanism_runs.py: "F<chunk>" / "B<chunk>"), derived from
the schedules' definitions in Paddle 3.3.1's paddle/distributed/fleet/meta_parallel/pipeline_parallel.py.
Each is: warmup forwards, then pairs of one forward and one backward, then the remaining backwards.
"""

from __future__ import annotations


def _order(forwards: list[str], backwards: list[str], warmup: int) -> list[str]:
    steady = len(forwards) - warmup
    pairs = [step for i in range(steady) for step in (forwards[warmup + i], backwards[i])]
    return forwards[:warmup] + pairs + backwards[steady:]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[str]:
    """PipelineParallel: stages - stage - 1 warmup forwards (pipeline_parallel.py:1101-1103)."""
    warmup = min(stages - stage - 1, micro_batches)
    return _order(["F0"] * micro_batches, ["B0"] * micro_batches, warmup)


def interleaved(stage: int, stages: int, chunks: int, micro_batches: int) -> list[str]:
    """PipelineParallelWithInterleave with micro_batches a multiple of stages (Megatron's order): groups of
    `stages` micro-batches go through chunk 0, 1, ... in turn, backwards in reverse chunk order; warmup
    2 (stages - stage - 1) + (chunks - 1) x stages steps (pipeline_parallel.py:2617-2619, 2025-2070)."""
    assert micro_batches % stages == 0
    steps = micro_batches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, steps)
    forwards = [f"F{(k // stages) % chunks}" for k in range(steps)]
    backwards = [f"B{chunks - 1 - (k // stages) % chunks}" for k in range(steps)]
    return _order(forwards, backwards, warmup)


def fthenb_balanced(stage: int, stages: int, chunks: int, micro_batches: int) -> list[str]:
    """VPPFhenBInBalancedMemory: every micro-batch through chunk 0, then all through chunk 1, ...
    (PipelineParallelWithInterleaveFthenB._get_virtual_pp_rank, pipeline_parallel.py:3405-3413);
    warmup micro_batches x (chunks - 1) + stages - stage - 1 forwards (pipeline_parallel.py:3740-3745)."""
    steps = micro_batches * chunks
    warmup = micro_batches * (chunks - 1) + stages - stage - 1
    forwards = [f"F{k // micro_batches}" for k in range(steps)]
    backwards = [f"B{chunks - 1 - k // micro_batches}" for k in range(steps)]
    return _order(forwards, backwards, warmup)


def first_step(order: list[str], micro_batches: int, chunks: int = 1) -> list[str]:
    """The recorded order of the first training step (2 x micro-batches x chunks calls)."""
    return order[: 2 * micro_batches * chunks]
