"""The parallel layout of a run: degrees from the arguments, fleet initialization, wrapping.

The layout is read from the arguments and the launcher's world size and checked
by llm_pretrain/parallel/layout.py *before* fleet.init (a wrong combination is a one-line
UsageError), then handed
to fleet as a `DistributedStrategy`. On CPU the compatibility layer
(llm_pretrain/cpu/compat.py) is applied first; nothing else here depends on
the device.
"""

from __future__ import annotations

import os

import paddle
import paddle.distributed as dist

from llm_pretrain.arguments import Arguments
# Moved to llm_pretrain/parallel/layout.py (one module decides validity); imported here for build_strategy
# and for callers that still import them from this module.
from llm_pretrain.parallel.layout import (  # noqa: F401
    PARALLEL_CONFIG_OPTIONS, REFUSED_PARALLEL_CONFIG_OPTIONS, Layout, experts_over_sharding, parallel_config_settings,
    plan_layout,
)


def build_strategy(layout: Layout, args: Arguments):
    """The fleet.DistributedStrategy of the layout (degrees, pipeline micro-batching, options)."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    hybrid = {
        "dp_degree": layout.data_parallel_degree,
        "mp_degree": layout.tensor_parallel_degree,
        "pp_degree": layout.pipeline_parallel_degree,
        "sharding_degree": layout.sharding_degree,
        # fleet's sep group (topology.py): PaddleNLP's sep_parallel_degree, or our context parallelism
        "sep_degree": layout.sequence_group_degree,
    }
    pipeline = {
        "accumulate_steps": args.gradient_accumulation_steps,
        "micro_batch_size": args.per_device_train_batch_size,
    }
    ep = max(args.expert_parallel_degree, 1)
    if experts_over_sharding(layout, ep):
        # Fleet's own expert and moe_sharding groups (EPHybridCommunicateGroup, built by fleet.py:681-690
        # when "expert" has a degree above 1 in the order): the ranks of each group of ep consecutive
        # sharding ranks hold different experts, the moe_sharding ranks (sharding / ep) the same ones.
        # Its moe topology is pipe x moe_sharding x expert, its dense one pipe x moe_sharding x
        # dense_sharding x sep x data x model (topology.py:801-834): this order keeps every dense group
        # where the default order ['dp', 'pp', 'sharding', 'sep', 'cp', 'mp'] puts it.
        hybrid.update(ep_degree=ep, moe_sharding_degree=layout.sharding_degree // ep,
                      order=["dp", "pp", "moe_sharding", "sharding", "sep", "cp", "ep", "mp"])
    if layout.sequence_group_degree > 1:
        # The clip's norm of tensor-parallel slices is otherwise all-reduced over the "check" group
        # (hybrid_parallel_optimizer.py:87-91, topology.py:370: every rank of one data-parallel
        # index), which holds the sep ranks too: their equal (sep-reduced) slices would count sep
        # times. split_norm_comm reduces over the tensor- and pipeline-parallel groups instead
        # (:93-101). PaddleNLP 2.8.1 leaves it off (sep x tp clips with a norm sqrt(sep) too large).
        hybrid["split_norm_comm"] = True
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
        from llm_pretrain.cpu.compat import apply_cpu_compat

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
    layout.sep_parallel_rank = hcg.get_sep_parallel_rank()
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
    if layout.sharding_stage and any(getattr(p, "expert_parallel", False) for p in model.parameters()):
        # Expert parallelism over the sharding ranks: fleet's sharding wrappers over the replicated weights,
        # the experts' own optimizer path beside them (llm_pretrain/parallel/expert_optimizer.py).
        from llm_pretrain.parallel.expert_optimizer import wrap_experts_over_sharding

        return wrap_experts_over_sharding(model, optimizer, lambda m, o: _wrap_dense(m, o, layout, hcg))
    model, optimizer = _wrap_dense(model, optimizer, layout, hcg)
    use_expert_parallel_clip(optimizer, model)  # mixture of experts under expert parallelism (over dp ranks)
    return model, optimizer


def _wrap_dense(model, optimizer, layout: Layout, hcg):
    """fleet.distributed_model/_optimizer, or Paddle's group-sharded wrappers for stages 2 and 3."""
    from paddle.distributed import fleet

    if layout.sharding_stage in (2, 3):
        from paddle.distributed.sharding import group_sharded_parallel

        if layout.tensor_parallel_degree > 1:
            # As PaddleNLP: the tensor-parallel wrapper alone (it syncs replicated weights and
            # inputs over the tensor-parallel group); the optimizer stays plain for the sharding
            # wrapper, whose stage-2 clip is then fleet's hybrid one (norms over every group).
            model = fleet.meta_parallel.TensorParallel(model, hcg, strategy=None)
        elif layout.sequence_group_degree > 1:
            # The same for the sep group: fleet's SegmentParallel broadcasts the weights over the sep
            # group (segment_parallel.py:31-42), which the group-sharded wrappers do not.
            model = fleet.meta_parallel.SegmentParallel(model, hcg, strategy=None)
        level = "os_g" if layout.sharding_stage == 2 else "p_g_os"
        dp_group = hcg.get_data_parallel_group() if layout.data_parallel_degree > 1 else None
        model, optimizer, _ = group_sharded_parallel(model, optimizer, level=level,
                                                     group=hcg.get_sharding_parallel_group(), dp_group=dp_group)
        if layout.sequence_group_degree > 1:
            sum_sharded_gradients_over_sep_group(model, optimizer, hcg.get_sep_parallel_group())
        return model, optimizer
    return fleet.distributed_model(model), fleet.distributed_optimizer(optimizer)


