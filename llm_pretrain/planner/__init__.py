"""The parallel-configuration planner: predicted per-rank memory and step time of an argument file
on N processes of a device, from the same checks the run's preflight makes.

    memory.py   what each rank allocates, tensor by tensor (measured on CPU against Paddle's allocator)
    speed.py    step time on a GPU cluster (calibrated on the Megatron-LM paper's Table 1)
    search.py   every valid layout for a model and cluster, ranked by predicted tokens/card/s
    estimate.py `estimate(args, nproc, device)`: an argument file checked by the preflight as a run
                of nproc processes would be, then estimated; what `python scripts/plan.py estimate` prints

This package estimates a checked Setup and imports neither the preflight nor the trainer;
llm_pretrain/run/preflight.py records `estimate_setup` of every run in its run record, and
planner/estimate.py (not imported here) runs the same checks as the preflight
(llm_pretrain/parallel/layout.py check_layout_and_model) for an argument file.

May import: llm_pretrain.arguments, llm_pretrain.errors, models, parallel (layout), observe (FLOPs, peaks).
Never run, checkpoint, selfcheck or cli.
"""

from __future__ import annotations

import re

from llm_pretrain.arguments import Arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.planner.memory import MB, Precision, Setup, peak_memory

# Memory per card in GiB by the name's "-80G" suffix, else by the card (NVIDIA datasheets).
DEVICE_MEMORY_GIB = {"A100": 80, "A800": 80, "H100 SXM": 80, "H100 PCIE": 80, "H800": 80, "H800 PCIE": 80,
                     "H100 NVL": 94, "H200": 141, "H20": 96, "A30": 24, "A10": 24, "V100": 32, "V100S": 32,
                     "V100-PCIE": 32, "T4": 16}

# Reserved memory (what Paddle's GPU allocator holds from the device) at the peak = allocated + one block of
# the largest short-lived tensor (RankMemory.largest_transient_block). Why, from the allocator's source
# (paddle/phi/core/memory/allocation/auto_growth_best_fit_allocator.cc, the default allocator:
# FLAGS_allocator_strategy "auto_growth", paddle/common/flags.cc): a request takes the smallest free block
# that fits (best fit), else a new device chunk of exactly its size (FLAGS_auto_growth_chunk_size_in_mb
# defaults to 0, so chunk_size_ is the 256-byte alignment); a freed block merges with free neighbours; free
# chunks stay cached, but when the device refuses a new chunk every wholly free chunk is released and the
# request retried (AllocateImpl's BadAlloc branch, FreeIdleChunks). So memory the peak cannot use is the free
# part of partly used chunks: a block freed before a larger request, bounded by the largest short-lived
# tensor. Check, not calibration: PaddleNLP's published pretraining table (planner/data/
# paddlenlp_pretrain_memory.csv) reports max_memory_allocated and physical use about 2-3 GB above it, which
# also counts the CUDA context and library workspaces that no allocator statistic includes (search keeps
# DEFAULT_HEADROOM free for them).
RESERVED_NOTE = ("reserved = allocated + one block of the largest short-lived tensor (Paddle's auto-growth "
                 "best-fit allocator; the CUDA context is not included)")


def reserved_mb(worst) -> float:
    """Predicted max_memory_reserved (MiB) of the rank with the highest allocated peak (see RESERVED_NOTE)."""
    return (worst.peak_bytes + worst.largest_transient_block) / MB


def device_kind(device: str) -> str:
    return "cpu" if device.lower() == "cpu" else "gpu"


def device_memory_mb(device: str) -> float | None:
    """Memory of one card (MiB), None for a CPU (no fixed limit)."""
    if device_kind(device) == "cpu":
        return None
    from llm_pretrain.observe.flops import match_device

    size = re.search(r"(\d+)\s*G", device.upper())
    if size:
        return int(size.group(1)) * 1024.0
    key = match_device(device)
    if key is None:
        raise UsageError(f"--device: {device!r} is not a known GPU; use one of A100-80G, A100-40G, H100-80G, H800, "
                         "A800, V100, ... (llm_pretrain/observe/flops.py PEAK_TFLOPS) or cpu")
    return DEVICE_MEMORY_GIB.get(key, 80) * 1024.0


def check_device(device: str) -> None:
    if device_kind(device) == "gpu":
        from llm_pretrain.observe.flops import match_device

        if match_device(device) is None:
            raise UsageError(f"--device: {device!r} is not a known GPU; use one of A100-80G, A100-40G, H100-80G, "
                             "H800, A800, V100, ... (llm_pretrain/observe/flops.py PEAK_TFLOPS) or cpu")


def setup_from(args: Arguments, layout, config, kind: str) -> Setup:
    if kind == "gpu" and (args.bf16 or args.fp16):
        precision = Precision("bf16" if args.bf16 else "fp16", args.fp16_opt_level, bool(args.amp_master_grad))
    else:
        precision = Precision()
    return Setup(config, args.per_device_train_batch_size, args.gradient_accumulation_steps,
                 tp=layout.tensor_parallel_degree, pp=layout.pipeline_parallel_degree, vpp=layout.virtual_pp_degree,
                 dp=layout.data_parallel_degree, sharding_degree=layout.sharding_degree,
                 sharding_stage=layout.sharding_stage, precision=precision,
                 sep=layout.sep_parallel_degree, cp=layout.context_parallel_degree,
                 layers_per_stage=layout.pipeline_layers_per_stage, dualpipev=layout.dualpipev)


def estimate_setup(setup: Setup, device: str, cluster_options: dict | None = None) -> dict:
    """The estimate of a validated Setup (see `estimate`)."""
    from models.registry import parameter_count

    worst, ranks = peak_memory(setup)
    allocated = worst.peak_bytes / MB
    kind = device_kind(device)
    reserved = None
    if kind == "gpu":
        reserved = reserved_mb(worst)
    capacity = device_memory_mb(device)
    breakdown = [dict(row, kind="memory") for row in worst.breakdown()]
    result = {
        "params": parameter_count(setup.config),
        "device": device,
        "world_size": setup.world_size,
        "peak_mem_allocated_mb": allocated,
        "peak_mem_reserved_mb": reserved,
        # host memory (pinned on GPU) of async_save's copy of the state, on the rank holding the most
        "async_save_host_mb": max(r.checkpoint_state_bytes for r in ranks) / MB,
        "device_memory_mb": capacity,
        "fits": True if capacity is None else (reserved or allocated) <= capacity,
        "peak_rank": worst.rank,
        "peak_phase": worst.peak_phase,
        "ranks": {r.rank: r.peak_bytes / MB for r in ranks},
        "step_time_s": None, "tokens_per_card_per_sec": None, "mfu": None, "tflops_per_card": None,
        "hardware_tflops_per_card": None,
        "bottleneck": None,
        "breakdown": breakdown,
    }
    if kind == "gpu":
        from llm_pretrain.planner.speed import Cluster, step_time

        speed = step_time(setup, Cluster(device, **(cluster_options or {})))
        result.update({key: speed[key] for key in ("step_time_s", "tokens_per_card_per_sec", "mfu",
                                                   "tflops_per_card", "hardware_tflops_per_card", "bottleneck")})
        slowest = f"pipeline stage {speed['slowest_stage']}" if setup.pp > 1 else "every rank"
        result["breakdown"] += [{"term": term, "s": seconds, "rank": slowest, "kind": "time"}
                                for term, seconds in speed["terms"].items()]
    return result
