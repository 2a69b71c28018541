"""What ran, read from the objects that were built (not from the arguments that asked for them).

The trainer writes `describe_built_run(...)` into the "run" record of train_log.jsonl:

    layout             degrees of fleet's hybrid communicate group (world, dp, tp, pp, sharding)
    schedule           the pipeline wrapper's class: "1F1B" (PipelineParallel) or "interleaved"
                       (PipelineParallelWithInterleave) with its virtual stage count and the
                       decoder layers of each chunk on each pipeline rank; None without a pipeline
    sharding           the wrapper classes around the model and optimizer, the stage they make,
                       the sharding group's size, and (stage 3) how many parameters are sliced
    sequence_parallel  whether the model's linears are fleet's sequence-parallel ones
    segment_parallel   the sep degree the attention layers were built with (tokens per rank between
                       layers, heads per rank inside attention) and the wrappers around the model;
                       None without segment parallelism
    context_parallel   the same for ring attention (cp degree, tokens per rank, the chunks of each
                       sequence this rank holds); None without it
    recompute          per granularity, the decoder layers that recompute it in backward (the
                       layers' own configuration; PipelineLayer's recompute_interval for "full"
                       under the pipeline)
    precision          parameter dtype, master weights in the optimizer, loss scaling, autocast
    kernels            the fused-kernel branches the model takes, and which of their kernels are CPU
                       stand-ins in this process (LLM_PRETRAIN_KERNEL_STANDINS=1) or Paddle's own

If a mutation or a bug switches a feature off, the record says so even when the arguments
asked for it: a run record is evidence of the layout, not an echo of the argument file.
"""

from __future__ import annotations

GRANULARITIES = ("full", "full_attn", "core_attn")


def unwrap_model(model):
    """The user's model inside fleet's and group sharding's wrappers."""
    while True:
        inner = _wrapped(model)
        if inner is None or inner is model:
            return model
        model = inner


def _wrapped(model):
    """The layer a wrapper wraps: group sharding's `_layer` first, since its __getattr__ forwards a
    missing `_layers` to the wrapped layer (group_sharded_stage2.py:360-365), which would skip a fleet
    wrapper (TensorParallel, SegmentParallel) inside it; fleet's wrappers keep theirs in `_layers`."""
    return getattr(model, "_layer", None) or getattr(model, "_layers", None)


def optimizer_chain(optimizer) -> list:
    """The optimizer and every optimizer it wraps, outermost first."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "_inner_opt", None) or getattr(optimizer, "_optim", None)
    return chain


def model_chain(model) -> list:
    chain = [model]
    while True:
        inner = _wrapped(chain[-1])
        if inner is None or inner is chain[-1]:
            return chain
        chain.append(inner)


def _class_names(objects) -> list[str]:
    return [type(o).__name__ for o in objects]


def built_layout() -> dict:
    """Degrees of the groups fleet built (all 1 without fleet)."""
    import paddle.distributed as dist

    if not dist.is_initialized():
        return {"world_size": 1, "data_parallel_degree": 1, "tensor_parallel_degree": 1,
                "pipeline_parallel_degree": 1, "sharding_degree": 1, "sep_parallel_degree": 1}
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    return {"world_size": dist.get_world_size(), "data_parallel_degree": hcg.get_data_parallel_world_size(),
            "tensor_parallel_degree": hcg.get_model_parallel_world_size(),
            "pipeline_parallel_degree": hcg.get_pipe_parallel_world_size(),
            "sharding_degree": hcg.get_sharding_parallel_world_size(),
            "sep_parallel_degree": hcg.get_sep_parallel_world_size()}


def decoder_layer_indices(layer) -> list[int]:
    from models.decoder import DecoderLayer

    return [sub.layer_index for sub in layer.sublayers(include_self=True) if isinstance(sub, DecoderLayer)]


def describe_schedule(model) -> dict | None:
    """The pipeline schedule fleet built: its class, virtual stages and this rank's chunks."""
    from paddle.distributed.fleet.meta_parallel import PipelineParallel, PipelineParallelWithInterleave

    from paddle.distributed.fleet.meta_parallel import DualPipeVParallel

    wrapper = next((m for m in model_chain(model) if isinstance(m, PipelineParallel)), None)
    if wrapper is None:
        return None
    interleaved = isinstance(wrapper, PipelineParallelWithInterleave)
    dualpipev = isinstance(wrapper, DualPipeVParallel)
    layers = unwrap_model(model)
    # get_model_chunks() answers None with one virtual stage, DualPipeV's two chunks included (pp_layers.py:560)
    chunks = layers.get_model_chunks() if interleaved else layers._model_chunks if dualpipev else [layers]
    return {"class": type(wrapper).__name__,
            "kind": "interleaved" if interleaved else "DualPipeV" if dualpipev else "1F1B",
            "virtual_stages": len(chunks) if interleaved else 1,
            "chunk_layers": [decoder_layer_indices(chunk) for chunk in chunks]}