def sum_sharded_gradients_over_sep_group(model, optimizer, sep_group) -> None:
    """Sharding stages 2 and 3 with sep or cp: sum this rank's reduced gradients over the sep group before
    the optimizer step. Each sep (or cp) rank's gradients cover only its own tokens; under stage 1 fleet's
    hybrid optimizer sums them over the sep group after the sharding reduce (hybrid_parallel_optimizer.py:
    627-638 -> hybrid_parallel_util.py:265-290, "sep all reduce is not scaled"). The group-sharded
    wrappers reduce over the sharding and data-parallel groups only, so the same sum goes here, on what
    they leave this rank to update:
    - stage 2: the gradient buffers and the gradients outside them (parameters above its 2**23-element
      buffer) this rank owns, exactly those its _dp_allreduce sums over the data-parallel group
      (group_sharded_stage2.py:662-692), before the step that scales and updates them (:694-711);
    - stage 3: each sliced parameter's slice of the gradient (bw_storage, reduced over the sharding group
      in the backward hook, group_sharded_stage3.py:762-800) and the buffers of the parameters it keeps
      whole, before _update_params hands them to the optimizer (:651-705; reached from the step and from
      GroupShardedScaler's unscale alike, group_sharded_utils.py:231-237, through _update_params_slice).
    A sum commutes with the wrappers' scaling and data-parallel sums, so the order among them is free.
    The sep ranks of one sharding rank own the same parameters (the assignment depends on the model only).
    """
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2

    if isinstance(model, GroupShardedStage2):
        step = optimizer.step  # GroupShardedStage2's _opt_step

        def step_after_sep_sum():
            if optimizer._reduce_overlap:  # the last reduce of the backward must have landed (:702-705)
                optimizer._comm_task.wait()
            for grad in stage2_owned_gradients(model):
                dist.all_reduce(grad, group=sep_group)
            step()

        step_after_sep_sum.sep_group = sep_group  # for the run record (describe_sharding)
        optimizer.step = step_after_sep_sum
        return
    update_params = model._update_params

    def update_params_after_sep_sum():
        for grad in stage3_gradients(model):
            dist.all_reduce(grad, group=sep_group)
        return update_params()

    update_params_after_sep_sum.sep_group = sep_group
    model._update_params = update_params_after_sep_sum


