"""The pretraining run, top to bottom.

    check everything that can be wrong   (arguments, layout, model, data, output_dir)
    fleet.init                           (only for several processes)
    build model, optimizer, data         (weights identical at every parallel layout)
    resume from the newest checkpoint    (if any)
    for each step: forward/backward over the micro-batches, clip, AdamW step,
                   log, evaluate, save

All user mistakes are found before fleet.init and reported as one-line
UsageErrors (exit code 2).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import paddle

from llm_pretrain import checkpoint as ckpt
from llm_pretrain.arguments import Arguments, arguments_to_dict
from llm_pretrain.data import build_pretraining_datasets, check_data_inputs
from llm_pretrain.distributed import (
    Layout, all_reduce_max, all_reduce_mean_over_replicas, barrier, init_distributed,
    launcher_world_size, parallel_config_settings, plan_layout, record_grad_norm, select_device, wrap_for_training,
)
from llm_pretrain.errors import UsageError
from llm_pretrain.flops import training_flops_per_token
from llm_pretrain.metrics import MetricsLog, format_summary, format_train_line, peak_memory_mb, summarize
from llm_pretrain.optim import build_optimizer, build_schedule
from models.config import ModelConfig
from models.decoder import CausalLM
from models.registry import resolve_model
from models.weights import init_weights, load_full_weights

GPU_ONLY_OPTIONS = {
    "bf16": "Paddle's CPU build has no bfloat16 kernels",
    "fp16": "Paddle's CPU build has no float16 kernels",
    "use_flash_attention": "flash attention is a GPU kernel",
    "use_fused_rms_norm": "the fused RMSNorm is a GPU kernel",
    "use_fused_rope": "the fused rotary embedding is a GPU kernel",
    "use_fast_layer_norm": "the fast LayerNorm is a GPU kernel",
}


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- checks and setup
def gpu_only_warnings(args: Arguments, device: str) -> list[str]:
    """On CPU, GPU-only options run the plain float32 path; say so once each."""
    if device == "gpu":
        return []
    return [f"{key} has no effect on CPU ({why}); training in plain float32"
            for key, why in GPU_ONLY_OPTIONS.items() if getattr(args, key)]


def build_model_config(args: Arguments, layout: Layout, device: str) -> tuple[ModelConfig, str | None, list[str]]:
    """The architecture from model_name_or_path with the run's overrides and runtime options."""
    config, weights_file = resolve_model(args.model_name_or_path)
    notes = []
    overrides = {key: getattr(args, key) for key in (
        "num_hidden_layers", "initializer_range", "hidden_dropout_prob", "attention_probs_dropout_prob",
        "fuse_attention_qkv", "fuse_attention_ffn") if getattr(args, key) is not None}
    config = config.replace(**overrides)
    if not args.continue_training:
        # As PaddleNLP: room for the sequence length, and a vocabulary covering the tokenizer's.
        config.max_position_embeddings = max(config.max_position_embeddings, args.max_seq_length)
        tokenizer_vocab = _local_tokenizer_vocab_size(args.tokenizer_path)
        if tokenizer_vocab is not None:
            config.vocab_size = max(config.vocab_size, ((tokenizer_vocab - 1) // 128 + 1) * 128)
    if args.max_seq_length > config.max_position_embeddings:
        raise UsageError(f"max_seq_length: {args.max_seq_length} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    gpu = device == "gpu"
    config = config.replace(
        seq_length=args.max_seq_length,
        tensor_parallel_degree=layout.tensor_parallel_degree,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        recompute_granularity=args.recompute_granularity,
        no_recompute_layers=list(args.no_recompute_layers or []),
        pp_recompute_interval=args.pp_recompute_interval,
        use_flash_attention=args.use_flash_attention and gpu,
        use_fused_rms_norm=args.use_fused_rms_norm and gpu,
        use_fused_rope=args.use_fused_rope and gpu,
    )
    if args.continue_training and weights_file is None:
        notes.append(f"continue_training: {args.model_name_or_path} has no local weights "
                     "(model_state.pdparams); starting from a random initialization")
    return config, (weights_file if args.continue_training else None), notes


def _local_tokenizer_vocab_size(path: str) -> int | None:
    if not os.path.exists(path):
        return None  # a hub name such as facebook/llama-7b: the model's vocabulary is used
    from llm_pretrain.tokenizer import load_tokenizer

    return load_tokenizer(path).vocab_size


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


def check_strategy(args: Arguments, config: ModelConfig, layout: Layout) -> None:
    """Combinations of degrees and options that fleet cannot run (checked before fleet.init)."""
    tp, pp, vpp = layout.tensor_parallel_degree, layout.pipeline_parallel_degree, layout.virtual_pp_degree
    if pp * vpp > 1 and config.num_hidden_layers % (pp * vpp):
        raise UsageError(f"pipeline_parallel_degree {pp} x virtual_pp_degree {vpp}: num_hidden_layers "
                         f"{config.num_hidden_layers} must be divisible by {pp * vpp}")
    if vpp > 1 and pp <= 2:
        raise UsageError(f"virtual_pp_degree: {vpp} needs pipeline_parallel_degree > 2 (Paddle's interleaved "
                         f"schedule), got pipeline_parallel_degree {pp}")
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
    if pp > 1 and args.do_eval and args.per_device_eval_batch_size != args.per_device_train_batch_size:
        raise UsageError(f"per_device_eval_batch_size: {args.per_device_eval_batch_size} must equal "
                         f"per_device_train_batch_size {args.per_device_train_batch_size} under pipeline "
                         "parallelism (the pipeline's micro-batch size is fixed)")
    parallel_config_settings(args)


def resolve_resume(args: Arguments) -> str | None:
    """The checkpoint to resume from: resume_from_checkpoint, else the newest complete one in output_dir."""
    if args.resume_from_checkpoint:
        if not ckpt.is_complete(args.resume_from_checkpoint):
            raise UsageError(f"resume_from_checkpoint: {args.resume_from_checkpoint} is not a complete checkpoint "
                             f"(it needs {ckpt.TRAINER_STATE} and {ckpt.COMPLETE_MARKER})")
        return args.resume_from_checkpoint
    if args.overwrite_output_dir:
        return None
    return ckpt.latest_checkpoint(args.output_dir)


def check_checkpoint_matches(path: str, config: ModelConfig, args: Arguments, layout: Layout) -> None:
    """The checkpoint is of this model; any layout may resume it (llm_pretrain/dist_checkpoint.py)."""
    from llm_pretrain.dist_checkpoint import check_resumable

    check_resumable(path, ckpt.read_trainer_state(path), config.architecture_dict(), args.max_seq_length,
                    layout_summary(layout))


def layout_summary(layout: Layout) -> dict:
    return {key: getattr(layout, key) for key in (
        "world_size", "data_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
        "sharding_degree", "sharding_stage", "virtual_pp_degree")}


def strategy_name(tensor_parallel_degree: int = 1, pipeline_parallel_degree: int = 1, sharding_degree: int = 1,
                  sharding_stage: int = 0, virtual_pp_degree: int = 1, data_parallel_degree: int | None = None) -> str:
    """PaddleNLP-style strategy name: pp4tp2sd2_stage1, tp2sd4_stage2, sd8_stage2, tp2, dp8.

    Order: pipeline (with virtual stages), tensor, data, sharding. Argument files don't know the
    world size, so their names leave data parallelism out (data_parallel_degree None).
    """
    name = ""
    if pipeline_parallel_degree > 1:
        name += f"pp{pipeline_parallel_degree}"
        if virtual_pp_degree > 1:
            name += f"vpp{virtual_pp_degree}"
    if tensor_parallel_degree > 1:
        name += f"tp{tensor_parallel_degree}"
    if data_parallel_degree is not None and (data_parallel_degree > 1 or not name and not sharding_stage):
        name += f"dp{data_parallel_degree}"
    if sharding_stage:
        name += f"sd{sharding_degree}_stage{sharding_stage}"
    return name or "dp"


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


# ----------------------------------------------------------------------------- batches
@dataclass
class BatchPlan:
    """Which samples each step reads: the global batch is split over data replicas, then micro-batches."""

    micro_batch_size: int
    accumulation_steps: int
    data_replicas: int
    data_replica_rank: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.data_replicas

    def micro_batches(self, dataset, first_sample: int, vocab_size: int):
        """This replica's micro-batches of the global batch that starts at first_sample."""
        per_replica = self.micro_batch_size * self.accumulation_steps
        start = first_sample + self.data_replica_rank * per_replica
        tokens = np.stack([dataset[i] for i in range(start, start + per_replica)]).astype("int64")
        if tokens.max() >= vocab_size:
            raise UsageError(f"input_dir: token id {tokens.max()} in the data is not below the model's vocab_size "
                             f"{vocab_size}; was the data prepared with another tokenizer?")
        for i in range(self.accumulation_steps):
            chunk = tokens[i * self.micro_batch_size:(i + 1) * self.micro_batch_size]
            yield paddle.to_tensor(chunk[:, :-1]), paddle.to_tensor(chunk[:, 1:])


# ----------------------------------------------------------------------------- precision
class Precision:
    """AMP on GPU (bf16/fp16, O1 autocast or O2 half weights with float32 master weights); fp32 on CPU."""

    def __init__(self, args: Arguments, device: str):
        self.dtype = ("bfloat16" if args.bf16 else "float16" if args.fp16 else None) if device == "gpu" else None
        self.level = args.fp16_opt_level
        self.args = args
        self.scaler = None

    def prepare(self, model, optimizer):
        if self.dtype is None:
            return model, optimizer
        if self.level == "O2":
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.dtype,
                                                   master_weight=True, master_grad=self.args.amp_master_grad)
        if self.dtype == "float16":
            self.scaler = paddle.amp.GradScaler(init_loss_scaling=self.args.scale_loss)
        return model, optimizer

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(True, level=self.level, dtype=self.dtype)

    def backward(self, loss) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()


def device_name(device: str) -> str:
    """The accelerator's name for reports (the peak-TFLOPs lookup uses it): "NVIDIA A100-SXM4-80GB", "cpu"."""
    return paddle.device.cuda.get_device_name(0) if device == "gpu" else "cpu"


# ----------------------------------------------------------------------------- steps
def global_grad_norm(parameters) -> float:
    # paddle.square, not `** 2`: on CPU the pow kernel is ~40x slower (55 ms vs 1.3 ms a step for 3M
    # parameters, benchmarks/cpu_speed.md), and this norm is extra work PaddleNLP's Trainer does not do.
    squares = [paddle.sum(paddle.square(p.grad.astype("float32"))) for p in parameters if p.grad is not None]
    return math.sqrt(float(paddle.add_n(squares))) if squares else 0.0


def scalar(tensor) -> float:
    """A one-element tensor as a float (fleet's pipeline returns losses of shape [1])."""
    return float(tensor.numpy().reshape(-1)[0])


def train_step(model, optimizer, schedule, precision: Precision, micro_batches, parameters,
               clip_grad_norm=None) -> tuple[float, float | None]:
    """Forward/backward over the micro-batches, then one optimizer step. Returns (mean loss, grad norm).

    The grad norm is the global norm before clipping: computed here in a single process, read
    from fleet's clip in a distributed run (None where neither is available)."""
    micro_batches = list(micro_batches)
    if is_pipeline(model):
        # fleet runs the 1F1B / interleaved schedule over the micro-batches and steps the optimizer.
        inputs = paddle.concat([x for x, _ in micro_batches])
        labels = paddle.concat([y for _, y in micro_batches])
        loss = scalar(model.train_batch([inputs, labels], optimizer, scaler=precision.scaler))
        schedule.step()
        return loss, clip_grad_norm() if clip_grad_norm else None
    total_loss = paddle.zeros([], dtype="float32")
    for i, (input_ids, labels) in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        # Data parallelism all-reduces gradients once, after the last micro-batch.
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with precision.autocast():
                loss = model(input_ids, labels)
            precision.backward(loss / len(micro_batches))
        total_loss += loss.detach().astype("float32")
    grad_norm = None if clip_grad_norm else global_grad_norm(parameters)
    precision.step(optimizer)
    optimizer.clear_grad()
    schedule.step()
    if clip_grad_norm:
        grad_norm = clip_grad_norm()
    return float(total_loss) / len(micro_batches), grad_norm


def is_pipeline(model) -> bool:
    return hasattr(model, "train_batch")


@paddle.no_grad()
def evaluate(model, dataset, plan: BatchPlan, iterations: int, vocab_size: int, layout: Layout) -> float:
    """Mean loss over the first `iterations` global batches of a split (the same samples every time)."""
    model.eval()
    losses = []
    for i in range(iterations):
        micro_batches = list(plan.micro_batches(dataset, i * plan.global_batch_size, vocab_size))
        if is_pipeline(model):
            inputs = paddle.concat([x for x, _ in micro_batches])
            labels = paddle.concat([y for _, y in micro_batches])
            losses.append(scalar(model.eval_batch([inputs, labels], compute_loss=True)))
        else:
            losses += [float(model(input_ids, labels)) for input_ids, labels in micro_batches]
    model.train()
    return all_reduce_mean_over_replicas(sum(losses) / len(losses), layout)


def build_model(config: ModelConfig, layout: Layout):
    if layout.pipeline_parallel_degree > 1:
        from models.pipeline import CausalLMPipeline

        return CausalLMPipeline(config, layout.virtual_pp_degree, config.pp_recompute_interval)
    return CausalLM(config)


# ----------------------------------------------------------------------------- the run
def train(args: Arguments, argument_warnings: list[str], args_file: str | None = None) -> dict:
    # 1. Everything that can be wrong, before any expensive work.
    device = select_device(args)
    layout = plan_layout(args, launcher_world_size())
    config, weights_file, model_notes = build_model_config(args, layout, device)
    check_model_fits_layout(config, layout)
    check_strategy(args, config, layout)
    check_data_inputs(args.input_dir, args.split)
    resume_from = resolve_resume(args) if args.do_train else None
    if resume_from:
        check_checkpoint_matches(resume_from, config, args, layout)

    # 2. Processes and groups.
    layout = init_distributed(layout, device, args)
    if layout.is_main:
        for message in argument_warnings + gpu_only_warnings(args, device) + model_notes:
            warn(message)
    set_seed(args.seed)

    # 3. Model, optimizer, data.
    model = build_model(config, layout)
    if weights_file:
        load_full_weights(model, config, paddle.load(weights_file), weights_file)
    else:
        init_weights(model, config, args.seed)
    schedule = build_schedule(args)
    optimizer = build_optimizer(args, model, schedule)
    precision = Precision(args, device)
    model, optimizer = precision.prepare(model, optimizer)
    unwrapped_model = model
    parameters = [p for _, p in unwrapped_model.canonical_named_parameters()]
    model, optimizer = wrap_for_training(model, optimizer, layout, args.gradient_accumulation_steps)
    clip_grad_norm = record_grad_norm(optimizer) if layout.distributed else None

    train_plan = BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                           layout.data_replicas, layout.data_replica_rank)
    # The pipeline evaluates whole pipeline batches (its micro-batch size and count are fixed).
    eval_plan = (BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps, layout.data_replicas,
                           layout.data_replica_rank) if is_pipeline(model)
                 else BatchPlan(args.per_device_eval_batch_size, 1, layout.data_replicas, layout.data_replica_rank))
    eval_samples = args.eval_iters * eval_plan.global_batch_size
    num_samples = (args.max_steps * train_plan.global_batch_size if args.do_train else 0,
                   eval_samples if args.do_eval else 0, eval_samples if args.do_predict else 0)
    datasets = _build_datasets_rank0_first(args, num_samples, layout)
    train_data, valid_data, test_data = datasets

    # 4. Resume.
    start_step, consumed_samples = 0, 0
    if resume_from:
        state = ckpt.load_checkpoint(resume_from, unwrapped_model, optimizer, layout)
        start_step, consumed_samples = state["global_step"], state["consumed_samples"]

    metrics = MetricsLog(args.output_dir, enabled=layout.is_main)
    flops_per_token = training_flops_per_token(config, args.max_seq_length)
    global_tokens_per_step = train_plan.global_batch_size * args.max_seq_length
    name = strategy_name(layout.tensor_parallel_degree, layout.pipeline_parallel_degree, layout.sharding_degree,
                         layout.sharding_stage, layout.virtual_pp_degree, layout.data_parallel_degree)
    metrics.write({
        "event": "run", "model": args.model_name_or_path, "family": config.family, "args_file": args_file,
        "strategy": name, "layout": layout_summary(layout), "seq_length": args.max_seq_length,
        "global_batch_size": train_plan.global_batch_size, "max_steps": args.max_steps, "start_step": start_step,
        "device": device, "device_name": device_name(device),
        "dtype": {"bfloat16": "bf16", "float16": "fp16"}.get(precision.dtype, "fp32"),
        "paddle_version": paddle.__version__, "paddle_commit": paddle.version.commit,
        "flops_per_token": flops_per_token, "model_config": config.architecture_dict(),
    })
    if layout.is_main:
        resumed = f", resumed from {resume_from}" if resume_from else ""
        print(f"training {args.model_name_or_path} ({config.family}, {sum(int(np.prod(p.shape)) for p in parameters):,}"
              f" parameters on rank 0) with {name} on {layout.world_size} {device} process(es), "
              f"global batch {train_plan.global_batch_size} x {args.max_seq_length} tokens{resumed}", flush=True)

    # 5. The loop.
    step_records: list[dict] = []
    interval_losses, interval_norms, interval_time = [], [], 0.0
    progress = _progress_bar(args, layout, start_step)
    step = start_step
    while args.do_train and step < args.max_steps:
        learning_rate = optimizer.get_lr()
        step_start = time.perf_counter()
        batches = train_plan.micro_batches(train_data, consumed_samples, config.vocab_size)
        loss, grad_norm = train_step(model, optimizer, schedule, precision, batches, parameters, clip_grad_norm)
        if device == "gpu":
            paddle.device.synchronize()
        interval_time += time.perf_counter() - step_start
        step += 1
        consumed_samples += train_plan.global_batch_size
        interval_losses.append(loss)
        interval_norms.append(grad_norm)
        progress.update(1)

        if step % args.logging_steps == 0 or step == args.max_steps:
            steps_in_interval = len(interval_losses)
            tokens_per_card_per_sec = global_tokens_per_step * steps_in_interval / layout.world_size / interval_time
            record = {
                "event": "train", "step": step,
                "loss": all_reduce_mean_over_replicas(sum(interval_losses) / steps_in_interval, layout),
                "learning_rate": learning_rate,
                "grad_norm": None if None in interval_norms else sum(interval_norms) / steps_in_interval,
                "tokens_per_card_per_sec": tokens_per_card_per_sec,
                "step_time_s": interval_time / steps_in_interval,
                "global_tokens_per_step": global_tokens_per_step,
                "tflops_per_card": flops_per_token * tokens_per_card_per_sec / 1e12,
                "consumed_samples": consumed_samples,
                **{key: all_reduce_max(value, layout) for key, value in peak_memory_mb(device).items()},
            }
            step_records.append(dict(record))
            metrics.write(record)
            if layout.is_main:
                progress.write(format_train_line(step_records[-1], args.max_steps))
            interval_losses, interval_norms, interval_time = [], [], 0.0

        if args.do_eval and valid_data is not None and step % args.effective_eval_steps == 0:
            _log_evaluation(model, valid_data, "valid", step, eval_plan, args, config, layout, metrics, progress)

        exiting = bool(args.exit_interval) and step % args.exit_interval == 0 and step < args.max_steps
        if (args.save_steps and (step % args.save_steps == 0 or step == args.max_steps)) or exiting:
            trainer_state = {"global_step": step, "consumed_samples": consumed_samples,
                             "layout": layout_summary(layout), "args": arguments_to_dict(args),
                             "model_config": config.architecture_dict()}
            ckpt.save_checkpoint(args.output_dir, step, unwrapped_model, optimizer, trainer_state, layout,
                                 args.save_total_limit)
        if exiting:
            if layout.is_main:
                progress.write(f"stopping after step {step} (exit_interval); run the same command again to resume")
            break
    progress.close()

    if args.do_predict and test_data is not None:
        _log_evaluation(model, test_data, "test", step, eval_plan, args, config, layout, metrics, progress)

    summary = summarize(step_records, warmup_steps=min(3, len(step_records) // 5) * args.logging_steps + start_step)
    metrics.write({"event": "summary", **summary})
    metrics.close()
    if layout.is_main and step_records:
        print(format_summary(summary), flush=True)
    return summary


def _build_datasets_rank0_first(args: Arguments, num_samples, layout: Layout):
    """The first process on each node builds (and caches) the sample indices; the others then load them."""
    kwargs = dict(input_dir=args.input_dir, split=args.split, seq_length=args.max_seq_length, seed=args.seed,
                  num_samples=num_samples, data_cache=args.data_cache, skip_warmup=args.skip_warmup)
    datasets = build_pretraining_datasets(**kwargs) if layout.local_rank == 0 else None
    barrier(layout)
    return datasets if datasets is not None else build_pretraining_datasets(**kwargs)


def _log_evaluation(model, dataset, split, step, plan, args, config, layout, metrics, progress):
    loss = evaluate(model, dataset, plan, args.eval_iters, config.vocab_size, layout)
    record = {"event": "eval", "split": split, "step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
    metrics.write(dict(record))
    if layout.is_main:
        progress.write(f"eval {split} at step {step} | loss {loss:.6f} | ppl {record['ppl']:.3f}")


class _NoProgress:
    def update(self, n):
        pass

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def _progress_bar(args: Arguments, layout: Layout, start_step: int):
    disabled = args.disable_tqdm if args.disable_tqdm is not None else not sys.stderr.isatty()
    if disabled or not layout.is_main:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=args.max_steps, initial=start_step, desc="train", dynamic_ncols=True)
