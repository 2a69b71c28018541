"""The parallel layout of a run: degrees from the arguments, fleet initialization, wrapping.

The layout is read from the arguments and the launcher's world size, checked
*before* fleet.init (a wrong combination is a one-line UsageError), then handed
to fleet as a `DistributedStrategy`. On CPU the compatibility layer
(llm_pretrain/cpu_compat.py) is applied first; nothing else here depends on
the device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import paddle
import paddle.distributed as dist

from llm_pretrain.arguments import Arguments
from llm_pretrain.errors import UsageError


@dataclass
class Layout:
    """Degrees of the run and this process's coordinate in each (ranks are 0-based)."""

    world_size: int = 1
    rank: int = 0
    data_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    sharding_degree: int = 1
    sharding_stage: int = 0  # 0: no sharding
    virtual_pp_degree: int = 1
    data_parallel_rank: int = 0
    tensor_parallel_rank: int = 0
    pipeline_parallel_rank: int = 0
    sharding_rank: int = 0
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def data_replicas(self) -> int:
        """How many different slices of each global batch are read (dp x sharding)."""
        return self.data_parallel_degree * self.sharding_degree

    @property
    def data_replica_rank(self) -> int:
        return self.data_parallel_rank * self.sharding_degree + self.sharding_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_world_size() -> int:
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def _degree(value: int) -> int:
    return 1 if value == -1 else value