def stage2_owned_gradients(model) -> list:
    """The gradients a GroupShardedStage2 rank updates: the buffers it is the destination of, and its
    parameters kept out of the buffers (group_sharded_stage2.py:662-692, _dp_allreduce)."""
    grads = [storage.buffer for dtype in model._grad_storages
             for _, storage in sorted(model._grad_storages[dtype].items(), key=lambda item: item[0])
             if storage.destination == model._rank]
    for param in model._trainable_params:
        if param.name in model._param_grads and model._trainable_param2rank[param.name] == model._rank:
            grad = param.main_grad if model.use_main_grad else param.grad
            if grad is not None:
                grads.append(grad)
    return grads


def stage3_gradients(model) -> list:
    """A GroupShardedStage3 rank's gradients before _update_params: the slices of the sliced parameters
    (bw_storage) and the buffers of the parameters kept whole (group_sharded_stage3.py:651-686)."""
    sliced = [param.bw_storage for param in model._layer.parameters(include_sublayers=True)
              if param.trainable and param not in model._unslice_params and param.bw_storage is not None]
    return sliced + [storage.buffer for storage in model._grad_storages.values()]


class ExpertParallelGlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    """ClipGradByGlobalNorm (paddle/nn/clip.py _dygraph_clip: g x clip / max(norm, clip)) whose norm counts
    every part of every weight once: replicated weights' squares as they are (the same on every rank),
    tensor-parallel slices' summed over the tensor-parallel group (as fleet's HybridParallelClipGrad), and
    the experts' (each held by one rank of the expert group, models/moe.py) summed over the expert group
    too. Fleet's clips see only this rank's experts (the plain one in data-parallel mode,
    hybrid_parallel_optimizer.py:307,353; HybridParallelClipGrad reduces over mp/pp/sharding only), so
    each rank would clip differently. Under the pipeline every sum is then summed over the stages, a
    tied embedding's second copy left out, as HybridParallelClipGrad does (hybrid_parallel_optimizer.py:
    100-108,136-139). `last_norm`: the norm of the last step."""

    def __init__(self, clip_norm: float, expert_group, tensor_parallel_group=None, pipeline_group=None):
        super().__init__(clip_norm)
        self.expert_group, self.tensor_parallel_group = expert_group, tensor_parallel_group
        self.pipeline_group = pipeline_group
        self.last_norm = None

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        squares = {kind: paddle.zeros([], dtype="float32") for kind in ("replicated", "split", "expert")}
        for param, grad in params_grads:
            if grad is not None and getattr(param, "need_clip", True) and getattr(param, "is_firstly_shared", True):
                kind = ("expert" if getattr(param, "expert_parallel", False)
                        else "split" if getattr(param, "is_distributed", False) else "replicated")
                squares[kind] += paddle.sum(paddle.square(grad.astype("float32")))
        if self.tensor_parallel_group is not None:
            dist.all_reduce(squares["split"], group=self.tensor_parallel_group)
            dist.all_reduce(squares["expert"], group=self.tensor_parallel_group)
        if self.expert_group is not None:  # (None: a pipeline stage without experts)
            dist.all_reduce(squares["expert"], group=self.expert_group)
        total = squares["replicated"] + squares["split"] + squares["expert"]
        if self.pipeline_group is not None:
            dist.all_reduce(total, group=self.pipeline_group)
        self.last_norm = paddle.sqrt(total)
        scale = self.clip_norm / paddle.maximum(self.last_norm, paddle.full([], self.clip_norm, dtype="float32"))
        return [(p, g if g is None or not getattr(p, "need_clip", True) else g * scale.astype(g.dtype))
                for p, g in params_grads]


def sync_expert_gradients(params, sync) -> None:
    """fleet's gradient sync for the replicated weights; each expert's gradient summed over the ranks that
    hold the same expert (the expert-data-parallel group, when ep is below the data-parallel degree)."""
    params = list(params)
    sync([p for p in params if not getattr(p, "no_sync", False)])
    for param in params:
        group = getattr(param, "expert_dp_group", None)
        grad = getattr(param, "main_grad", None) if getattr(param, "main_grad", None) is not None else param.grad
        if group is not None and grad is not None:
            dist.all_reduce(grad, group=group)