def describe_sharding(model, optimizer) -> dict | None:
    """Which sharding wrappers were built and the stage they implement (None: no sharding)."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import GroupShardedStage3

    models, optimizers = model_chain(model), optimizer_chain(optimizer)
    stage3 = next((m for m in models if isinstance(m, GroupShardedStage3)), None)
    stage2 = next((m for m in models if isinstance(m, GroupShardedStage2)), None)
    stage2_opt = next((o for o in optimizers if isinstance(o, GroupShardedOptimizerStage2)), None)
    stage1_opt = next((o for o in optimizers if isinstance(o, DygraphShardingOptimizer)), None)
    if stage3 is not None:
        sliced = [p for p in stage3._layer.parameters() if hasattr(p, "fw_storage") and not hasattr(p, "unslice")]
        return {"stage": 3, "implementation": "group_sharded " + type(stage3).__name__,
                "degree": stage3._group.nranks, "segment_size": stage3._segment_size,
                "sliced_parameters": len(sliced), **_sep_gradient_sum(stage3._update_params)}
    if stage2 is not None and stage2_opt is not None:
        return {"stage": 2, "implementation": f"group_sharded {type(stage2).__name__} + {type(stage2_opt).__name__}",
                "degree": stage2_opt._group.nranks, **_sep_gradient_sum(stage2_opt.step)}
    if stage1_opt is not None:
        return {"stage": 1, "implementation": f"fleet {type(stage1_opt).__name__}",
                "degree": stage1_opt._sharding_world_size}
    return None


def describe_expert_states(optimizer) -> dict | None:
    """Under expert parallelism over sharding ranks: the experts' own optimizer and the share of this rank's
    experts whose optimizer states it keeps (llm_pretrain/parallel/expert_optimizer.py)."""
    from llm_pretrain.parallel.expert_optimizer import ExpertShardedOptimizer

    if not isinstance(optimizer, ExpertShardedOptimizer):
        return None
    group = optimizer.replica_group
    return {"implementation": type(optimizer.expert_optimizer).__name__,
            "moe_sharding_degree": group.nranks if group is not None else 1,
            "expert_parameters": len(optimizer.expert_params),
            "states_kept": sum(optimizer.owns_expert_state(p) for p in optimizer.expert_params)}


def describe_experts(model) -> dict | None:
    """A mixture of experts as built on this rank: the expert-parallel degree and the experts this rank holds
    (models/moe.py MoE: num_local_experts from ep_rank x local), from its first MoE layer; None without one."""
    for layer in model.sublayers():
        if hasattr(layer, "num_local_experts") and hasattr(layer, "ep_degree"):
            return {"expert_parallel_degree": layer.ep_degree,
                    "experts": list(range(layer.first_expert, layer.first_expert + layer.num_local_experts))}
    return None


def _sep_gradient_sum(function) -> dict:
    """Under sep or cp: the size of the sep group the stage-2/3 gradients are summed over before the step
    (llm_pretrain/parallel/distributed.py sum_sharded_gradients_over_sep_group marks the function it installs)."""
    group = getattr(function, "sep_group", None)
    return {"gradients_summed_over_sep_group": group.nranks} if group is not None else {}


def describe_sequence_parallel(model) -> dict:
    from paddle.distributed.fleet.utils.sequence_parallel_utils import (
        ColumnSequenceParallelLinear, RowSequenceParallelLinear, is_sequence_parallel_parameter,
    )

    layers = unwrap_model(model).sublayers()
    linears = [m for m in layers if isinstance(m, (ColumnSequenceParallelLinear, RowSequenceParallelLinear))]
    marked = [p for p in unwrap_model(model).parameters() if is_sequence_parallel_parameter(p)]
    return {"enabled": bool(linears), "sequence_parallel_linears": len(linears),
            "parameters_all_reduced_over_tp": len(marked)}


def describe_segment_parallel(model) -> dict | None:
    """Segment parallelism as the model's attention layers were built (None: every rank all tokens)."""
    from models.decoder import Attention
    from models.mla import LatentAttention

    layers = unwrap_model(model)
    attention = [m for m in layers.sublayers() if isinstance(m, (Attention, LatentAttention))]
    if not attention or attention[0].config.sep_parallel_degree <= 1:
        return None
    config = attention[0].config
    return {"degree": config.sep_parallel_degree, "tokens_per_rank": config.tokens_per_rank,
            "attention_heads_per_rank": attention[0].attention_heads,
            "model_wrappers": _class_names(model_chain(model)[:-1])}