def plan_layout(args: Arguments, world_size: int) -> Layout:
    """Degrees from the arguments and the world size, validated; no communication."""
    tp = _degree(args.tensor_parallel_degree)
    pp = _degree(args.pipeline_parallel_degree)
    stage = int(args.sharding[-1]) if args.sharding else 0
    sharding_degree = _degree(args.sharding_parallel_degree if args.sharding_parallel_degree != -1 else args.sharding_degree)
    if stage and args.sharding_parallel_degree == -1 and args.sharding_degree == -1:
        sharding_degree = max(1, world_size // (tp * pp))  # PaddleNLP derives it from the world size
    if not stage:
        sharding_degree = 1
    model_degrees = tp * pp * sharding_degree
    if world_size % model_degrees != 0:
        raise UsageError(
            f"world size {world_size} is not a multiple of tensor_parallel_degree {tp} x pipeline_parallel_degree {pp}"
            f" x sharding_parallel_degree {sharding_degree} = {model_degrees}"
        )
    return Layout(
        world_size=world_size,
        data_parallel_degree=world_size // model_degrees,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        sharding_degree=sharding_degree,
        sharding_stage=stage,
        virtual_pp_degree=args.virtual_pp_degree,
    )


def select_device(args: Arguments) -> str:
    """'cpu' or 'gpu' for this run (set as Paddle's device)."""
    device = args.device or ("gpu" if paddle.is_compiled_with_cuda() else "cpu")
    if device == "gpu" and not paddle.is_compiled_with_cuda():
        raise UsageError("device: 'gpu' was requested but this Paddle build has no CUDA; use device 'cpu'")
    if device == "gpu":
        local_gpu = os.environ.get("FLAGS_selected_gpus", "0").split(",")[0]
        paddle.set_device(f"gpu:{local_gpu}")
    else:
        paddle.set_device("cpu")
    return device


# PaddleNLP's option strings (e.g. pipeline_parallel_config "enable_delay_scale_loss
# disable_p2p_cache_shape") -> the fleet strategy field each one sets.
PARALLEL_CONFIG_OPTIONS: dict[str, dict[str, tuple[str, str, bool]]] = {
    "tensor_parallel_config": {
        "enable_mp_async_allreduce": ("mp_configs", "mp_async_allreduce", True),
        "enable_mp_skip_c_identity": ("mp_configs", "mp_skip_c_identity", True),
        "enable_mp_fused_linear_param_grad_add": ("mp_configs", "mp_fused_linear_param_grad_add", True),
        "enable_sp_async_reduce_scatter": ("mp_configs", "sp_async_reduce_scatter", True),
        "sync_param": ("mp_configs", "sync_param", True),
        "sync_grad": ("mp_configs", "sync_grad", True),
        "sync_moment": ("mp_configs", "sync_moment", True),
    },
    "pipeline_parallel_config": {
        "enable_delay_scale_loss": ("pp_configs", "delay_scale_loss", True),
        "enable_dp_comm_overlap": ("pp_configs", "dp_comm_overlap", True),
        "enable_sharding_comm_overlap": ("pp_configs", "sharding_comm_overlap", True),
        "enable_timer": ("pp_configs", "enable_timer", True),
        "enable_release_grads": ("pp_configs", "release_gradients", True),
        "enable_overlap_p2p_comm": ("pp_configs", "overlap_p2p_comm", True),
        "enable_clear_every_step_cache": ("pp_configs", "clear_every_step_cache", True),
        "disable_batch_p2p_comm": ("pp_configs", "use_batch_p2p_comm", False),
        "disable_p2p_cache_shape": ("pipeline_configs", "p2p_cache_shape", False),
        "disable_partial_send_recv": ("pipeline_configs", "enable_partial_send_recv", False),
    },
    "sharding_parallel_config": {
        "enable_stage1_tensor_fusion": ("sharding_configs", "tensor_fusion", True),
        "enable_stage1_overlap": ("sharding_configs", "comm_overlap", True),
        "enable_release_grads": ("sharding_configs", "release_gradients", True),
        "enable_fuse_optimizer_states": ("sharding_configs", "enable_fuse_optimizer_states", True),
    },
}


# Options PaddleNLP knows that give wrong results with Paddle 3.3.1: refused, with the reason.
REFUSED_PARALLEL_CONFIG_OPTIONS = {
    ("sharding_parallel_config", "split_param"): (
        "Paddle 3.3.1's split-parameter stage 1 (DygraphShardingOptimizerV2) drifts from a single process "
        "from the second step on: clear_grad(set_to_zero=True) detaches param.grad from the fused buffer, "
        "so later steps lose gradients; use plain stage1"),
}


def parallel_config_settings(args: Arguments) -> list[tuple[str, str, bool]]:
    """The strategy fields set by the option strings; an unknown or refused option is a UsageError."""
    settings = []
    for key, options in PARALLEL_CONFIG_OPTIONS.items():
        for option in getattr(args, key).replace(",", " ").split():
            if (key, option) in REFUSED_PARALLEL_CONFIG_OPTIONS:
                raise UsageError(f"{key}: {option!r} is refused: {REFUSED_PARALLEL_CONFIG_OPTIONS[key, option]}")
            if option not in options:
                raise UsageError(f"{key}: unknown option {option!r}; allowed: {', '.join(sorted(options))}")
            settings.append(options[option])
    return settings


def build_strategy(layout: Layout, args: Arguments):
    """The fleet.DistributedStrategy of the layout (degrees, pipeline micro-batching, options)."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    hybrid = {
        "dp_degree": layout.data_parallel_degree,
        "mp_degree": layout.tensor_parallel_degree,
        "pp_degree": layout.pipeline_parallel_degree,
        "sharding_degree": layout.sharding_degree,
    }
    pipeline = {
        "accumulate_steps": args.gradient_accumulation_steps,
        "micro_batch_size": args.per_device_train_batch_size,
    }
    for section, field, value in parallel_config_settings(args):
        if section == "pipeline_configs":
            pipeline[field] = value
        else:
            hybrid.setdefault(section, {})[field] = value
    if args.sequence_parallel and layout.tensor_parallel_degree > 1:
        # Partial send/recv ships 1/tp of an activation per tensor-parallel rank and all-gathers it
        # after the hop, which assumes the ranks hold the same activation. Under sequence
        # parallelism each holds its own chunk of the tokens, so it would silently mix them
        # (p2p_communication.py:264-269 only checks divisibility): always send whole tensors.
        pipeline["enable_partial_send_recv"] = False
    strategy.hybrid_configs = hybrid
    if layout.pipeline_parallel_degree > 1:
        strategy.pipeline_configs = pipeline
    return strategy


_fleet_hybrid_configs = None  # the hybrid_configs fleet.init was called with in this process


def init_distributed(layout: Layout, device: str, args: Arguments) -> Layout:
    """fleet.init with the planned layout (a no-op for a single process); fills in the ranks."""
    if not layout.distributed:
        return layout
    if device == "cpu":
        from llm_pretrain.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    from paddle.distributed import fleet

    strategy = build_strategy(layout, args)
    global _fleet_hybrid_configs
    if _fleet_hybrid_configs is None:
        fleet.init(is_collective=True, strategy=strategy)
        _fleet_hybrid_configs = str(strategy.hybrid_configs)
    elif _fleet_hybrid_configs != str(strategy.hybrid_configs):
        # Several runs in one process (tests do this) must share one layout: fleet's groups are per process.
        raise RuntimeError("fleet is already initialized with another layout in this process")
    else:
        fleet.fleet._user_defined_strategy = strategy  # e.g. new pipeline micro-batching for this run
    hcg = fleet.get_hybrid_communicate_group()
    layout.rank = dist.get_rank()
    layout.local_rank = int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")))
    layout.data_parallel_rank = hcg.get_data_parallel_rank()
    layout.tensor_parallel_rank = hcg.get_model_parallel_rank()
    layout.pipeline_parallel_rank = hcg.get_stage_id()
    layout.sharding_rank = hcg.get_sharding_parallel_rank()
    return layout


def wrap_for_training(model, optimizer, layout: Layout, accumulation_steps: int):
    """fleet's wrappers: gradient synchronization and the hybrid-parallel optimizer.

    Sharding stage 1 is part of fleet's hybrid optimizer (hybrid_configs sharding_degree);
    stages 2 and 3 are Paddle's group-sharded model and optimizer on the sharding group.
    """
    if not layout.distributed:
        return model, optimizer
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.sequence_parallel_utils import (
        is_sequence_parallel_parameter, register_sequence_parallel_allreduce_hooks,
    )

    hcg = fleet.get_hybrid_communicate_group()
    # Replicated weights whose gradients are partial on each tensor-parallel rank (the norms under
    # sequence parallelism, the replicated k/v projections when there are fewer kv heads than
    # ranks): each one's hook all-reduces its accumulated gradient over the tensor-parallel group
    # at every accumulation_steps-th backward, i.e. after the last micro-batch of a step (fleet's
    # pipeline also runs one backward per micro-batch, accumulation_steps per step).
    if any(is_sequence_parallel_parameter(p) for p in model.parameters()):
        register_sequence_parallel_allreduce_hooks(model, accumulation_steps, fuse_sequence_parallel_allreduce=False)
    if layout.sharding_stage in (2, 3):
        from paddle.distributed.sharding import group_sharded_parallel

        if layout.tensor_parallel_degree > 1:
            # As PaddleNLP: the tensor-parallel wrapper alone (it syncs replicated weights and
            # inputs over the tensor-parallel group); the optimizer stays plain for the sharding
            # wrapper, whose stage-2 clip is then fleet's hybrid one (norms over every group).
            model = fleet.meta_parallel.TensorParallel(model, hcg, strategy=None)
        level = "os_g" if layout.sharding_stage == 2 else "p_g_os"
        dp_group = hcg.get_data_parallel_group() if layout.data_parallel_degree > 1 else None
        model, optimizer, _ = group_sharded_parallel(model, optimizer, level=level,
                                                     group=hcg.get_sharding_parallel_group(), dp_group=dp_group)
        return model, optimizer
    return fleet.distributed_model(model), fleet.distributed_optimizer(optimizer)


def all_reduce_mean_over_replicas(value: float, layout: Layout) -> float:
    """Mean of a per-rank value (such as the loss of this rank's part of the batch) over the
    data-parallel and sharding groups, which read different samples."""
    if not layout.distributed:
        return value
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    tensor = paddle.to_tensor([value], dtype="float32")
    for degree, group in ((layout.data_parallel_degree, hcg.get_data_parallel_group()),
                          (layout.sharding_degree, hcg.get_sharding_parallel_group())):
        if degree > 1:
            dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / layout.data_replicas


def record_grad_norm(optimizer):
    """A function returning the global gradient norm (before clipping) of the last optimizer step,
    as a 0-d device tensor: nothing here waits for the device; the loop reads it once per logging step.

    The distributed clips compute it across every group (tensor, pipeline, sharding, data): for
    fleet's hybrid-parallel clip we wrap that one instance's reduction to keep the value; the
    group-sharded clip (stages 2/3) keeps no such value, so we add the same sum over the
    sharding group (one scalar all-reduce per step). Returns None when there is no clip.
    """
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedClipGrad

    clip, inner = None, optimizer
    while inner is not None and clip is None:
        candidate = getattr(inner, "_grad_clip", None)
        clip = candidate if isinstance(candidate, (HybridParallelClipGrad, GroupShardedClipGrad)) else None
        inner = getattr(inner, "_inner_opt", None) or getattr(inner, "_optim", None)
    if clip is None:
        return None
    last = {}

    if isinstance(clip, HybridParallelClipGrad):
        reduce_norm = clip._global_norm

        def recording_global_norm(sum_square_distributed, sum_square_replicated):
            reduce_norm(sum_square_distributed, sum_square_replicated)
            # Each is a 0-d or [1]-shaped tensor, reduced in place over the groups by the call above.
            last["norm"] = paddle.sqrt(sum_square_distributed.astype("float32").sum()
                                       + sum_square_replicated.astype("float32").sum())

        clip._global_norm = recording_global_norm
    else:
        clip_grads = clip._dygraph_clip

        def recording_clip(params_grads):
            # As GroupShardedClipGrad: stage-3 slices (and stage-2 owned parameters) are summed over
            # the sharding group; parameters left whole ("unslice") are the same on every rank.
            sliced = paddle.zeros([], dtype="float32")
            whole = paddle.zeros([], dtype="float32")
            for param, grad in params_grads:
                if grad is None or getattr(param, "need_clip", True) is False:
                    continue
                square = paddle.sum(paddle.square(grad.astype("float32")))
                if hasattr(param, "unslice"):
                    whole += square
                else:
                    sliced += square
            dist.all_reduce(sliced, group=clip._group)
            last["norm"] = paddle.sqrt(sliced + whole)
            return clip_grads(params_grads)

        clip._dygraph_clip = recording_clip
    return lambda: last.get("norm")


def all_reduce_max(value: float, layout: Layout) -> float:
    if not layout.distributed:
        return value
    tensor = paddle.to_tensor([value], dtype="float32")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()


