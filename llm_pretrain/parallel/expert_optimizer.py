"""Expert parallelism over sharding ranks (sharding stage 1 or 2, data_parallel_degree 1): the experts'
own optimizer path beside fleet's sharding optimizer.

Paddle 3.3.1's sharding optimizers assume every rank of the sharding group holds the same parameters.
Stage 1's DygraphShardingOptimizer gives each parameter to one sharding rank by size, reduces its gradient
to that rank averaged over the whole group and broadcasts the updated value from it to the group
(fleet/meta_optimizers/dygraph_optimizer/dygraph_sharding_optimizer.py:212-244 _partition_parameters,
:275-349 reduce_gradients, :357-429 _sharding_sync_parameters); stage 2 (GroupShardedStage2 +
GroupShardedOptimizerStage2) reduces each gradient to its owner over the group in backward hooks
(group_sharded_stage2.py:410-528). The ranks of an expert group hold different experts (of the same
shapes, even the same internal names), so either would average and broadcast one rank's experts into
another's. Only the split-parameter stage 1 (DygraphShardingOptimizerV2, dygraph_sharding_optimizer.py:
870-935) sends parameters marked color={"color": "moe_expert", "group": moe_sharding group} (as
PaddleFormers marks its experts) to that group, and it is refused here (layout.py
REFUSED_PARALLEL_CONFIG_OPTIONS: it drifts from one process).

So the weights are split in two optimizers stepped as one (`ExpertShardedOptimizer`):
    dense    the replicated weights: fleet's stage-1 hybrid optimizer or stage-2 group-sharded optimizer
             over the whole sharding group, unchanged;
    experts  this rank's experts: an AdamW with the same settings and schedule (under amp_master_grad in
             fleet's MixPrecisionOptimizer, as the dense one: it steps on and zeros main_grad). When fleet's
             moe_sharding group (the sharding / ep ranks holding the same experts) has more than one
             rank it is wrapped in fleet's own DygraphShardingOptimizer over that group (`MoeShardingView`:
             the hcg with the moe_sharding group as its sharding group), so each of those ranks keeps
             the optimizer states of 1/moe_sharding of its experts, updates them and broadcasts them to
             the others, as fleet's stage 1 does for the dense weights.
Gradients: an expert's gradient arrives from the all-to-all's backward with every token of its expert
group, divided by the data replicas (models/moe.py); it is summed to its owner over the moe_sharding
group (not averaged: fleet's reduce_gradients would divide by that group's size once more).
Clip: one global norm over both (`ShardedGlobalNormClip`): each rank's squares of the dense gradients it
owns plus those of the expert gradients it owns, summed over the sharding group (every expert has one
owner among all ranks), as fleet's clips sum the owned dense squares over the sharding group
(hybrid_parallel_optimizer.py:69-80, group_sharded_utils.py:171-172), then under the pipeline over the
stages (:100-105), a tied embedding's second copy left out (:100-108); with tp and dp 1, which
layout.check_experts_over_sharding requires, that is all they reduce. The experts are scaled alike.
Pipeline (stage 1 only): fleet's PipelineParallel.train_batch asserts a HybridParallelOptimizer
(pipeline_parallel.py:1311-1313) and then only calls its step() and clear_grad() (:1791-1813), so the pair is
given that class (`PipelineExpertShardedOptimizer`), as PaddleFormers keeps one fleet optimizer in front of its
expert and dense parameters.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist


class MoeShardingView:
    """Fleet's hybrid communicate group as fleet's DygraphShardingOptimizer sees it, with the moe_sharding
    group in place of the sharding group (the only group that optimizer reads from it)."""

    def __init__(self, hcg):
        self._hcg = hcg

    def get_sharding_parallel_group(self):
        return self._hcg.get_moe_sharding_parallel_group()

    def get_sharding_parallel_world_size(self) -> int:
        return self._hcg.get_moe_sharding_parallel_world_size()

    def get_sharding_parallel_rank(self) -> int:
        return self._hcg.get_moe_sharding_parallel_rank()

    def __getattr__(self, name):
        return getattr(self._hcg, name)


class ShardedGlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    """ClipGradByGlobalNorm (paddle/nn/clip.py: g x clip / max(norm, clip)) over the dense gradients this rank
    owns and `expert_grads` (this rank's own experts' gradients, set before each step), squares summed over
    the sharding group. `scale` and `last_norm`: those of the last step."""

    def __init__(self, clip_norm: float, sharding_group, pipeline_group=None):
        super().__init__(clip_norm)
        self.sharding_group, self.pipeline_group = sharding_group, pipeline_group
        self.expert_grads: list = []
        self.scale = self.last_norm = None

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        squares = paddle.zeros([], dtype="float32")
        for param, grad in list(params_grads) + [(None, g) for g in self.expert_grads]:
            if grad is not None and getattr(param, "need_clip", True) and getattr(param, "is_firstly_shared", True):
                squares += paddle.sum(paddle.square(grad.astype("float32")))
        dist.all_reduce(squares, group=self.sharding_group)
        if self.pipeline_group is not None:  # each stage's sum, over the stages
            dist.all_reduce(squares, group=self.pipeline_group)
        self.last_norm = paddle.sqrt(squares)
        self.scale = self.clip_norm / paddle.maximum(self.last_norm, paddle.full([], self.clip_norm, dtype="float32"))
        return scaled(params_grads, self.scale)


class SameScaleClip(paddle.nn.ClipGradByGlobalNorm):
    """The experts' clip: the factor the dense clip found in this step (ShardedGlobalNormClip.scale)."""

    def __init__(self, dense_clip: ShardedGlobalNormClip):
        super().__init__(dense_clip.clip_norm)
        self.dense_clip = dense_clip

    @paddle.no_grad()
    def _dygraph_clip(self, params_grads):
        return scaled(params_grads, self.dense_clip.scale)


