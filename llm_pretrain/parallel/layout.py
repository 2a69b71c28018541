"""Whether a parallel layout is valid, decided in one place for the trainer and the planner.

    plan_layout              degrees from the arguments and the world size (divisibility)
    check_model_fits_layout  the model's sizes against tensor parallelism
    check_strategy           combinations fleet cannot run (pipeline, sequence parallelism, sharding
                             stages, option strings via parallel_config_settings)
    strategy_name            the PaddleNLP-style name of a layout (also `Layout.strategy`)
    pipeline_split           decoder layers of each pipeline chunk (even, PaddleNLP's uniform, or explicit)
    check_layout_and_model   the layout on N processes and the model it trains (build_model_config), both
                             checked: what the run's preflight and the planner's estimate both run

Every check raises a one-line UsageError before any process group exists
(llm_pretrain/run/preflight.py runs them before fleet.init; llm_pretrain/planner uses the same
functions, so a layout the planner proposes is one the trainer accepts). No Paddle import here.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from llm_pretrain.arguments import Arguments
from llm_pretrain.cpu.standin_switch import kernel_standins_requested
from llm_pretrain.errors import UsageError
from models.config import ModelConfig
from models.hf_directory import check_hf_weights
from models.registry import read_config_json, resolve_model


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
    sep_parallel_degree: int = 1  # segment parallelism (PaddleNLP's sep_parallel_degree): ranks share samples
    context_parallel_degree: int = 1  # ring attention, on the same fleet group as sep (never both)
    pipeline_layers_per_stage: tuple[int, ...] | None = None  # as asked for; pipeline_split() decides
    dualpipev: bool = False  # fleet's DualPipeV schedule: two chunks per stage in a V
    data_parallel_rank: int = 0
    tensor_parallel_rank: int = 0
    pipeline_parallel_rank: int = 0
    sharding_rank: int = 0
    sep_parallel_rank: int = 0  # in fleet's sep group (sep or cp)
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def sequence_group_degree(self) -> int:
        """Size of fleet's sep group: the ranks holding parts of the same sequences (sep or cp)."""
        return self.sep_parallel_degree * self.context_parallel_degree

    @property
    def data_replicas(self) -> int:
        """How many different slices of each global batch are read (dp x sharding; the ranks of a sep
        group read the same samples, each holding 1/sep of every sequence)."""
        return self.data_parallel_degree * self.sharding_degree

    @property
    def data_replica_rank(self) -> int:
        return self.data_parallel_rank * self.sharding_degree + self.sharding_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> str:
        """This run's strategy name (data parallelism included): pp4tp2sd2_stage1, tp2dp4, dp8."""
        return strategy_name(self.tensor_parallel_degree, self.pipeline_parallel_degree, self.sharding_degree,
                             self.sharding_stage, self.virtual_pp_degree, self.data_parallel_degree,
                             self.sep_parallel_degree, self.context_parallel_degree)


def _degree(value: int) -> int:
    return 1 if value == -1 else value