def describe_context_parallel(model) -> dict | None:
    """Ring attention as the model's attention layers were built (None: every rank all tokens)."""
    from models import ring_attention
    from models.decoder import Attention
    from models.mla import LatentAttention

    attention = [m for m in unwrap_model(model).sublayers() if isinstance(m, (Attention, LatentAttention))]
    if not attention or attention[0].config.context_parallel_degree <= 1:
        return None
    config = attention[0].config
    from models.parallel_layers import sequence_group

    group = sequence_group()
    return {"degree": config.context_parallel_degree, "tokens_per_rank": config.tokens_per_rank,
            "chunks_of_2cp": list(ring_attention.chunk_ids(group.rank, config.context_parallel_degree)),
            # overlapped: batch_isend_irecv issued before the block it overlaps (NCCL; gloo through the stand-in)
            "transfers": "overlapped" if ring_attention.transfers_overlap(group) else "blocking",
            "model_wrappers": _class_names(model_chain(model)[:-1])}


def describe_recompute(model) -> dict:
    """Per granularity, the decoder layers (global indices, this rank) recomputed in backward."""
    from paddle.distributed.fleet.meta_parallel import PipelineLayer

    from models.decoder import DecoderLayer, recomputes

    layers = unwrap_model(model)
    decoder_layers = [m for m in layers.sublayers() if isinstance(m, DecoderLayer)]
    recomputed = {g: [] for g in GRANULARITIES}
    pipeline_interval = None
    if isinstance(layers, PipelineLayer):
        # The pipeline recomputes whole layers by PipelineLayer's segments (models/pipeline.py);
        # inside a layer only the attention granularities apply.
        pipeline_interval = layers._recompute_interval
        recomputed["full"] = pipeline_recomputed_layers(layers)
        granularities = ("full_attn", "core_attn")
    else:
        granularities = GRANULARITIES
    for layer in decoder_layers:
        for granularity in granularities:
            if recomputes(layer.config, granularity, layer.layer_index):
                recomputed[granularity].append(layer.layer_index)
    out = {g: sorted(v) for g, v in recomputed.items() if v}
    if pipeline_interval is not None:
        out["pipeline_recompute_interval"] = pipeline_interval
    return out