def scaled(params_grads, scale):
    return [(p, g if g is None or not getattr(p, "need_clip", True) else g * scale.astype(g.dtype))
            for p, g in params_grads]


def _grad(param):
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class ExpertShardedOptimizer:
    """The dense optimizer (fleet's, `_inner_opt`: what the trainer's and checkpoint's walkers follow) and the
    experts' optimizer, stepped, cleared, saved and loaded as one."""

    def __init__(self, dense, experts, expert_params, replica_group, clip: ShardedGlobalNormClip | None):
        from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
            DygraphShardingOptimizer,
        )

        self._inner_opt = dense
        self.expert_optimizer = experts
        self.expert_params = list(expert_params)
        self.replica_group = replica_group  # fleet's moe_sharding group, None with one rank
        self.clip = clip
        self.sharded = isinstance(experts, DygraphShardingOptimizer)
        # expert parameter name -> the rank of the moe_sharding group that keeps its optimizer states
        self.expert_owner = dict(experts._param2rank) if self.sharded else {p.name: 0 for p in self.expert_params}
        self.replica_rank = replica_group.rank if replica_group is not None else 0

    def owns_expert_state(self, param) -> bool:
        return self.expert_owner[param.name] == self.replica_rank

    @paddle.no_grad()
    def reduce_expert_gradients(self) -> None:
        """Each expert's gradient summed to its owner over the moe_sharding group (as fleet's reduce_gradients,
        dygraph_sharding_optimizer.py:343-349, without its 1/nranks: the model already divided by the data
        replicas). An expert without a gradient counts as zeros, as there."""
        if self.replica_group is None:
            return
        for param in self.expert_params:
            grad = _grad(param)
            if grad is None:
                param.grad = grad = paddle.zeros_like(param)
            dist.reduce(grad, dst=self.replica_group.ranks[self.expert_owner[param.name]], op=dist.ReduceOp.SUM,
                        group=self.replica_group)

    def step(self):
        self.reduce_expert_gradients()
        if self.clip is not None:
            self.clip.expert_grads = [_grad(p) for p in self.expert_params if self.owns_expert_state(p)]
        self._inner_opt.step()
        self.expert_optimizer.step()

    def clear_grad(self, *args):  # stage 2's clear_grad takes no argument (group_sharded_stage2.py:716)
        self._inner_opt.clear_grad(*args)
        self.expert_optimizer.clear_grad(*args)

    clear_gradients = clear_grad

    def state_dict(self):
        state = dict(self._inner_opt.state_dict())
        experts = dict(self.expert_optimizer.state_dict())
        experts.pop("LR_Scheduler", None)  # the same schedule object drives both
        master = {**state.pop("master_weights", {}), **experts.pop("master_weights", {})}
        state.update(experts)
        if master:
            state["master_weights"] = master
        return state

    def set_state_dict(self, state_dict):
        """Each optimizer gets the states of its own parameters (keys start with the internal name)."""
        names = {p.name for p in self.expert_params}

        def of_experts(key):
            return any(key == n or key.startswith(n + "_") for n in names)

        dense, experts = {}, {}
        for key, value in state_dict.items():
            if key == "master_weights":
                dense[key] = {k: v for k, v in value.items() if not of_experts(k)}
                experts[key] = {k: v for k, v in value.items() if of_experts(k)}
            elif key == "LR_Scheduler":  # the same schedule object (AdamW.set_state_dict asserts it is there)
                dense[key] = experts[key] = value
            else:
                (experts if of_experts(key) else dense)[key] = value
        self._inner_opt.set_state_dict(dense)
        self.expert_optimizer.set_state_dict(experts)

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner_opt"], name)