def plan_layout(args: Arguments, world_size: int) -> Layout:
    """Degrees from the arguments and the world size, validated; no communication."""
    tp = _degree(args.tensor_parallel_degree)
    pp = _degree(args.pipeline_parallel_degree)
    sep = _degree(args.sep_parallel_degree)
    cp = _degree(args.context_parallel_degree)
    stage = int(args.sharding[-1]) if args.sharding else 0
    sharding_degree = _degree(args.sharding_parallel_degree if args.sharding_parallel_degree != -1 else args.sharding_degree)
    if stage and args.sharding_parallel_degree == -1 and args.sharding_degree == -1:
        sharding_degree = max(1, world_size // (tp * pp * sep * cp))  # PaddleNLP derives it from the world size
    if not stage:
        sharding_degree = 1
    model_degrees = tp * pp * sharding_degree * sep * cp
    if world_size % model_degrees != 0:
        raise UsageError(
            f"world size {world_size} is not a multiple of tensor_parallel_degree {tp} x pipeline_parallel_degree {pp}"
            f" x sharding_parallel_degree {sharding_degree}" + (f" x sep_parallel_degree {sep}" if sep > 1 else "")
            + (f" x context_parallel_degree {cp}" if cp > 1 else "")
            + f" = {model_degrees}"
        )
    return Layout(
        world_size=world_size,
        data_parallel_degree=world_size // model_degrees,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        sharding_degree=sharding_degree,
        sharding_stage=stage,
        virtual_pp_degree=args.virtual_pp_degree,
        sep_parallel_degree=sep,
        context_parallel_degree=cp,
        pipeline_layers_per_stage=tuple(args.pipeline_layers_per_stage) if args.pipeline_layers_per_stage else None,
        dualpipev="use_dualpipev" in args.pipeline_parallel_config.replace(",", " ").split(),
    )


def pipeline_chunks(layout: Layout) -> int:
    """Model chunks per pipeline stage: virtual_pp_degree, or 2 for DualPipeV's V."""
    return 2 if layout.dualpipev else layout.virtual_pp_degree


def pipeline_split(num_layers: int, pp: int, vpp: int = 1, layers_per_stage=None) -> list[int]:
    """Decoder layers of each pipeline chunk, in fleet's chunk order (virtual stage v of stage s is chunk
    v * pp + s; without interleaving one chunk per stage). The embedding goes with chunk 0, the final norm
    and head with the last chunk.

    Explicit (`pipeline_layers_per_stage`): used as given. Otherwise even when pp x vpp divides the layers
    (fleet's seg_method "layer:DecoderLayer"), else PaddleNLP's fallback (paddlenlp/transformers/llama/
    modeling_pp.py:253-255, seg_method "uniform"): fleet's SegmentLayers.uniform (paddle/distributed/fleet/
    meta_parallel/parallel_layers/pp_layers.py:265-273) cuts all num_layers + 3 pipeline items (embedding,
    decoder layers, final norm, head) into parts of equal size, the last parts one item larger; the
    embedding and head thus count as a layer each (BLOOM-176B's 70 layers on 12 stages: 5, 6 x 10, 5).
    """
    chunks = pp * vpp
    key = "pipeline_layers_per_stage"
    if layers_per_stage is not None:
        split = list(layers_per_stage)
        if len(split) != chunks:
            raise UsageError(f"{key}: {split} has {len(split)} entries; pipeline_parallel_degree {pp} x "
                             f"virtual_pp_degree {vpp} needs {chunks}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split):
            raise UsageError(f"{key}: {split} leaves a stage empty or is not whole numbers; every stage needs "
                             "at least one decoder layer")
        if sum(split) != num_layers:
            raise UsageError(f"{key}: {split} sums to {sum(split)}, the model has num_hidden_layers {num_layers}")
        return split
    if num_layers % chunks == 0:
        return [num_layers // chunks] * chunks
    items = num_layers + 3
    size, extra = divmod(items, chunks)
    bounds = [0] + [min(size * i + max(0, i - (chunks - extra)), items) for i in range(1, chunks)] + [items]
    # items before bound i that are decoder layers: all but the embedding (item 0), capped at num_layers
    decoder_before = [min(max(b - 1, 0), num_layers) for b in bounds]
    split = [decoder_before[i + 1] - decoder_before[i] for i in range(chunks)]
    if min(split) < 1:
        raise UsageError(f"pipeline_parallel_degree {pp} x virtual_pp_degree {vpp}: fleet's uniform split of "
                         f"num_hidden_layers {num_layers} gives {split} decoder layers per stage, an empty stage; "
                         f"use fewer stages or set {key}")
    return split


def stage_layer_indices(split: list[int], pp: int, stage: int, dualpipev: bool = False) -> list[list[int]]:
    """The decoder layer indices of each chunk of pipeline stage `stage` under `split` (pipeline_split):
    chunks stage, stage + pp, ... (interleaved); under DualPipeV chunks stage and 2 pp - 1 - stage (the V,
    pp_layers.py _segment_network_for_dualpipev)."""
    starts = [sum(split[:c]) for c in range(len(split))]
    chunks = (stage, 2 * pp - 1 - stage) if dualpipev else range(stage, len(split), pp)
    return [list(range(starts[c], starts[c] + split[c])) for c in chunks]


def strategy_name(tensor_parallel_degree: int = 1, pipeline_parallel_degree: int = 1, sharding_degree: int = 1,
                  sharding_stage: int = 0, virtual_pp_degree: int = 1, data_parallel_degree: int | None = None,
                  sep_parallel_degree: int = 1, context_parallel_degree: int = 1) -> str:
    """PaddleNLP-style strategy name: pp4tp2sd2_stage1, tp2sd4_stage2, sd8_stage2, tp2, dp8, tp2sep2.

    Order: pipeline (with virtual stages), tensor, segment (PaddleNLP's "sep") or context ("cp"), data, sharding. Argument files don't know the
    world size, so their names leave data parallelism out (data_parallel_degree None).
    """
    name = ""
    if pipeline_parallel_degree > 1:
        name += f"pp{pipeline_parallel_degree}"
        if virtual_pp_degree > 1:
            name += f"vpp{virtual_pp_degree}"
    if tensor_parallel_degree > 1:
        name += f"tp{tensor_parallel_degree}"
    if sep_parallel_degree > 1:
        name += f"sep{sep_parallel_degree}"
    if context_parallel_degree > 1:
        name += f"cp{context_parallel_degree}"
    if data_parallel_degree is not None and (data_parallel_degree > 1 or not name and not sharding_stage):
        name += f"dp{data_parallel_degree}"
    if sharding_stage:
        name += f"sd{sharding_degree}_stage{sharding_stage}"
    return name or "dp"


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
        # fleet's newer schedules (paddle/distributed/fleet/model.py:140-162 picks the class): PaddleNLP's
        # option for VPPFhenBInBalancedMemory (its training_args "best_unbalanced_scheduler"), and DualPipeV
        # (fleet/meta_parallel/dualpipev.py) under the name of its fleet field.
        "best_unbalanced_scheduler": ("pp_configs", "best_unbalanced_scheduler", True),
        "use_dualpipev": ("pp_configs", "use_dualpipev", True),
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


def check_model_fits_layout(config: ModelConfig, layout: Layout) -> None:
    tp = layout.tensor_parallel_degree
    for key in ("num_attention_heads", "vocab_size", "intermediate_size"):
        if getattr(config, key) % tp:
            raise UsageError(f"tensor_parallel_degree: {tp} does not divide the model's {key} {getattr(config, key)}")
    # Key/value heads are split over the ranks when tp divides them, replicated (each rank keeps
    # the one its query heads share) when they divide tp.
    kv = config.num_key_value_heads
    if kv % tp and tp % kv:
        raise UsageError(f"tensor_parallel_degree: {tp} and the model's num_key_value_heads {kv} must divide one "
                         "another (kv heads are split over the ranks or replicated on them)")
    if kv < tp and config.fuse_attention_qkv:
        raise UsageError(f"fuse_attention_qkv: cannot be true when the model's num_key_value_heads {kv} is smaller "
                         f"than tensor_parallel_degree {tp} (replicated kv heads need separate k/v projections); "
                         "set fuse_attention_qkv false")
    if config.hidden_size % config.num_attention_heads:
        raise UsageError(f"model: hidden_size {config.hidden_size} is not divisible by num_attention_heads "
                         f"{config.num_attention_heads}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UsageError(f"model: num_attention_heads {config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {config.num_key_value_heads}")


def check_segment_parallel(args: Arguments, config: ModelConfig, layout: Layout) -> None:
    """sep_parallel_degree: what the sequence, the heads and the other degrees must allow."""
    sep, tp = layout.sep_parallel_degree, layout.tensor_parallel_degree
    if sep <= 1:
        return
    if args.max_seq_length % sep:
        raise UsageError(f"sep_parallel_degree: {sep} does not divide max_seq_length {args.max_seq_length} "
                         "(each rank holds an equal chunk of every sequence)")
    if config.num_attention_heads % (tp * sep):
        raise UsageError(f"sep_parallel_degree: {sep} x tensor_parallel_degree {tp} does not divide the model's "
                         f"num_attention_heads {config.num_attention_heads} (the all-to-all gives each rank 1/sep of "
                         "its heads)")
    kv_per_rank = max(config.num_key_value_heads // tp, 1)  # replicated when there are fewer than tp
    if kv_per_rank % sep and sep % kv_per_rank:
        raise UsageError(f"sep_parallel_degree: {sep} and the model's {kv_per_rank} kv heads per tensor-parallel rank "
                         "must divide one another (kv heads are split over the sep ranks or repeated on them)")
    _check_sequence_split(args, layout, "sep_parallel_degree", sep)


def check_context_parallel(args: Arguments, config: ModelConfig, layout: Layout) -> None:
    """context_parallel_degree (ring attention): what the sequence and the other options must allow."""
    cp = layout.context_parallel_degree
    if cp <= 1:
        return
    if layout.sep_parallel_degree > 1:
        raise UsageError(f"context_parallel_degree: {cp} cannot be combined with sep_parallel_degree "
                         f"{layout.sep_parallel_degree} (both use fleet's sep group; choose one)")
    if cp % 2:
        raise UsageError(f"context_parallel_degree: {cp} must be even (the ring's point-to-point order pairs "
                         "neighbours)")
    if args.max_seq_length % (2 * cp):
        raise UsageError(f"context_parallel_degree: max_seq_length {args.max_seq_length} must be divisible by "
                         f"2 x context_parallel_degree = {2 * cp} (each rank holds 2 chunks, balanced for the causal mask)")
    if config.attention_probs_dropout_prob:
        raise UsageError(f"attention_probs_dropout_prob: {config.attention_probs_dropout_prob} is not supported with "
                         "context_parallel_degree > 1 (ring attention has no attention dropout); set it to 0")
    _check_sequence_split(args, layout, "context_parallel_degree", cp)


def _check_sequence_split(args: Arguments, layout: Layout, key: str, degree: int) -> None:
    """What sep and cp (each splitting every sequence over fleet's sep group) both need of the other options."""
    tp = layout.tensor_parallel_degree
    tokens_per_rank = args.per_device_train_batch_size * args.max_seq_length // degree
    if args.sequence_parallel and tokens_per_rank % tp:
        raise UsageError(f"sequence_parallel: per_device_train_batch_size x max_seq_length / {key} = "
                         f"{tokens_per_rank} must be divisible by tensor_parallel_degree {tp}")
    if layout.dualpipev:
        raise UsageError(f"{key}: {degree} cannot be combined with pipeline_parallel_config use_dualpipev "
                         "(not proven against one process); use the 1F1B or interleaved pipeline")


def check_strategy(args: Arguments, config: ModelConfig, layout: Layout) -> None:
    """Combinations of degrees and options that fleet cannot run (checked before fleet.init)."""
    tp, pp, vpp = layout.tensor_parallel_degree, layout.pipeline_parallel_degree, layout.virtual_pp_degree
    check_segment_parallel(args, config, layout)
    check_context_parallel(args, config, layout)
    if layout.pipeline_layers_per_stage and pp == 1:
        raise UsageError(f"pipeline_layers_per_stage: {list(layout.pipeline_layers_per_stage)} needs "
                         "pipeline_parallel_degree > 1")
    if layout.dualpipev:
        check_dualpipev(args, layout)
    if pp > 1:
        pipeline_split(config.num_hidden_layers, pp, pipeline_chunks(layout), layout.pipeline_layers_per_stage)
    if "best_unbalanced_scheduler" in args.pipeline_parallel_config.replace(",", " ").split() and not (vpp > 1 and pp == args.gradient_accumulation_steps):
        # fleet reads it only for an interleaved pipeline with pp <= micro-batches < 2 pp (fleet/model.py:153-157),
        # where PipelineParallelWithInterleaveFthenB needs a multiple of pp (pipeline_parallel.py:3482)
        raise UsageError("pipeline_parallel_config: best_unbalanced_scheduler (fleet's VPPFhenBInBalancedMemory) needs "
                         f"virtual_pp_degree > 1 and gradient_accumulation_steps == pipeline_parallel_degree {pp}; "
                         f"got virtual_pp_degree {vpp}, gradient_accumulation_steps {args.gradient_accumulation_steps} "
                         "(paddle/distributed/fleet/model.py:148-162 chooses the schedule)")
    if vpp > 1 and pp <= 2:
        raise UsageError(f"virtual_pp_degree: {vpp} needs pipeline_parallel_degree > 2 (Paddle's interleaved "
                         f"schedule), got pipeline_parallel_degree {pp}")
    acc = args.gradient_accumulation_steps
    if vpp > 1 and pp < acc < 2 * pp:
        # fleet picks the interleaved schedule by micro-batch count (paddle/distributed/fleet/model.py:148-162):
        # from pp to 2 pp - 1 PipelineParallelWithInterleaveFthenB, which asserts accumulate_steps % num_stages
        # == 0 (fleet/meta_parallel/pipeline_parallel.py:3482)
        raise UsageError(f"gradient_accumulation_steps: {acc} with pipeline_parallel_degree {pp} and virtual_pp_degree "
                         f"{vpp}: Paddle's interleaved schedules need {pp} or at least {2 * pp} micro-batches "
                         "(PipelineParallelWithInterleaveFthenB asserts a multiple of the stages, "
                         "pipeline_parallel.py:3482)")
    if args.sequence_parallel and tp <= 1:
        raise UsageError("sequence_parallel: needs tensor_parallel_degree > 1 (got "
                         f"{args.tensor_parallel_degree})")
    if args.sequence_parallel and (args.per_device_train_batch_size * args.max_seq_length) % tp:
        raise UsageError(f"sequence_parallel: per_device_train_batch_size x max_seq_length = "
                         f"{args.per_device_train_batch_size * args.max_seq_length} must be divisible by "
                         f"tensor_parallel_degree {tp}")
    if layout.sharding_stage in (2, 3) and pp > 1:
        raise UsageError(f"sharding: stage{layout.sharding_stage} cannot be combined with pipeline_parallel_degree "
                         f"{pp} (use stage1 with pipeline parallelism)")
    if layout.sharding_stage == 3 and tp > 1:
        raise UsageError(f"sharding: stage3 cannot be combined with tensor_parallel_degree {tp}: Paddle's stage-3 "
                         "gradient clip sums norms over the sharding group only (as PaddleNLP, use stage1 or stage2)")
    if pp > 1 and args.gradient_accumulation_steps < pp:
        raise UsageError(f"gradient_accumulation_steps: {args.gradient_accumulation_steps} is smaller than "
                         f"pipeline_parallel_degree {pp}; the pipeline needs at least {pp} micro-batches per step")
    for split_requested, iterations in ((args.do_eval, args.eval_iters), (args.do_predict, predict_iterations(args))):
        if pp > 1 and split_requested:  # raises when the eval batches cannot be pipeline micro-batches
            pipeline_eval_micro_batches(args, iterations, vpp)
    parallel_config_settings(args)
    check_master_grad(args, layout)


def check_master_grad(args, layout) -> None:
    """amp_master_grad where it cannot work safely is a UsageError (called before fleet.init)."""
    if not args.amp_master_grad or not (args.bf16 or args.fp16) or args.fp16_opt_level != "O2":
        return  # only O2 has half-precision gradients to keep in float32
    if not layout.distributed:
        return
    # sep/cp (alone or with dp) is not pure data parallelism: fleet wraps the model in SegmentParallel and its
    # hybrid optimizer sums main_grad over the sep (dp x sep) group (hybrid_parallel_optimizer.py:626-638 ->
    # hybrid_parallel_util.py:95-99, 265-290), as under tp/pp (tests/test_long_context.py::test_sep2_mechanism).
    pure_data_parallel = (layout.tensor_parallel_degree == 1 and layout.pipeline_parallel_degree == 1
                          and not layout.sharding_stage and layout.sequence_group_degree == 1)
    if pure_data_parallel:
        raise UsageError(
            "amp_master_grad: not supported with pure data parallelism: fleet's DataParallel all-reduces "
            "param.grad, which the float32 main_grad hooks empty (PaddleNLP needs its own gradient all-reduce "
            "there); use tensor/pipeline/sep/context parallelism or sharding stage1/stage2, or set amp_master_grad "
            "false")
    if layout.sharding_stage == 3:
        raise UsageError(
            "amp_master_grad: not supported with sharding stage3: Paddle 3.3.1's stage-3 optimizer has no "
            "main_grad support; use stage1 or stage2, or set amp_master_grad false")
    if layout.sharding_stage == 2 and layout.data_parallel_degree > 1:
        raise UsageError(
            f"amp_master_grad: not supported with sharding stage2 and data_parallel_degree "
            f"{layout.data_parallel_degree} (as PaddleNLP: stage-2 main grads are not reduced over the data-parallel "
            "group); use sharding over all ranks, or set amp_master_grad false")
def check_dualpipev(args: Arguments, layout: Layout) -> None:
    """What fleet's DualPipeV cannot run, refused before fleet.init."""
    pp, vpp, acc = layout.pipeline_parallel_degree, layout.virtual_pp_degree, args.gradient_accumulation_steps
    if pp < 2 or vpp > 1:
        raise UsageError(f"pipeline_parallel_config: use_dualpipev needs pipeline_parallel_degree > 1 and no "
                         f"virtual_pp_degree (got {pp} and {vpp}; pp_layers.py:445-447: 'dualpipev is not compatible "
                         "with virtual pipeline')")
    if acc < 2 * pp:
        raise UsageError(f"gradient_accumulation_steps: {acc} is fewer than the 2 x pipeline_parallel_degree = "
                         f"{2 * pp} micro-batches DualPipeV needs (fleet/meta_parallel/dualpipev.py:703)")
    if args.do_eval or args.do_predict:
        raise UsageError("pipeline_parallel_config: use_dualpipev cannot evaluate (do_eval/do_predict): "
                         "DualPipeVParallel defines no eval_batch and inherits PipelineParallel's "
                         "(pipeline_parallel.py:1383), which runs one chunk per stage in order, not the V; "
                         "set do_eval and do_predict false")
    if not paddle_has_deep_ep():
        raise UsageError("pipeline_parallel_config: use_dualpipev needs paddle.distributed.communication.deep_ep, "
                         "which this Paddle build lacks: DualPipeVParallel waits on deep_ep events between its "
                         "passes (paddle/distributed/fleet/meta_parallel/dualpipev.py:28-31 imports it or sets None, "
                         ":390 calls deep_ep.get_event_from_custom_stream)")


def paddle_has_deep_ep() -> bool:
    """Whether the installed Paddle ships DeepEP's module (GPU builds), found without importing Paddle."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("paddle")
    return spec is not None and any(
        os.path.exists(os.path.join(location, "distributed", "communication", "deep_ep"))
        for location in spec.submodule_search_locations or [])


def pipeline_eval_micro_batches(args: Arguments, iterations: int, virtual_pp_degree: int = 1) -> tuple[int, int]:
    """(pipeline calls, micro-batches per call) that evaluate `iterations` batches of per_device_eval_batch_size.

    The pipeline's micro-batch has the training size (its p2p buffers are sized by it); an eval batch of
    another size is split into several micro-batches -- all eval_iters batches of one evaluation pass
    through the pipeline in calls of gradient_accumulation_steps micro-batches (or one call of them all).
    The mean over equal micro-batches is PaddleNLP's mean over its per-batch losses.
    """
    micro, eval_batch = args.per_device_train_batch_size, args.per_device_eval_batch_size
    if eval_batch % micro:
        raise UsageError(f"per_device_eval_batch_size: {eval_batch} must be a multiple of "
                         f"per_device_train_batch_size {micro} under pipeline parallelism (evaluation runs "
                         "training-sized pipeline micro-batches)")
    total = eval_batch // micro * iterations
    if total % args.gradient_accumulation_steps == 0:
        return total // args.gradient_accumulation_steps, args.gradient_accumulation_steps
    if virtual_pp_degree > 1:  # the interleaved schedule runs only the micro-batch counts it was set up for
        raise UsageError(f"per_device_eval_batch_size: {eval_batch} x {iterations} eval batches = "
                         f"{total} micro-batches of {micro} is not a multiple of gradient_accumulation_steps "
                         f"{args.gradient_accumulation_steps}, which the interleaved pipeline (virtual_pp_degree "
                         f"{virtual_pp_degree}) needs")
    return 1, total


def predict_iterations(args: Arguments) -> int:
    """Batches of the test split, as PaddleNLP's llm/run_pretrain.py: test_iters = eval_iters * 10."""
    return 10 * args.eval_iters


# ----------------------------------------------------------------------------- mixture of experts
def with_moe_options(args: Arguments, config: ModelConfig) -> ModelConfig:
    """The run's mixture-of-experts options in the model config (models/moe.py)."""
    if not config.is_moe:
        return config
    changes = dict(router_z_loss_coef=args.router_z_loss_coef, moe_capacity_factor=args.moe_capacity_factor,
                   expert_parallel_degree=_degree(args.expert_parallel_degree),
                   moe_global_batch_balance=args.moe_global_batch_balance,
                   moe_bias_update_rate=getattr(args, "moe_bias_update_rate", 0.0))
    if args.router_aux_loss_coef is not None:
        changes["router_aux_loss_coef"] = args.router_aux_loss_coef
    if getattr(args, "seq_aux_loss_coef", None) is not None:
        changes["seq_aux_loss_coef"] = args.seq_aux_loss_coef
    return config.replace(**changes)


def check_mixture_of_experts(args: Arguments, config: ModelConfig, layout: Layout) -> None:
    """Expert counts, top-k and expert parallelism against the model and the layout."""
    ep = _degree(args.expert_parallel_degree)
    if ep < 1:
        raise UsageError(f"expert_parallel_degree: {args.expert_parallel_degree} must be -1 or a positive integer")
    if not config.is_moe:
        if ep > 1:
            raise UsageError(f"expert_parallel_degree: {ep} needs a mixture-of-experts model ({config.family} has "
                             "no experts; mixtral and qwen2_moe have)")
        if getattr(args, "moe_global_batch_balance", False):
            raise UsageError(f"moe_global_batch_balance: true needs a mixture-of-experts model ({config.family} has "
                             "no experts; allowed: false)")
        return
    experts, top_k = config.num_experts, config.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise UsageError(f"model: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    if experts % ep:
        raise UsageError(f"expert_parallel_degree: {ep} does not divide the model's num_experts {experts}")
    if ep > 1 and layout.sharding_stage and layout.data_parallel_degree > 1:
        raise UsageError(f"expert_parallel_degree: {ep} with sharding stage{layout.sharding_stage} needs "
                         f"data_parallel_degree 1, got {layout.data_parallel_degree}: fleet's MoE topology puts the "
                         "experts on sharding ranks and asserts dp_degree 1 (fleet/base/topology.py:878-880); use "
                         "sharding over all data replicas, or data parallelism without sharding")
    if experts_over_sharding(layout, ep):
        check_experts_over_sharding(args, layout, ep, config.family)
    elif ep > 1 and layout.data_parallel_degree % ep:
        raise UsageError(f"expert_parallel_degree: {ep} must divide the data-parallel degree "
                         f"({layout.data_parallel_degree}): the experts are split over groups of data-parallel "
                         "ranks, which read their own samples (or over the sharding ranks, with sharding stage1 or "
                         "stage2 and data_parallel_degree 1)")
    if layout.tensor_parallel_degree > 1 and config.expert_intermediate_size % layout.tensor_parallel_degree:
        raise UsageError(f"tensor_parallel_degree: {layout.tensor_parallel_degree} does not divide the experts' "
                         f"width {config.expert_intermediate_size} (experts are split like the dense MLP)")
    evaluates = getattr(args, "do_eval", False) or getattr(args, "do_predict", False)
    train_batch, eval_batch = getattr(args, "per_device_train_batch_size", 1), getattr(args, "per_device_eval_batch_size", 1)
    if layout.pipeline_parallel_degree > 1 and evaluates and eval_batch != train_batch:
        raise UsageError(f"per_device_eval_batch_size: {eval_batch} must equal per_device_train_batch_size {train_batch} "
                         "for a mixture-of-experts model under the pipeline: its evaluation runs training-sized "
                         "micro-batches, and the load-balancing loss of a batch is not the mean of its parts'")
    if layout.dualpipev:
        raise UsageError("pipeline_parallel_config: use_dualpipev is not supported with a mixture-of-experts model "
                         "(its overlapped schedule runs the loss as a schedule node, which does not take the router "
                         "statistics the stages pass on; models/pipeline.py); use the 1F1B or interleaved schedule")
    if ep > 1 and layout.sequence_group_degree > 1:
        key = "sep_parallel_degree" if layout.sep_parallel_degree > 1 else "context_parallel_degree"
        raise UsageError(f"{key}: {layout.sequence_group_degree} cannot be combined with expert_parallel_degree {ep} "
                         "yet (not proven against one process); use expert_parallel_degree 1 with sep/cp")


def experts_over_sharding(layout: Layout, ep: int) -> bool:
    """Whether expert parallelism runs over the sharding ranks through fleet's own expert and moe_sharding
    groups (EPHybridCommunicateGroup, which exists only with dp_degree 1: fleet/base/topology.py:878-880)
    rather than over the data-parallel ranks (models/moe.py expert_parallel_groups)."""
    return ep > 1 and layout.sharding_stage > 0 and layout.data_parallel_degree == 1


def check_experts_over_sharding(args: Arguments, layout: Layout, ep: int, family: str = "") -> None:
    """What fleet's expert group over sharding ranks cannot honour (llm_pretrain/parallel/expert_optimizer.py)."""
    stage, sd = layout.sharding_stage, layout.sharding_degree
    if stage == 3:
        raise UsageError(f"sharding: stage3 cannot be combined with expert_parallel_degree {ep} (stage 3 slices every "
                         "parameter over the whole sharding group, whose ranks hold different experts); use stage1 "
                         "or stage2")
    pipeline_pair = frozenset({"pipeline_parallel_degree", "sharding_parallel_degree", "expert_parallel_degree"})
    if layout.pipeline_parallel_degree > 1 and pipeline_pair not in PROVEN_PAIRS.get(family, {}):
        raise UsageError(f"pipeline_parallel_degree: {layout.pipeline_parallel_degree} with expert_parallel_degree {ep} "
                         f"over sharding ranks is not proven for {family} yet (no test trains it against one process; "
                         "qwen3_moe, ernie4_5_moe and deepseek_v3 are trained so); use data parallelism for pipeline "
                         "x experts (no sharding), or "
                         "expert_parallel_degree 1")
    if sd % ep:
        raise UsageError(f"expert_parallel_degree: {ep} must divide sharding_parallel_degree {sd} (the experts are "
                         "split over groups of sharding ranks; fleet's moe_sharding degree is their quotient)")
    if layout.tensor_parallel_degree > 1:
        raise UsageError(f"tensor_parallel_degree: {layout.tensor_parallel_degree} cannot be combined with "
                         f"expert_parallel_degree {ep} over sharding ranks: fleet's MoE topology (pipe x moe_sharding "
                         "x expert, topology.py:802-810) puts the tensor-parallel ranks in the expert group, while "
                         "this toolkit splits each expert like the dense MLP; use data parallelism for ep x tp")
    if args.sharding_parallel_config.strip():
        raise UsageError(f"sharding_parallel_config: {args.sharding_parallel_config!r} is not supported with "
                         f"expert_parallel_degree {ep} over sharding ranks (the experts' own stage-1 optimizer reads "
                         "the same options and is tested without them); leave it empty")
    if args.fp16:
        raise UsageError(f"fp16: not supported with expert_parallel_degree {ep} over sharding ranks (the loss scaler "
                         "unscales fleet's sharding optimizer, not the experts' own one, "
                         "llm_pretrain/parallel/expert_optimizer.py); "
                         "use bf16")


# ----------------------------------------------------------------------------- the model a layout trains
# Families whose layouts are proven one by one (issue 34): family -> the degrees that may exceed 1, each proven
# against one process (1e-5, fp32) by a shared launch of tests/test_parallel_parity.py (TP_ONLY: tp2 and tp2 + SP,
# Qwen3-MoE's there as QWEN3_MOE_TP; LAYOUT_SHORT: 2 layers for 2 steps in dp2, the 1F1B pp2 and sharding stages 1-3) or
# tests/test_long_context.py (sep2, cp2; Qwen3-MoE with global-batch balancing and ERNIE 4.5 MoE with its bias rule as
# "<family>-short", the router statistics summed over the sep group) or tests/test_expert_parallel.py (Qwen3-MoE, ERNIE 4.5 MoE: ep2 over dp2 and
# over sd2 stages 1 and 2). The pipeline: 1F1B (virtual stages for PROVEN_INTERLEAVED only, no DualPipeV); one degree above 1 at a time
# (ep over dp or sharding, and PROVEN_PAIRS, aside). Larger degrees of a proven one run the same code. Every other layout of these
# families is refused until a test trains it.
# DeepSeek-V3 (issue 35): tp2 (+SP), pp2 (1F1B, MTP on the last stage), dp2 and sd2 stages 1-3 in
# tests/test_parallel_parity.py (deepseek-v3-short), pp3 interleaved and in uneven 1F1B stages in
# tests/test_uneven_pipeline.py (PROVEN_INTERLEAVED), ep2 over dp2 and over sd2 stages 1 and 2 in
# tests/test_expert_parallel.py (deepseek-ep2, deepseek-ep2sd2s1/s2), its router biases equal one process's; sep2 and
# cp2 in tests/test_long_context.py (deepseek-sep2, -cp2: MLA's all-to-all or ring, the sequence-wise loss summed over
# the sep group, MTP; with tp2 + SP and packed documents, and with sharding 2 at stage 2: PROVEN_PAIRS); pp2 x dp2 with ep2 over dp in
# tests/test_expert_parallel.py (pp2dp2ep2-deepseek, PROVEN_PAIRS), and pp2 x sd2 stage 1 with ep2 over the sharding
# ranks (pp2sd2ep2-deepseek, the shared pp2sd2 launch).
_DP_PP_SD = ("data_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree")
PROVEN_DEGREES = {"qwen3": ("tensor_parallel_degree", "sep_parallel_degree", "context_parallel_degree") + _DP_PP_SD,
                  "qwen3_moe": ("tensor_parallel_degree", "sep_parallel_degree", "context_parallel_degree") + _DP_PP_SD
                  + ("expert_parallel_degree",),
                  "ernie4_5": ("tensor_parallel_degree", "sep_parallel_degree", "context_parallel_degree") + _DP_PP_SD,
                  "ernie4_5_moe": ("tensor_parallel_degree", "sep_parallel_degree", "context_parallel_degree") + _DP_PP_SD
                  + ("expert_parallel_degree",),
                  "deepseek_v3": ("tensor_parallel_degree", "sep_parallel_degree", "context_parallel_degree")
                  + _DP_PP_SD + ("expert_parallel_degree",)}
# Every stage, each family in the shared sd2 launch (test_parallel_parity test_sharding_stages: LAYOUT_SHORT,
# check_deepseek_sd2); a pair (PROVEN_PAIRS) may have fewer
PROVEN_SHARDING_STAGES = (1, 2, 3)
# Families trained with their experts over the sharding ranks (fleet's expert group, data_parallel_degree 1;
# tests/test_expert_parallel.py's ep2 x sd2 launch, stages 1 and 2: qwen3-global-ep2sd2s*, ernie4_5_moe-ep2sd2s*,
# deepseek-ep2sd2s*), not over the data-parallel ranks only
EXPERTS_OVER_SHARDING = ("qwen3_moe", "ernie4_5_moe", "deepseek_v3")
# Two degrees together where a test trains them (degree keys, expert_parallel_degree among them when above 1 ->
# the sharding stages proven with them; () when the pair has no sharding): tests/test_long_context.py
# test_sep2_with_tp2_dp2_and_sharding trains Qwen3 and ERNIE 4.5 (PAIR_MODELS) under sep2 x tp2 + SP, cp2 x tp2 + SP,
# sep2 x sharding 2 and cp2 x sharding 2 at stage 2, ERNIE 4.5 under both at stage 1 and Qwen3 under both at stage 3
# (PAIR_SHARDING; each family is allowed the stages its own runs train), DeepSeek-V3 under all four (DEEPSEEK_PAIRS with tp2 + SP
# and packed documents: MLA's heads split by tp, then sep's all-to-all or cp's ring; the sequence-wise loss and the
# bias load summed over the sep group, not over tp; DEEPSEEK_SHARDING with sharding 2 at stage 2, MTP and the bias
# rule on: the bias load summed over sep, then over the sharding ranks);
# DeepSeek-V3 is also trained under pp2 x dp2 with ep2 over the data-parallel ranks, MTP on the last stage
# (tests/test_expert_parallel.py pp2dp2ep2-deepseek; PaddleFormers' layout for it is PP x EP x sharding), and under
# pp2 x sd2 stage 1 with ep2 over the sharding ranks (pp2sd2ep2-deepseek; stage 1 only: fleet's pipeline takes no
# other stage); so are Qwen3-MoE (with global-batch balancing: the picks summed over the stage's dp pair, their
# token count carried to the last stage) and ERNIE 4.5 MoE (its correction bias moved by the bias rule; layer 0 dense
# on stage 0) under pp2 x dp2 x ep2: tests/test_expert_parallel.py pp2dp2ep2-qwen3-global, pp2dp2ep2-ernie; and, one
# pair each (about 2 s of the suite's CPU a run), Qwen3-MoE with global-batch balancing under sep2 x tp2 + SP and ERNIE
# 4.5 MoE with the bias rule under cp2 x tp2 + SP (test_long_context MOE_PAIRS, beside DEEPSEEK_PAIRS: the router
# statistics summed over the sep group, not over tp's ranks, which route the same tokens); both also under
# pp2 x sd2 stage 1 with ep2 over the sharding ranks (the picks summed over the stage's sharding pair; ERNIE's dense
# stage 0 through fleet's own optimizer): pp2sd2ep2-qwen3-global, pp2sd2ep2-ernie in the shared pp2sd2 launch.
_PP_DP_EP = frozenset({"pipeline_parallel_degree", "data_parallel_degree", "expert_parallel_degree"})
_PP_SD_EP = frozenset({"pipeline_parallel_degree", "sharding_parallel_degree", "expert_parallel_degree"})
_SEP_TP, _CP_TP = (frozenset({split, "tensor_parallel_degree"}) for split in ("sep_parallel_degree", "context_parallel_degree"))


def _sequence_pairs(*sharding_stages: int) -> dict:
    """sep2 / cp2 with tp2 (+SP), and with sharding 2 at the stages a run of this family trains (PAIR_SHARDING)."""
    return {_SEP_TP: (), _CP_TP: (), **{frozenset({split, "sharding_parallel_degree"}): sharding_stages
                                       for split in ("sep_parallel_degree", "context_parallel_degree")}}


# Each family's own runs only: the sharding stages beside sep/cp are those its PAIR_SHARDING runs train (Qwen3 2 and 3,
# ERNIE 4.5 1 and 2, DeepSeek-V3 2), not another family's
PROVEN_PAIRS = {"qwen3": _sequence_pairs(2, 3), "ernie4_5": _sequence_pairs(1, 2),
                "qwen3_moe": {_PP_DP_EP: (), _PP_SD_EP: (1,), _SEP_TP: ()},
                "ernie4_5_moe": {_PP_DP_EP: (), _PP_SD_EP: (1,), _CP_TP: ()},
                "deepseek_v3": {**_sequence_pairs(2), _PP_DP_EP: (), _PP_SD_EP: (1,)}}
# Families trained under fleet's interleaved pipeline (virtual_pp_degree 2; the pipeline alone, not DualPipeV):
# tests/test_parallel_parity.py test_pp4_interleaved, INTERLEAVED_SHORT (pp4 x 2 virtual stages, 8 layers, 2 steps);
# DeepSeek-V3 in tests/test_uneven_pipeline.py's pp3 launch (deepseek-pp3vpp2: pp3 x 2 virtual stages, 6 layers one a
# chunk, the MTP block in the last chunk of the last stage; fleet's PipelineParallelWithInterleaveFthenB), beside its
# uneven 1F1B run (deepseek-pp3-1-3-2; check_deepseek_v3 takes uneven stages under 1F1B with the pipeline alone);
# Qwen3-MoE (global-batch balancing on) and ERNIE 4.5 MoE (the bias rule on; its dense layer 0 and MoE layer 3 the two
# chunks of stage 0, sending alike: models/pipeline.py RouterCarry.start) in the same launch (qwen3-moe-pp3vpp2,
# ernie-moe-pp3vpp2: 6 layers one a chunk, 2 steps)
PROVEN_INTERLEAVED = ("qwen3", "ernie4_5", "qwen3_moe", "ernie4_5_moe", "deepseek_v3")


def check_proven_layout(config: ModelConfig, layout: Layout, expert_parallel_degree: int = 1) -> None:
    allowed = PROVEN_DEGREES.get(config.family)
    if allowed is None:
        return
    degrees = {"tensor_parallel_degree": layout.tensor_parallel_degree,
               "pipeline_parallel_degree": layout.pipeline_parallel_degree,
               "sharding_parallel_degree": layout.sharding_degree, "data_parallel_degree": layout.data_parallel_degree,
               "sep_parallel_degree": layout.sep_parallel_degree,
               "context_parallel_degree": layout.context_parallel_degree,
               "expert_parallel_degree": expert_parallel_degree if config.is_moe else 1}  # (dense: refused elsewhere)
    for key, value in degrees.items():
        if value > 1 and key not in allowed:
            raise UsageError(f"{key}: {value} is not proven for {config.family} yet (no test trains it against one "
                             f"process); allowed above 1: {', '.join(allowed) or 'none'}")
    above = [f"{key} {value}" for key, value in degrees.items() if value > 1 and key != "expert_parallel_degree"]
    combination = frozenset(key for key, value in degrees.items() if value > 1)  # (with ep: proven with the experts split)
    pair_stages = PROVEN_PAIRS.get(config.family, {}).get(combination)
    if len(above) > 1 and pair_stages is None:  # each degree is trained alone (ep over dp: test_expert_parallel)
        raise UsageError(f"{' with '.join(above)} together is not proven for {config.family} yet (each is trained "
                         "against one process alone); allowed: one of them above 1")
    over_sharding = config.family in EXPERTS_OVER_SHARDING
    under_pipeline = layout.pipeline_parallel_degree if pair_stages is None else 1  # a proven pair may hold it
    refused = [what for what, degree in (("sharding", 0 if over_sharding else layout.sharding_degree),
                                          ("the pipeline", under_pipeline)) if degree > 1]
    if degrees["expert_parallel_degree"] > 1 and refused:
        raise UsageError(f"expert_parallel_degree: {expert_parallel_degree} with {refused[0]} is not proven for "
                         f"{config.family} yet (no test trains it against one process); allowed: expert parallelism "
                         f"over data-parallel{' or sharding' if over_sharding else ''} ranks only")
    stages = pair_stages or PROVEN_SHARDING_STAGES
    if layout.sharding_degree > 1 and layout.sharding_stage not in stages:
        raise UsageError(f"sharding: stage{layout.sharding_stage} is not proven for {config.family} yet (no test trains "
                         f"it against one process); allowed: {', '.join(f'stage{s}' for s in stages)}")
    interleaved = config.family in PROVEN_INTERLEAVED and not layout.dualpipev and len(above) == 1  # (pp alone)
    if layout.pipeline_parallel_degree > 1 and (layout.virtual_pp_degree > 1 or layout.dualpipev) and not interleaved:
        schedule = "pipeline_parallel_config: use_dualpipev" if layout.dualpipev else \
            f"virtual_pp_degree: {layout.virtual_pp_degree}"
        allowed = " (or the interleaved one with the pipeline alone)" if config.family in PROVEN_INTERLEAVED else ""
        raise UsageError(f"{schedule} is not proven for {config.family} in this layout yet (no test trains it against "
                         f"one process); allowed: the 1F1B schedule (virtual_pp_degree 1){allowed}")


def check_layout_and_model(args: Arguments, world_size: int, device: str
                           ) -> tuple[Layout, ModelConfig, str | None, list[str]]:
    """The layout on world_size processes and the model it trains, both checked (the planner runs this too)."""
    layout = plan_layout(args, world_size)
    config, weights_file, notes = build_model_config(args, layout, device)
    config = with_moe_options(args, config)
    check_model_fits_layout(config, layout)
    check_proven_layout(config, layout, _degree(args.expert_parallel_degree))
    check_mixture_of_experts(args, config, layout)
    check_deepseek_v3(args, config, layout, device)
    check_strategy(args, config, layout)
    check_document_keys(args, config, layout, device)
    return layout, config, weights_file, notes


def check_deepseek_v3(args: Arguments, config: ModelConfig, layout: Layout, device: str = "cpu") -> None:
    """The correction bias's rate, and what DeepSeek-V3's proven layouts (PROVEN_DEGREES, PROVEN_SHARDING_STAGES,
    EXPERTS_OVER_SHARDING: its degrees, each alone) still do not take: uneven pipeline stages beside another degree or
    interleaved, flash attention and core_attn recompute under cp (see below). Recompute
    under the pipeline (full: fleet's PipelineLayer segments, the MTP block among them; full_attn) is proven by
    pp2sd2ep2-deepseek and pp2dp2ep2-deepseek (tests/test_expert_parallel.py)."""
    rate = getattr(args, "moe_bias_update_rate", 0.0)
    if rate and not config.has_correction_bias:
        raise UsageError(f"moe_bias_update_rate: {rate} needs a router with a correction bias (deepseek_v3, ernie4_5_moe; "
                         f"{config.family} has none; allowed: 0)")
    if not (config.uses_mla or config.router_score == "sigmoid" or config.num_nextn_predict_layers):
        return
    others = [f"{key} {value}" for key, value in (
        ("tensor_parallel_degree", layout.tensor_parallel_degree), ("data_parallel_degree", layout.data_parallel_degree),
        ("sharding_parallel_degree", layout.sharding_degree), ("sep_parallel_degree", layout.sep_parallel_degree),
        ("context_parallel_degree", layout.context_parallel_degree)) if value > 1]
    pp = layout.pipeline_parallel_degree
    split = pipeline_split(config.num_hidden_layers, pp, pipeline_chunks(layout), layout.pipeline_layers_per_stage)
    if pp > 1 and len(set(split)) > 1 and (layout.virtual_pp_degree > 1 or (others and layout.pipeline_layers_per_stage)):
        # uneven stages (MTP in the last one) are trained under 1F1B with the pipeline alone (tests/
        # test_uneven_pipeline.py deepseek-pp3-1-3-2: fleet's list of boundaries), not interleaved (models/pipeline.py
        # ChunkBoundaries); an explicit split not beside another degree either (fleet's uniform split, PaddleNLP's
        # fallback for layers that do not divide, stays as before)
        key = "pipeline_layers_per_stage" if layout.pipeline_layers_per_stage else "num_hidden_layers"
        value = list(layout.pipeline_layers_per_stage) if layout.pipeline_layers_per_stage else config.num_hidden_layers
        what = others[0] if others else f"virtual_pp_degree {layout.virtual_pp_degree}"
        raise UsageError(f"{key}: {value} gives uneven stages {split}, which with {what} are not supported for "
                         f"{config.family} yet (proven under 1F1B with the pipeline alone); allowed: an even split")
    # Flash attention (models/mla.py flash_attention: v padded to the q/k head dim, as PaddleFormers) and core_attn
    # recompute, alone and together, with and without packed documents, are proven in one process, flash also
    # under tp2 + SP (tests/test_parallel_parity.py check_deepseek_tp2) (tests/
    # test_deepseek_v3.py test_flash_attention_gives_the_plain_paths_logits_loss_and_gradients, test_core_attention_
    # recompute_gives_the_same_loss_and_gradients); the layouts run the same layer. Under cp the ring over latent
    # attention keeps its plain blocks (unequal head dims), so flash there is refused rather than ignored.
    flash = args.use_flash_attention and (device == "gpu" or kernel_standins_requested(device))  # the branch runs
    if flash and config.uses_mla and layout.context_parallel_degree > 1:
        raise UsageError(f"use_flash_attention: true with context_parallel_degree {layout.context_parallel_degree} is "
                         f"not supported for {config.family} (the ring over latent attention has plain blocks; "
                         "allowed: false)")
    if (config.uses_mla and args.recompute and args.recompute_granularity == "core_attn"
            and layout.context_parallel_degree > 1):
        # models/mla.py recomputes its own core paths, not the ring (the decoder's Attention recomputes that too)
        raise UsageError(f"recompute_granularity: core_attn with context_parallel_degree "
                         f"{layout.context_parallel_degree} is not supported for {config.family} (allowed: full, "
                         "full_attn)")


def check_document_keys(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> None:
    """reset_attention_mask / eod_mask_loss: the end-of-document token inside the vocabulary, and a layout
    and attention path that honour document masks (the plain path in one process, for now)."""
    if not (args.reset_attention_mask or args.eod_mask_loss):
        return
    from llm_pretrain.data.documents import eod_token_of

    eod = eod_token_of(args.eod_token_id, args.tokenizer_path)
    if args.eod_token_id is not None and args.eod_token_id >= config.vocab_size:
        raise UsageError(f"eod_token_id: {args.eod_token_id} is outside the model's vocabulary (0 to "
                         f"{config.vocab_size - 1})")
    if args.eod_mask_loss and eod is None:
        raise UsageError(f"eod_mask_loss: the tokenizer {args.tokenizer_path} has no end-of-text token; set "
                         "eod_token_id")
    if not args.reset_attention_mask:
        return
    if args.use_flash_attention and (device == "gpu" or kernel_standins_requested(device)):  # the flash branch runs
        # Documents go to Paddle's flashmask_attention as row indices (models/decoder.py
        # Attention.flashmask_attention; under cp each ring block with its own, models/ring_attention.py
        # FlashMaskBlocks), which takes no additive bias.
        if config.position_embedding == "alibi":
            raise UsageError(f"reset_attention_mask with use_flash_attention is not supported for {config.family} "
                             "(ALiBi needs an additive bias, flashmask_attention takes none); set "
                             "use_flash_attention false")
    # Data parallelism, sharding and tensor parallelism (with sequence parallelism: attention sees whole
    # sequences of its heads) run the same attention with the same mask; under the pipeline the document ids
    # travel with the micro-batch from stage to stage (models/pipeline.py) (tests/test_documents.py, shared
    # launches dp2, tp2, sd2, pp2); under sep the whole sequence's mask fits the heads after the all-to-all,
    # under cp the ring masks each block (models/ring_attention.py DocumentBlocks; flash blocks with FlashMask's
    # row indices) (tests/test_long_context.py, the sep2/cp2 launch); the pipeline over sep or cp passes the
    # whole sequences' ids between its stages, each stage's attention splitting them as sep / cp alone
    # (tests/test_long_context.py, the pp2 launch: pp2 x cp2, pp2 x sep2).
    # The interleaved schedule passes the same (hidden, ids) tuples between its chunks (tests/test_documents.py,
    # the shared pp4 launch); DualPipeV's own p2p is not proven with them (unreachable in a build without
    # deep_ep: DualPipeV itself is refused first, check_dualpipev).
    if layout.pipeline_parallel_degree > 1 and layout.dualpipev:
        raise UsageError("reset_attention_mask with dualpipev is not supported yet (proven under 1F1B and the "
                         "interleaved schedule); use virtual_pp_degree instead")
    if layout.pipeline_parallel_degree > 1 and (layout.sep_parallel_degree > 1 or layout.context_parallel_degree > 1):
        # What the pp2 launch trains: 1F1B on the plain attention path; FlashMask over sep/cp and the interleaved
        # schedule over sep/cp are each proven without the other, not together.
        flash = args.use_flash_attention and (device == "gpu" or kernel_standins_requested(device))
        if flash or layout.virtual_pp_degree > 1:
            key, allowed = (("use_flash_attention", "false") if flash else ("virtual_pp_degree", "1"))
            raise UsageError(f"reset_attention_mask with the pipeline over sep or cp and {key} is not proven yet "
                             "(trained: pp2 x sep2 and pp2 x cp2, 1F1B, the plain attention path, tests/"
                             f"test_long_context.py); allowed: {key} {allowed}")


def build_model_config(args: Arguments, layout: Layout, device: str) -> tuple[ModelConfig, str | None, list[str]]:
    """The architecture from model_name_or_path with the run's overrides and runtime options."""
    config, weights_file = resolve_model(args.model_name_or_path)
    notes = []
    continue_training = args.continue_training
    if weights_file and weights_file.endswith((".safetensors", ".safetensors.index.json")) and not continue_training:
        # A Hugging Face directory with weights is a checkpoint to continue from (as PaddleFormers trains it)
        continue_training = True
        notes.append(f"continue_training: implied: {args.model_name_or_path} is a Hugging Face directory with "
                     f"weights ({os.path.basename(weights_file)}); training continues from them")
    overrides = {key: getattr(args, key) for key in (
        "num_hidden_layers", "initializer_range", "hidden_dropout_prob", "attention_probs_dropout_prob",
        "fuse_attention_qkv", "fuse_attention_ffn") if getattr(args, key) is not None}
    config = config.replace(**overrides)
    if weights_file and weights_file.endswith((".safetensors", ".safetensors.index.json")):
        # every tensor there (and used), from the file headers alone
        raw = read_config_json(os.path.join(args.model_name_or_path, "config.json"))
        check_hf_weights(config, raw, weights_file)
        if raw.get("num_nextn_predict_layers") and not config.num_nextn_predict_layers:
            notes.append(f"num_nextn_predict_layers: {raw['num_nextn_predict_layers']} in {args.model_name_or_path}"
                         f"/config.json, but its weights hold no MTP layer (transformers' DeepseekV3ForCausalLM has "
                         "none): trained without multi-token prediction")
    if not continue_training:
        # As PaddleNLP: room for the sequence length, and a vocabulary covering the tokenizer's.
        config.max_position_embeddings = max(config.max_position_embeddings, args.max_seq_length)
        tokenizer_vocab = _local_tokenizer_vocab_size(args.tokenizer_path)
        if tokenizer_vocab is not None:
            config.vocab_size = max(config.vocab_size, ((tokenizer_vocab - 1) // 128 + 1) * 128)
    if args.max_seq_length > config.max_position_embeddings:
        # As PaddleNLP's run_pretrain.py with continue_training: the checkpoint's max_position_embeddings
        # stays and rotary tables (ALiBi biases) are computed for the longer sequence; a learned position
        # table has no rows beyond it.
        if config.position_embedding == "learned":
            raise UsageError(f"max_seq_length: {args.max_seq_length} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings} (learned positions have no rows beyond it)")
        notes.append(f"max_seq_length {args.max_seq_length} exceeds the model's max_position_embeddings "
                     f"{config.max_position_embeddings}: its {config.position_embedding} positions are extended "
                     "beyond the length it was trained on (as PaddleNLP does with continue_training)")
    gpu = device == "gpu"
    # LLM_PRETRAIN_KERNEL_STANDINS=1 on CPU: the GPU kernels' branches run through CPU stand-ins
    # (llm_pretrain/cpu/kernel_standins.py), so the options are kept as on a GPU.
    kernels = gpu or kernel_standins_requested(device)
    config = config.replace(
        seq_length=args.max_seq_length,
        tensor_parallel_degree=layout.tensor_parallel_degree,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        recompute_granularity=args.recompute_granularity,
        no_recompute_layers=list(args.no_recompute_layers or []),
        pp_recompute_interval=args.pp_recompute_interval,
        use_flash_attention=args.use_flash_attention and kernels,
        use_fused_rms_norm=args.use_fused_rms_norm and kernels,
        use_fused_rope=args.use_fused_rope and kernels,
        use_fused_swiglu=kernels,  # as PaddleNLP's LLaMA on GPU (the CPU build has the kernel too: stand-in runs)
        use_fast_layer_norm=args.use_fast_layer_norm and kernels and config.norm_type == "layernorm",
        reset_position_ids=args.reset_position_ids,
    )
    if config.use_fast_layer_norm and gpu and importlib.util.find_spec("fast_ln") is None:
        raise UsageError("use_fast_layer_norm: needs the fast_ln package (PaddleNLP's external CUDA ops, which "
                         "its GPT imports for this option), and it is not installed; set use_fast_layer_norm false")
    if args.use_fast_layer_norm and kernels and config.norm_type != "layernorm":
        notes.append("use_fast_layer_norm: has no effect on this model (it normalizes with RMSNorm; "
                     "use_fused_rms_norm is its fused kernel)")
    if continue_training and weights_file is None:
        notes.append(f"continue_training: {args.model_name_or_path} has no local weights "
                     "(model_state.pdparams or model.safetensors); starting from a random initialization")
    return config, (weights_file if continue_training else None), notes


def _local_tokenizer_vocab_size(path: str) -> int | None:
    if not os.path.exists(path):
        return None  # a hub name such as facebook/llama-7b: the model's vocabulary is used
    from llm_pretrain.data.tokenizer import load_tokenizer

    return load_tokenizer(path).vocab_size