def pipeline_recomputed_layers(layers) -> list[int]:
    """Decoder layers PipelineLayer.forward recomputes (paddle/distributed/fleet/meta_parallel/
    parallel_layers/pp_layers.py): each chunk's functions are cut into segments of
    recompute_interval, and a segment is recomputed only if its input needs a gradient
    (`_need_recompute`). The first segment of stage 0 takes the token ids, so the decoder layers
    that share a segment with the embedding are not recomputed (none when the interval is 1)."""
    from models.decoder import DecoderLayer, MTPLayer

    def index(function):  # DeepSeek-V3's MTP block: its decoder block's index (num_hidden_layers)
        return function.block.layer_index if isinstance(function, MTPLayer) else function.layer_index

    interval = layers._recompute_interval
    if interval <= 0:
        return []
    chunks = layers.get_model_chunks() or [layers]
    recomputed = []
    for chunk_index, chunk in enumerate(chunks):
        functions = chunk.run_function
        for start in range(0, len(functions), interval):
            if layers._stage_id == 0 and chunk_index == 0 and start == 0:
                continue  # input: the token ids (stop_gradient)
            recomputed += [index(f) for f in functions[start:start + interval] if isinstance(f, (DecoderLayer, MTPLayer))]
    return recomputed


def describe_precision(model, optimizer, precision=None) -> dict:
    params = list(unwrap_model(model).parameters())
    dtypes = sorted({str(p.dtype).replace("paddle.", "") for p in params})
    master = any(getattr(o, "_multi_precision", False) for o in optimizer_chain(optimizer))
    return {"parameter_dtypes": dtypes, "master_weights": master,
            "loss_scaling": getattr(precision, "scaler", None) is not None,
            "autocast": getattr(precision, "dtype", None), "amp_level": getattr(precision, "level", None)
            if getattr(precision, "dtype", None) else None}


# The fused-kernel options of a model's config and the kernel bindings each one's branch calls.
KERNEL_BRANCHES = {
    "use_flash_attention": ("flash_attn", "flash_attn_grad"),
    "use_fused_rope": ("fused_rotary_position_embedding",),
    "use_fused_rms_norm": ("fused_rms_norm_quant",),
    "use_fast_layer_norm": ("fast_ln",),
    "use_fused_swiglu": ("swiglu",),
}

FLASHMASK_KERNELS = ("flashmask_attention", "flashmask_attention_grad")


def describe_kernels(model, document_masks: bool = False) -> dict:
    """The fused-kernel branches the built model takes (its config's switches, where its architecture has
    the part: rotary positions, RMSNorm or LayerNorm, SwiGLU) and which of their kernels are CPU stand-ins
    in this process (llm_pretrain/cpu/kernel_standins.py, LLM_PRETRAIN_KERNEL_STANDINS=1); the others run
    Paddle's own kernel (swiglu on CPU, everything on a GPU). With document masks (reset_attention_mask) the
    flash branch calls FlashMask's kernels (models/decoder.py Attention.flashmask_attention)."""
    from llm_pretrain.cpu import kernel_standins

    config = unwrap_model(model).config
    applies = {"use_flash_attention": True, "use_fused_rope": config.position_embedding == "rope",
               "use_fused_rms_norm": config.norm_type == "rmsnorm",
               "use_fast_layer_norm": config.norm_type == "layernorm", "use_fused_swiglu": config.uses_swiglu}
    taken = sorted(option for option in KERNEL_BRANCHES if getattr(config, option) and applies[option])
    branches = dict(KERNEL_BRANCHES, **({"use_flash_attention": FLASHMASK_KERNELS} if document_masks else {}))
    called = [kernel for option in taken for kernel in branches[option]]
    standins = set(kernel_standins.installed_kernel_standins())
    return {"fused_branches": taken, "stand_ins": sorted(k for k in called if k in standins),
            "paddle_kernels": sorted(k for k in called if k not in standins)}