def use_expert_parallel_clip(optimizer, model) -> None:
    """Under expert parallelism: the global-norm clip counts every expert (see above), and fleet's hybrid
    optimizer leaves the experts out of its data-parallel all-reduce, as its DataParallel does for
    parameters marked no_sync (paddle/distributed/parallel.py:484; the hybrid optimizer's
    _hybrid_sync_grad, hybrid_parallel_optimizer.py:626-638, would average different experts)."""
    expert_groups = [p.expert_group for p in model.parameters() if getattr(p, "expert_parallel", False)]
    config = getattr(getattr(model, "_layers", model), "config", None)  # (fleet's wrapper holds the model in _layers)
    if not expert_groups and not (config is not None and config.is_moe and config.expert_parallel_degree > 1):
        return
    # A pipeline stage without experts (ERNIE 4.5 MoE's and DeepSeek-V3's dense layer 0) takes the same clip as the
    # stages with them: fleet's computes the same norm but not bitwise the same scale, and a tied embedding's two
    # copies (first and last stage) would then drift apart (the replica check saw it, pp2dp2ep2-ernie)
    from paddle.distributed import fleet

    if not expert_groups and fleet.get_hybrid_communicate_group().get_sharding_parallel_world_size() > 1:
        # ... unless the experts are over the sharding ranks (pp2sd2ep2-deepseek, -ernie): there the experts' stages
        # clip with expert_optimizer.py's norm summed over the sharding group and then the stages, and so does this
        # one (the clip below sums over tp and the stages only: the norm would miss the other sharding rank's)
        from llm_pretrain.parallel.expert_optimizer import use_sharded_clip

        clip_norm = _global_clip_norm(optimizer)
        if clip_norm is not None:
            use_sharded_clip(optimizer, clip_norm)
        return
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad, HybridParallelOptimizer,
    )

    hcg = fleet.get_hybrid_communicate_group()
    tp_group = hcg.get_model_parallel_group() if hcg.get_model_parallel_world_size() > 1 else None
    pp_group = hcg.get_pipe_parallel_group() if hcg.get_pipe_parallel_world_size() > 1 else None
    inner = optimizer
    while inner is not None:  # the optimizer that owns the clip (fleet's wrapper forwards attribute reads to it)
        if isinstance(inner, HybridParallelOptimizer):
            sync = inner._hybrid_sync_grad
            inner._hybrid_sync_grad = lambda params, sync=sync: sync_expert_gradients(params, sync)
        clip = inner.__dict__.get("_grad_clip")
        if isinstance(clip, HybridParallelClipGrad):
            clip = clip._clip
        if type(clip) is paddle.nn.ClipGradByGlobalNorm:
            inner._grad_clip = ExpertParallelGlobalNormClip(clip.clip_norm, expert_groups[0] if expert_groups else None,
                                                            tp_group, pp_group)
        inner = inner.__dict__.get("_inner_opt")


def _global_clip_norm(optimizer) -> float | None:
    """The clip_norm of the global-norm clip somewhere in fleet's optimizer chain (None: no such clip)."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )

    inner = optimizer
    while inner is not None:
        clip = inner.__dict__.get("_grad_clip")
        clip = clip._clip if isinstance(clip, HybridParallelClipGrad) else clip
        if isinstance(clip, paddle.nn.ClipGradByGlobalNorm):
            return clip.clip_norm
        inner = inner.__dict__.get("_inner_opt")
    return None


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

    from llm_pretrain.parallel.expert_optimizer import ShardedGlobalNormClip

    clip, inner = None, optimizer
    while inner is not None and clip is None:
        candidate = getattr(inner, "_grad_clip", None)
        if isinstance(candidate, (ExpertParallelGlobalNormClip, ShardedGlobalNormClip)):
            return lambda: candidate.last_norm
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