def pipeline_expert_sharded_optimizer(*args):
    """An ExpertShardedOptimizer that is a fleet HybridParallelOptimizer for the pipeline's type check
    (pipeline_parallel.py:1311-1313); the pair's own step, clear_grad and attribute forwarding come first in
    the method order, and HybridParallelOptimizer.__init__ is not run (the dense optimizer is fleet's own)."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )

    class PipelineExpertShardedOptimizer(ExpertShardedOptimizer, HybridParallelOptimizer):
        pass

    return PipelineExpertShardedOptimizer(*args)


def split_expert_optimizer(model, optimizer):
    """(the optimizer over the replicated weights only, an AdamW like it over this rank's experts, the
    experts). Before fleet's wrappers: they partition the optimizer's parameter list.

    Under amp_master_grad the optimizer is fleet's MixPrecisionOptimizer (precision.keep_master_grads) and the
    gradients live in param.main_grad: the experts' AdamW is wrapped alike, so that it steps on main_grad and
    its clear_grad zeros it (a plain AdamW reads the empty param.grad: the experts never trained, and their
    main_grad grew every step into the global norm). `expert_optimizer.expert_adamw`: the AdamW itself."""
    from paddle.distributed.fleet.utils import mix_precision_utils

    experts = [p for p in optimizer._parameter_list if getattr(p, "expert_parallel", False)]
    dense = [p for p in optimizer._parameter_list if not getattr(p, "expert_parallel", False)]
    adamw = paddle.optimizer.AdamW(
        learning_rate=optimizer._learning_rate, parameters=experts, beta1=optimizer._beta1, beta2=optimizer._beta2,
        epsilon=optimizer._epsilon, weight_decay=optimizer._weight_decay,
        apply_decay_param_fun=optimizer._apply_decay_param_fun, grad_clip=None,
        multi_precision=optimizer._multi_precision)
    master_grads = isinstance(optimizer, mix_precision_utils.MixPrecisionOptimizer)
    expert_optimizer = mix_precision_utils.MixPrecisionOptimizer(adamw) if master_grads else adamw
    expert_optimizer.expert_adamw = adamw
    # what fleet's DygraphShardingOptimizer does to keep a rank's part (_set_inner_opt_attr, :533-548), on every
    # optimizer of the chain (MixPrecisionOptimizer keeps its own list beside its inner AdamW's)
    inner = optimizer
    while inner is not None:
        inner._parameter_list = inner._param_groups = dense
        inner = inner.__dict__.get("_inner_opt")
    return optimizer, expert_optimizer, experts


def use_sharded_clip(optimizer, clip_norm: float) -> ShardedGlobalNormClip:
    """fleet's clip on the (wrapped) dense optimizer replaced by ShardedGlobalNormClip. Also on a pipeline stage
    without experts (ERNIE 4.5 MoE's dense layer 0): fleet's clip there finds the same norm but not bitwise the same
    scale, and a tied embedding's two copies (first and last stage) would drift apart (pp2sd2ep2-ernie's replica
    check saw their AdamW moments differ)."""
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedClipGrad

    hcg = fleet.get_hybrid_communicate_group()
    pipeline = hcg.get_pipe_parallel_group() if hcg.get_pipe_parallel_world_size() > 1 else None
    clip = ShardedGlobalNormClip(clip_norm, hcg.get_sharding_parallel_group(), pipeline)
    inner = optimizer
    while inner is not None:  # fleet's clip sits on the innermost optimizer (its wrappers forward to it)
        if isinstance(inner.__dict__.get("_grad_clip"), (HybridParallelClipGrad, GroupShardedClipGrad)):
            inner._grad_clip = clip
        inner = inner.__dict__.get("_inner_opt") or inner.__dict__.get("_optim")
    return clip


def wrap_experts_over_sharding(model, optimizer, wrap_dense):
    """The trainer's optimizer under expert parallelism over sharding ranks: `wrap_dense(model, optimizer)`
    builds fleet's sharding wrappers over the replicated weights; the experts get their own path (above)."""
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    hcg = fleet.get_hybrid_communicate_group()
    optimizer, expert_optimizer, experts = split_expert_optimizer(model, optimizer)
    clip = optimizer._grad_clip
    clip_norm = clip.clip_norm if isinstance(clip, paddle.nn.ClipGradByGlobalNorm) else None
    model, optimizer = wrap_dense(model, optimizer)
    clip = None
    if clip_norm is not None:
        clip = use_sharded_clip(optimizer, clip_norm)
        expert_optimizer.expert_adamw._grad_clip = SameScaleClip(clip)  # the optimizer that applies it
    replicas = hcg.get_moe_sharding_parallel_group() if hcg.get_moe_sharding_parallel_world_size() > 1 else None
    if replicas is not None:
        expert_optimizer = DygraphShardingOptimizer(expert_optimizer, MoeShardingView(hcg))
    pair = pipeline_expert_sharded_optimizer if hcg.get_pipe_parallel_world_size() > 1 else ExpertShardedOptimizer
    return model, pair(optimizer, expert_optimizer, experts, replicas, clip)