def describe_runtime() -> dict:
    """What this process' kernels run with: the device, and on CPU the thread count, MKL's code path
    switch and whether views are strided (llm_pretrain/cpu/threads.py sets these when the user did not),
    read from Paddle and the environment it loaded with."""
    import os

    import paddle

    runtime = {"device": paddle.get_device()}
    if runtime["device"] == "cpu":
        runtime.update({name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")})
        runtime["strided_views"] = paddle.get_flags(["FLAGS_use_stride_kernel"])["FLAGS_use_stride_kernel"]
    return runtime


def describe_built_run(model, optimizer, precision=None, document_masks: bool = False) -> dict:
    """This rank's view of the built run, merged over ranks where it differs (pipeline stages).

    Collective when distributed (one all_gather_object): call it on every rank."""
    import paddle.distributed as dist

    local = {"schedule": describe_schedule(model), "sharding": describe_sharding(model, optimizer),
             "sequence_parallel": describe_sequence_parallel(model), "recompute": describe_recompute(model),
             "segment_parallel": describe_segment_parallel(model),
             "context_parallel": describe_context_parallel(model),
             "precision": describe_precision(model, optimizer, precision),
             "expert_states": describe_expert_states(optimizer), "experts": describe_experts(model),
             "kernels": describe_kernels(model, document_masks)}
    ranks = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = []
        dist.all_gather_object(ranks, local)
    built = {"layout": built_layout(), **local, "runtime": describe_runtime()}
    # Layers live on different pipeline stages: recompute lists the union, schedule each stage's chunks.
    recompute = {}
    for rank in ranks:
        for key, value in rank["recompute"].items():
            recompute[key] = value if key == "pipeline_recompute_interval" else sorted(
                set(recompute.get(key, [])) | set(value))
    built["recompute"] = recompute
    built.pop("experts")
    if any(rank["experts"] for rank in ranks):  # which experts each rank holds (a stage without MoE layers: None)
        built["experts"] = {"expert_parallel_degree": max((r["experts"] or {}).get("expert_parallel_degree", 1)
                                                          for r in ranks),
                            "experts_of_rank": [(r["experts"] or {}).get("experts") for r in ranks]}
    if local["expert_states"] is not None:  # each rank keeps the states of its own share of its experts
        # (None on a pipeline stage without MoE layers)
        built["expert_states"]["states_kept"] = [(rank["expert_states"] or {}).get("states_kept") for rank in ranks]
    if local["schedule"] is not None:
        from paddle.distributed import fleet

        stage_of = {}
        hcg = fleet.get_hybrid_communicate_group()
        stages = hcg.topology().get_dim("pipe")
        for global_rank, rank in enumerate(ranks):
            stage = hcg.topology().get_coord(global_rank).pipe
            stage_of.setdefault(stage, rank["schedule"]["chunk_layers"])
        built["schedule"] = {**local["schedule"], "chunk_layers": [stage_of[s] for s in range(stages)]}
    return built


def built_strategy_name(built: dict) -> str:
    """The PaddleNLP-style strategy name (pp4vpp2tp2sd2_stage1 ...) of what was built."""
    from llm_pretrain.parallel.layout import strategy_name

    layout, schedule, sharding = built["layout"], built["schedule"], built["sharding"]
    return strategy_name(layout["tensor_parallel_degree"], layout["pipeline_parallel_degree"],
                         layout["sharding_degree"], sharding["stage"] if sharding else 0,
                         schedule["virtual_stages"] if schedule else 1, layout["data_parallel_degree"],
                         (built.get("segment_parallel") or {}).get("degree", 1),
                         (built.get("context_parallel") or {}).get("degree", 1))


def summary_line(built: dict) -> str:
    """A short form for tables: "interleaved x2 · sharding stage 1 · SP · recompute full (8 layers) · fp32"."""
    parts = []
    schedule = built.get("schedule")
    if schedule:
        interleaved = schedule["kind"] == "interleaved"
        parts.append(schedule["kind"] + (f" x{schedule['virtual_stages']}" if interleaved else ""))
    sharding = built.get("sharding")
    if sharding:
        parts.append(f"sharding stage {sharding['stage']}")
    if (built.get("sequence_parallel") or {}).get("enabled"):
        parts.append("SP")
    if built.get("segment_parallel"):
        parts.append(f"sep{built['segment_parallel']['degree']}")
    if built.get("context_parallel"):
        parts.append(f"cp{built['context_parallel']['degree']}")
    for granularity in GRANULARITIES:
        layers = (built.get("recompute") or {}).get(granularity)
        if layers:
            parts.append(f"recompute {granularity} ({len(layers)} layers)")
    precision = built.get("precision") or {}
    dtype = precision.get("autocast") or "/".join(precision.get("parameter_dtypes") or []) or "?"
    parts.append({"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
                 + (" O2" if precision.get("amp_level") == "O2" else ""))
    return " · ".join(parts)
