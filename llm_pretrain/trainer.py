"""The pretraining run, top to bottom.

    check everything that can be wrong   (arguments, layout, model, data integrity, output_dir lock,
                                          which checkpoint is intact)
    fleet.init                           (only for several processes)
    build model, optimizer, data         (weights identical at every parallel layout)
    resume from the newest intact checkpoint every rank agrees on (Checkpointer)
    for each step: forward/backward over the micro-batches, one agreed flag (non-finite? stop
                   requested?), clip, AdamW step, log (MetricsLogger), evaluate, save (Checkpointer)

All user mistakes are found before fleet.init and reported as one-line
UsageErrors (exit code 2); divergence is exit code 3, SIGTERM/SIGINT a checkpoint and exit 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np
import paddle

from llm_pretrain import checkpoint as ckpt
from llm_pretrain.checkpoint import Checkpointer, OutputDirLock
from llm_pretrain.arguments import Arguments, arguments_to_dict
from llm_pretrain.data import build_pretraining_datasets, check_data_inputs
from llm_pretrain.distributed import (
    all_reduce_mean_over_replicas, barrier, init_distributed, launcher_world_size, record_grad_norm, select_device,
    wrap_for_training,
)
from llm_pretrain.data.integrity import check_data_integrity, damaged_sample_index_files
from llm_pretrain.errors import DivergenceError, RunError, UsageError
from llm_pretrain.flops import training_flops_per_token
# The layout checks live in llm_pretrain/layout.py (the planner uses the same); imported here for train()
# and for existing callers.
from llm_pretrain.layout import (  # noqa: F401
    Layout, check_model_fits_layout, check_strategy, pipeline_chunks, pipeline_eval_micro_batches, pipeline_split,
    plan_layout, predict_iterations, strategy_name,
)
from llm_pretrain.metrics import MetricsLogger, reset_peak_memory, scalar
from llm_pretrain.optim import build_optimizer, build_schedule
from llm_pretrain import run_record
from llm_pretrain.replica_check import check_replicas
from llm_pretrain.precision import Precision
from llm_pretrain.run_control import Heartbeat, StopRequest
from models.config import ModelConfig
from models.decoder import CausalLM
from models.registry import resolve_model
from models.weights import init_weights, load_weights_file

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
        use_fused_swiglu=gpu,  # as PaddleNLP's LLaMA, whenever the kernel exists (GPU)
        use_fast_layer_norm=args.use_fast_layer_norm and gpu and config.norm_type == "layernorm",
    )
    if config.use_fast_layer_norm and importlib.util.find_spec("fast_ln") is None:
        raise UsageError("use_fast_layer_norm: needs the fast_ln package (PaddleNLP's external CUDA ops, which "
                         "its GPT imports for this option), and it is not installed; set use_fast_layer_norm false")
    if args.use_fast_layer_norm and gpu and config.norm_type != "layernorm":
        notes.append("use_fast_layer_norm: has no effect on this model (it normalizes with RMSNorm; "
                     "use_fused_rms_norm is its fused kernel)")
    if args.continue_training and weights_file is None:
        notes.append(f"continue_training: {args.model_name_or_path} has no local weights "
                     "(model_state.pdparams); starting from a random initialization")
    return config, (weights_file if args.continue_training else None), notes


def _local_tokenizer_vocab_size(path: str) -> int | None:
    if not os.path.exists(path):
        return None  # a hub name such as facebook/llama-7b: the model's vocabulary is used
    from llm_pretrain.tokenizer import load_tokenizer

    return load_tokenizer(path).vocab_size


def looks_like_a_path(name: str) -> bool:
    """A local path rather than a hub/registry name such as "facebook/llama-7b" or "llama-tiny"."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
            or name.endswith((".model", ".json", ".txt")))


# Above this the run is refused even when no memory estimate is possible (the longest contexts
# pretrained today are 128K-1M tokens; PaddleNLP's presets stop at 32K).
MAX_SEQ_LENGTH_CEILING = 1 << 20


def device_memory_bytes(device: str) -> int:
    if device == "gpu":
        return paddle.device.cuda.get_device_properties().total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_floor_bytes(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> int:
    """A lower bound of one micro-batch's activation memory: the float32 logits (vocab split over
    tensor-parallel ranks) and, without flash attention, one layer's attention probabilities.
    Deliberately an underestimate: it only refuses lengths that cannot possibly fit."""
    batch, seq = args.per_device_train_batch_size, args.max_seq_length
    tp = layout.tensor_parallel_degree
    logits = batch * seq * config.vocab_size // tp * 4
    flash = args.use_flash_attention and device == "gpu"
    attention = 0 if flash else batch * config.num_attention_heads // tp * seq * seq * 4
    return logits + attention


def check_startup(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> None:
    """Values that would fail late (after the model and data are built, or in the OOM killer)."""
    from llm_pretrain.data import parse_split

    tokenizer = args.tokenizer_path
    if not os.path.exists(tokenizer) and looks_like_a_path(tokenizer):
        raise UsageError(f"tokenizer_name_or_path: {tokenizer} does not exist (a local tokenizer directory or file "
                         "is expected; names like facebook/llama-7b select the architecture's vocabulary)")
    if args.do_train and parse_split(args.split)[0] == 0:
        raise UsageError(f"split: '{args.split}' gives training no documents; give the first (train) share a "
                         "positive value, e.g. '949,50,1'")
    if args.skip_nan_inf_steps and layout.pipeline_parallel_degree > 1:
        raise UsageError("skip_nan_inf_steps: not available with pipeline_parallel_degree > 1 (fleet's train_batch "
                         "applies the optimizer step before the loss and gradient norm can be checked)")
    if args.max_seq_length > MAX_SEQ_LENGTH_CEILING:
        raise UsageError(f"max_seq_length: {args.max_seq_length} is above the ceiling {MAX_SEQ_LENGTH_CEILING}")
    need, have = activation_floor_bytes(args, config, layout, device), device_memory_bytes(device)
    if need > have:
        raise UsageError(f"max_seq_length: {args.max_seq_length} cannot fit: one micro-batch of "
                         f"{args.per_device_train_batch_size} needs at least {need / 2**30:.1f} GiB of activations "
                         f"(logits and attention scores) and the {device} has {have / 2**30:.1f} GiB; lower "
                         "max_seq_length or per_device_train_batch_size")


def predict_run(args: Arguments, layout: Layout, config: ModelConfig, device: str) -> dict:
    """The planner's estimate of this run (llm_pretrain/planner), for the run record and the memory warning.

    A planner failure must not stop a valid run: it is recorded as {"error": ...} instead."""
    from llm_pretrain.planner import estimate_setup, setup_from

    try:
        name = device_name(device) if device == "gpu" else "cpu"
        result = estimate_setup(setup_from(args, layout, config, device), name)
    except Exception as error:  # noqa: BLE001 -- recorded, never silent
        return {"error": f"{type(error).__name__}: {error}"}
    if device == "gpu":
        total = paddle.device.cuda.get_device_properties(0).total_memory / 2**20
        result["device_memory_mb"] = total
        result["fits"] = result["peak_mem_reserved_mb"] <= total
    keys = ("peak_mem_allocated_mb", "peak_mem_reserved_mb", "device_memory_mb", "fits", "peak_rank", "peak_phase",
            "step_time_s", "tokens_per_card_per_sec", "mfu", "bottleneck")
    memory_terms = [row for row in result["breakdown"] if row["kind"] == "memory"]
    top = max(memory_terms, key=lambda row: row["mb"])
    return {**{key: result[key] for key in keys}, "top_term": {"term": top["term"], "mb": top["mb"]}}


def memory_warning(prediction: dict) -> str:
    top = prediction["top_term"]
    return (f"the planner predicts {prediction['peak_mem_reserved_mb']:,.0f} MB reserved on {prediction['peak_rank']} "
            f"({prediction['peak_phase']}), more than the device's {prediction['device_memory_mb']:,.0f} MB; the "
            f"largest term is {top['term']} ({top['mb']:,.0f} MB); see `python scripts/plan.py estimate` and "
            "`search` for layouts that fit")


def launcher_rank() -> int:
    """This process's global rank as the launcher numbers it (known before fleet.init)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def find_resume(args: Arguments, world_size: int) -> tuple[int, list[str]]:
    """The checkpoint candidates (newest first) and the index of the newest one this rank found intact.

    resume_from_checkpoint names one checkpoint (no fallback); otherwise every complete
    checkpoint in output_dir is a candidate (none with overwrite_output_dir). Damaged ones
    are one warning each, naming the file. The ranks agree after fleet.init (agree_on_checkpoint).
    """
    if args.resume_from_checkpoint:
        problem = ckpt.verify_checkpoint(args.resume_from_checkpoint)
        if problem:
            raise UsageError(f"resume_from_checkpoint: {args.resume_from_checkpoint} cannot be used: {problem}")
        return 0, [args.resume_from_checkpoint]
    if args.overwrite_output_dir:
        return 0, []
    index, candidates, warnings = ckpt.find_resume_checkpoint(args.output_dir, launcher_rank(), world_size)
    for message in warnings:
        warn(message)
    if candidates and index == len(candidates):
        raise no_usable_checkpoint(args)
    return index, candidates


def no_usable_checkpoint(args: Arguments) -> UsageError:
    """Every complete checkpoint is damaged (found by this rank before fleet.init, or by some rank after)."""
    return UsageError(f"output_dir: no usable checkpoint in {args.output_dir} (every complete checkpoint is "
                      "damaged, see the warnings above); set overwrite_output_dir to start over")


def check_checkpoint_matches(path: str, layout: Layout, config: ModelConfig, args: Arguments) -> list[str]:
    """UsageError unless the checkpoint is of this model (architecture, vocabulary, sequence length);
    any layout may resume it (llm_pretrain/dist_checkpoint.py). Returns a warning listing the other
    keys that changed (learning rate, steps, seed, degrees ...)."""
    from llm_pretrain.dist_checkpoint import check_resumable

    state = ckpt.read_trainer_state(path)
    check_resumable(path, state, config.architecture_dict(), args.max_seq_length, layout_summary(layout))
    saved_args, now_args = state.get("args", {}), arguments_to_dict(args)
    ignored = {"output_dir", "resume_from_checkpoint", "overwrite_output_dir", "disable_tqdm"}
    changed = [f"{key} {saved_args[key]!r} -> {value!r}" for key, value in now_args.items()
               if key in saved_args and key not in ignored and saved_args[key] != value]
    return [f"resuming {path} with changed keys: {', '.join(changed)}"] if changed else []


def layout_summary(layout: Layout) -> dict:
    return {key: getattr(layout, key) for key in (
        "world_size", "data_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
        "sharding_degree", "sharding_stage", "virtual_pp_degree")}


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

    def host_batch(self, dataset, first_sample: int, vocab_size: int) -> np.ndarray:
        """This replica's samples of the global batch that starts at first_sample (int64, on the host)."""
        per_replica = self.micro_batch_size * self.accumulation_steps
        start = first_sample + self.data_replica_rank * per_replica
        tokens = np.stack([dataset[i] for i in range(start, start + per_replica)]).astype("int64")
        if tokens.max() >= vocab_size:
            raise UsageError(f"input_dir: token id {tokens.max()} in the data is not below the model's vocab_size "
                             f"{vocab_size}; was the data prepared with another tokenizer?")
        return tokens

    def to_micro_batches(self, tokens: np.ndarray, device: str = "cpu") -> list:
        """(input_ids, labels) tensors of each micro-batch of host_batch's samples."""
        batches = []
        for i in range(self.accumulation_steps):
            chunk = tokens[i * self.micro_batch_size:(i + 1) * self.micro_batch_size]
            batches.append((to_device(chunk[:, :-1], device), to_device(chunk[:, 1:], device)))
        return batches

    def micro_batches(self, dataset, first_sample: int, vocab_size: int, device: str = "cpu") -> list:
        """This replica's micro-batches (input_ids, labels) of the global batch that starts at first_sample."""
        return self.to_micro_batches(self.host_batch(dataset, first_sample, vocab_size), device)


class BatchPrefetcher:
    """Reads the next step's samples on a background thread while this step computes.

    Only the host work (memory-mapped reads, stacking) runs on the thread; the copy to the
    device stays on the main thread (asynchronous from pinned memory on GPU, see to_device).
    The step's own host sync (agree_on_step) would otherwise keep a read issued after the step
    from overlapping the device's work."""

    def __init__(self, plan: BatchPlan, dataset, vocab_size: int, device: str):
        from concurrent.futures import ThreadPoolExecutor

        self.plan, self.dataset, self.vocab_size, self.device = plan, dataset, vocab_size, device
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: tuple[int, object] | None = None

    def get(self, first_sample: int, next_first_sample: int | None) -> list:
        """The micro-batches starting at first_sample; starts reading those at next_first_sample."""
        if self.pending and self.pending[0] == first_sample:
            tokens = self.pending[1].result()
        else:
            tokens = self.plan.host_batch(self.dataset, first_sample, self.vocab_size)
        self.pending = None
        if next_first_sample is not None:
            self.pending = (next_first_sample, self.pool.submit(self.plan.host_batch, self.dataset,
                                                                next_first_sample, self.vocab_size))
        return self.plan.to_micro_batches(tokens, self.device)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def to_device(array: np.ndarray, device: str):
    """A host array as a tensor on the run's device. On GPU through pinned (page-locked) host memory
    and an asynchronous copy, so that the copy of the next batch overlaps the running step
    (Tensor.cuda(blocking=False), paddle/base/dygraph/tensor_patch_methods.py)."""
    if device != "gpu":
        return paddle.to_tensor(array)
    return paddle.to_tensor(array, place=paddle.CUDAPinnedPlace()).cuda(blocking=False)


def device_name(device: str) -> str:
    """The accelerator's name for reports (the peak-TFLOPs lookup uses it): "NVIDIA A100-SXM4-80GB", "cpu"."""
    return paddle.device.cuda.get_device_name(0) if device == "gpu" else "cpu"


# ----------------------------------------------------------------------------- steps
def grad_square_sum(parameters):
    """Sum of the squared gradients as a 0-d device tensor (no host sync)."""
    # paddle.square, not `** 2`: on CPU the pow kernel is ~40x slower (55 ms vs 1.3 ms a step for 3M
    # parameters, benchmarks/cpu_speed.md), and this norm is extra work PaddleNLP's Trainer does not do.
    # O2 with master gradients keeps the float32 gradient in main_grad (fleet's mix_precision_utils).
    grads = [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in parameters]
    squares = [paddle.sum(paddle.square(g.astype("float32"))) for g in grads if g is not None]
    return paddle.add_n(squares) if squares else paddle.zeros([], dtype="float32")


def global_grad_norm(parameters):
    """The global gradient norm as a 0-d device tensor."""
    return paddle.sqrt(grad_square_sum(parameters))


@dataclass
class StepResult:
    """One optimizer step as every rank agreed on it."""

    loss: float
    # Global norm before clipping, of the unscaled gradients: a float, or a 0-d device tensor read
    # when the step is logged (fleet's clip computes it inside the optimizer step); None: not available.
    grad_norm: object
    nonfinite: str | None = None  # what was not finite on some rank ("loss", "gradient norm"); then no update
    stop_requested: bool = False  # some rank received SIGTERM/SIGINT
    optimizer_stepped: bool = True  # False: no update (non-finite, or the fp16 scaler's overflow on some rank)


def agree_on_step(loss, grad_squares, stop_requested: bool, check_grads: bool, layout: Layout) -> tuple[np.ndarray, list]:
    """The step's flags (loss non-finite, gradients non-finite, stop requested) max-reduced over all
    ranks, read to the host together with the loss: the step's one host sync.

    `loss` and `grad_squares` are device tensors (grad_squares may be None)."""
    flags = [~paddle.isfinite(loss.reshape([]))]
    flags.append(~paddle.isfinite(grad_squares.reshape([])) if check_grads and grad_squares is not None
                 else paddle.to_tensor(False))
    flags.append(paddle.to_tensor(stop_requested))
    flags = paddle.stack(flags).astype("float32")
    if layout.distributed:
        import paddle.distributed as dist

        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = [loss.reshape([1]).astype("float32"), flags]
    if grad_squares is not None:
        values.append(grad_squares.reshape([1]).astype("float32"))
    host = paddle.concat(values).numpy()
    return host, [what for what, flag in zip(("loss", "gradient norm"), host[1:3]) if flag]


def train_step(model, optimizer, schedule, precision: Precision, micro_batches, parameters,
               clip_grad_norm=None, layout: Layout | None = None, stop_requested: bool = False) -> StepResult:
    """Forward/backward over the micro-batches, then one optimizer step, unless some rank's loss or
    gradients are not finite (then the gradients are dropped and the weights stay as they were).

    The grad norm is the global norm before clipping, of the unscaled gradients: computed here in
    a single process, read from fleet's clip in a distributed run (None where neither is
    available). Under fp16 the loss scaler skips its own overflow steps (on every rank alike), so
    only the loss is checked there; as PaddleNLP's Trainer, the LR schedule advances only when the
    optimizer really stepped."""
    layout = layout or Layout()
    check_grads = precision.scaler is None
    micro_batches = list(micro_batches)
    if is_pipeline(model):
        # fleet runs the 1F1B / interleaved schedule over the micro-batches and steps the optimizer
        # (outside autocast: pipeline_parallel.py train_batch), so the check comes after the update:
        # a non-finite step stops the run before any save. The forwards run under the run's
        # autocast, as paddlenlp/trainer/trainer.py training_pipeline_step.
        inputs = paddle.concat([x for x, _ in micro_batches])
        labels = paddle.concat([y for _, y in micro_batches])
        with precision.autocast():
            loss = model.train_batch([inputs, labels], optimizer, scaler=precision.scaler)
        stepped = precision.optimizer_was_run()
        if stepped:
            schedule.step()
        grad_norm = clip_grad_norm() if clip_grad_norm else None
        norm = grad_norm if grad_norm is not None else paddle.zeros([], dtype="float32")
        host, nonfinite = agree_on_step(loss.astype("float32"), norm.reshape([]), stop_requested, check_grads,
                                        layout)
        return StepResult(float(host[0]), grad_norm, ", ".join(nonfinite) or None, bool(host[3]), stepped)
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
    # In a single process the squares give the grad norm (unscaled first: a one-process clip scales
    # the gradients in place during the step); distributed, fleet's clip computes the global norm
    # inside the optimizer step and the local squares only feed the finiteness flag.
    unscaled = precision.unscale(optimizer)
    grad_squares = grad_square_sum(parameters) if unscaled and (check_grads or not clip_grad_norm) else None
    host, nonfinite = agree_on_step(total_loss / len(micro_batches), grad_squares, stop_requested, check_grads, layout)
    loss_value, stop = float(host[0]), bool(host[3])
    if nonfinite:
        optimizer.clear_grad()
        return StepResult(loss_value, None, ", ".join(nonfinite), stop, optimizer_stepped=False)
    grad_norm = math.sqrt(float(host[4])) if grad_squares is not None and not clip_grad_norm else None
    stepped = precision.step(optimizer)
    if clip_grad_norm:
        grad_norm = clip_grad_norm()
    elif grad_norm is None:
        grad_norm = global_grad_norm(parameters)  # unscaled by the (cross-rank) scaler's step; no clip ran
    optimizer.clear_grad()
    if stepped:
        schedule.step()
    return StepResult(loss_value, grad_norm, None, stop, stepped)


class DivergenceGuard:
    """Counts consecutive non-finite steps: up to `allowed` are skipped, the next one stops the run."""

    def __init__(self, allowed: int):
        self.allowed = allowed
        self.in_a_row = 0

    def reset(self) -> None:
        self.in_a_row = 0

    def skip_or_stop(self, step: int, result: StepResult) -> str:
        """The warning for a skipped step, or DivergenceError when no skip is left."""
        self.in_a_row += 1
        if self.in_a_row > self.allowed:
            skipped = f" after skipping {self.allowed} step(s) in a row" if self.allowed else ""
            raise DivergenceError(f"divergence at step {step}: the {result.nonfinite} is not finite (NaN/Inf) "
                                  f"(loss {result.loss}); stopped without saving this state{skipped}; lower the "
                                  "learning rate or resume from an earlier checkpoint")
        return (f"warning: step {step}: the {result.nonfinite} is not finite; update skipped "
                f"({self.in_a_row} of at most {self.allowed} in a row, skip_nan_inf_steps)")


def is_pipeline(model) -> bool:
    return hasattr(model, "train_batch")


@paddle.no_grad()
def evaluate(model, dataset, plan: BatchPlan, iterations: int, vocab_size: int, layout: Layout,
             precision: Precision | None = None, first_sample: int = 0,
             pipeline_calls: tuple[int, int] | None = None) -> float:
    """Mean loss over `iterations` global batches of a split from `first_sample` on.

    pipeline_calls: (calls, micro-batches per call) of the pipeline's eval_batch (see
    `pipeline_eval_micro_batches`); its micro-batch size is the training one.
    """
    model.eval()
    autocast = precision.autocast if precision else contextlib.nullcontext  # the run's autocast, as in training
    batches = [b for i in range(iterations)
               for b in plan.micro_batches(dataset, first_sample + i * plan.global_batch_size, vocab_size)]
    if is_pipeline(model):
        # As PaddleNLP's training_pipeline_step does for training: set the pipeline's micro-batch
        # count for this call and restore it afterwards.
        inputs = paddle.concat([x for x, _ in batches])
        labels = paddle.concat([y for _, y in batches])
        calls, per_call = pipeline_calls
        samples = inputs.shape[0] // calls
        saved = model.accumulate_steps
        model.accumulate_steps = per_call
        try:
            with autocast():
                losses = [scalar(model.eval_batch([inputs[c * samples:(c + 1) * samples],
                                                   labels[c * samples:(c + 1) * samples]], compute_loss=True))
                          for c in range(calls)]
        finally:
            model.accumulate_steps = saved
    else:
        with autocast():
            losses = [float(model(input_ids, labels)) for input_ids, labels in batches]
    model.train()
    return all_reduce_mean_over_replicas(sum(losses) / len(losses), layout)


def build_model(config: ModelConfig, layout: Layout):
    if layout.pipeline_parallel_degree > 1:
        from models.pipeline import CausalLMPipeline

        split = pipeline_split(config.num_hidden_layers, layout.pipeline_parallel_degree, pipeline_chunks(layout),
                               layout.pipeline_layers_per_stage)
        return CausalLMPipeline(config, layout.virtual_pp_degree, config.pp_recompute_interval, split,
                                use_dualpipev=layout.dualpipev)
    return CausalLM(config)


# ----------------------------------------------------------------------------- the run
def train(args: Arguments, argument_warnings: list[str], args_file: str | None = None) -> dict:
    with contextlib.ExitStack() as run:
        stop = run.enter_context(StopRequest())  # SIGTERM/SIGINT from here on: stop at a step boundary
        return _train(args, argument_warnings, args_file, stop, run)


def _train(args: Arguments, argument_warnings: list[str], args_file: str | None, stop: StopRequest,
           run: contextlib.ExitStack) -> dict:
    # 1. Everything that can be wrong, before any expensive work.
    device = select_device(args)
    layout = plan_layout(args, launcher_world_size())
    config, weights_file, model_notes = build_model_config(args, layout, device)
    check_model_fits_layout(config, layout)
    check_strategy(args, config, layout)
    check_startup(args, config, layout, device)
    check_data_inputs(args.input_dir, args.split)
    prediction = predict_run(args, layout, config, device)
    if device == "gpu" and prediction.get("fits") is False:
        warn(memory_warning(prediction))
    # The integrity passes read every .idx and .bin once (then cached): one process per node does them.
    check_data_integrity(args.input_dir, config.vocab_size, args.data_cache,
                         thorough=os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")) == "0")
    if launcher_rank() == 0:
        run.callback(take_output_dir(args).release)  # the lock: one run per output_dir
    resume_index, resume_candidates = find_resume(args, layout.world_size) if args.do_train else (0, [])
    if resume_candidates[resume_index:]:
        model_notes += check_checkpoint_matches(resume_candidates[resume_index], layout, config, args)

    # 2. Processes and groups.
    set_collective_timeout(args, device)
    layout = init_distributed(layout, device, args)
    if layout.is_main:
        for message in argument_warnings + gpu_only_warnings(args, device) + model_notes:
            warn(message)
    set_seed(args.seed)

    # 3. Model, optimizer, data.
    reset_peak_memory(device)  # the peak reported is this run's (tests train several runs in one process)
    model = build_model(config, layout)
    if weights_file:
        load_weights_file(model, config, weights_file)
    else:
        init_weights(model, config, args.seed)
    schedule = build_schedule(args)
    optimizer = build_optimizer(args, model, schedule)
    precision = Precision(args, device)
    model, optimizer = precision.prepare(model, optimizer, layout)
    unwrapped_model = model
    parameters = [p for _, p in unwrapped_model.canonical_named_parameters()]
    model, optimizer = wrap_for_training(model, optimizer, layout, args.gradient_accumulation_steps)
    clip_grad_norm = record_grad_norm(optimizer) if layout.distributed else None

    train_plan = BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                           layout.data_replicas, layout.data_replica_rank)
    eval_plan = BatchPlan(args.per_device_eval_batch_size, 1, layout.data_replicas, layout.data_replica_rank)
    num_samples = (args.max_steps * train_plan.global_batch_size if args.do_train else 0,
                   valid_samples(args, eval_plan) if args.do_eval else 0,
                   predict_iterations(args) * eval_plan.global_batch_size if args.do_predict else 0)
    datasets = _build_datasets_rank0_first(args, num_samples, layout)
    train_data, valid_data, test_data = datasets

    # 4. Checkpoints: resume from the newest one every rank found intact.
    checkpointer = Checkpointer(args.output_dir, layout, args.save_steps, args.save_total_limit, args.exit_interval)
    if layout.is_main and args.overwrite_output_dir and not args.resume_from_checkpoint:
        for name in ckpt.remove_checkpoints(args.output_dir):
            warn(f"overwrite_output_dir: removed {os.path.join(args.output_dir, name)} of an earlier run")
    start_step, consumed_samples, resume_from = 0, 0, None
    if resume_candidates:
        resume_index, more_warnings = ckpt.agree_on_checkpoint(resume_index, resume_candidates, layout)
        for message in more_warnings:
            warn(message)
        if resume_index == len(resume_candidates):
            raise no_usable_checkpoint(args)
        resume_from = resume_candidates[resume_index]
        state = checkpointer.load(resume_from, unwrapped_model, optimizer, precision.scaler)
        start_step, consumed_samples = state["global_step"], state["consumed_samples"]

    flops_per_token = training_flops_per_token(config, args.max_seq_length)
    metrics = MetricsLogger(args.output_dir, layout, device, max_steps=args.max_steps,
                            logging_steps=args.logging_steps, flops_per_token=flops_per_token,
                            global_tokens_per_step=train_plan.global_batch_size * args.max_seq_length,
                            start_step=start_step, disable_tqdm=args.disable_tqdm,
                            fresh=args.overwrite_output_dir and not resume_from)
    run.callback(metrics.close)
    built = run_record.describe_built_run(model, optimizer, precision)  # what the wrappers and layers are
    name = run_record.built_strategy_name(built)
    metrics.write({
        "event": "run", "model": args.model_name_or_path, "family": config.family, "args_file": args_file,
        "strategy": name, "layout": layout_summary(layout), "built": built, "seq_length": args.max_seq_length,
        "global_batch_size": train_plan.global_batch_size, "max_steps": args.max_steps, "start_step": start_step,
        "resumed_from": resume_from,
        "device": device, "device_name": device_name(device),
        "dtype": {"bfloat16": "bf16", "float16": "fp16"}.get(precision.dtype, "fp32"),
        "paddle_version": paddle.__version__, "paddle_commit": paddle.version.commit,
        "flops_per_token": flops_per_token, "model_config": config.architecture_dict(),
        "prediction": prediction,
    })
    resumed = f", resumed from {resume_from}" if resume_from else ""
    metrics.say(f"training {args.model_name_or_path} ({config.family}, "
                f"{sum(int(np.prod(p.shape)) for p in parameters):,} parameters on rank 0) with {name} on "
                f"{layout.world_size} {device} process(es), global batch {train_plan.global_batch_size} x "
                f"{args.max_seq_length} tokens{resumed}")

    # 5. The loop: step, check, log, evaluate, save; stop on divergence, a signal or exit_interval.
    heartbeat = Heartbeat(layout.rank)
    replicas, replica_checks = None, 0  # what the last replica check compared (llm_pretrain/replica_check.py)
    divergence = DivergenceGuard(args.skip_nan_inf_steps)
    step = start_step
    prefetcher = BatchPrefetcher(train_plan, train_data, config.vocab_size, device)
    run.callback(prefetcher.close)
    while args.do_train and step < args.max_steps:
        learning_rate = optimizer.get_lr()
        step_start = time.perf_counter()
        following = consumed_samples + train_plan.global_batch_size if step + 1 < args.max_steps else None
        batches = prefetcher.get(consumed_samples, following)
        try:
            result = train_step(model, optimizer, schedule, precision, batches, parameters, clip_grad_norm,
                                layout, stop.requested)
        except (RuntimeError, OSError) as error:
            if not layout.distributed:
                raise
            traceback.print_exc()  # in case it is a bug rather than a lost peer
            raise RunError(heartbeat.describe_failure(layout.world_size, step, error)) from error
        if device == "gpu":
            paddle.device.synchronize()
        step_time = time.perf_counter() - step_start
        step += 1
        consumed_samples += train_plan.global_batch_size
        heartbeat.beat(step)

        if result.nonfinite:  # the update was not applied; stop (exit code 3) unless skips are allowed
            metrics.say(divergence.skip_or_stop(step, result))
            metrics.write({"event": "skipped", "step": step, "nonfinite": result.nonfinite})
        else:
            divergence.reset()
            if not result.optimizer_stepped:
                metrics.say(f"warning: step {step}: the fp16 loss scale overflowed; the optimizer step and the LR "
                            "schedule were skipped on every rank")
            metrics.step(step, result.loss, result.grad_norm, learning_rate, step_time, consumed_samples)

        if args.do_eval and valid_data is not None and step % args.effective_eval_steps == 0:
            metrics.evaluation("valid", step, run_evaluation(model, valid_data, "valid", step, eval_plan, args,
                                                             config, layout, precision))

        stopping = result.stop_requested and step < args.max_steps
        if checkpointer.due(step, args.max_steps) or stopping:
            trainer_state = {"global_step": step, "consumed_samples": consumed_samples,
                             "layout": layout_summary(layout), "args": arguments_to_dict(args),
                             "model_config": config.architecture_dict()}
            checkpointer.save(step, unwrapped_model, optimizer, trainer_state, precision.scaler)
        if stopping:
            stop.stopped = True
            metrics.say(f"stopped at step {step} ({stop.signal_name or 'signal on another rank'}), "
                        f"checkpoint-{step} saved; run the same command to resume")
            break
        if checkpointer.exit_due(step, args.max_steps):
            metrics.say(f"stopping after step {step} (exit_interval); run the same command again to resume")
            break
        if args.check_replicas_interval and step % args.check_replicas_interval == 0 and step < args.max_steps:
            replicas = check_replicas(unwrapped_model, optimizer, layout, step)
            replica_checks += 1

    # Every replicated weight and optimizer state the same on every rank (they are saved once).
    if step > start_step:
        replicas = {**check_replicas(unwrapped_model, optimizer, layout, step), "checks": replica_checks + 1}
    if args.do_predict and test_data is not None:
        metrics.evaluation("test", step, run_evaluation(model, test_data, "test", step, eval_plan, args, config,
                                                        layout, precision))
    return metrics.finish(**({"replica_check": replicas} if replicas else {}))


def set_collective_timeout(args: Arguments, device: str) -> None:
    """distributed_timeout_minutes on GPU: ProcessGroupNCCL is created with PADDLE_PG_TIMEOUT (milliseconds;
    read at paddle/distributed/parallel.py:747, passed at paddle/distributed/collective.py:176), so a hung
    rank ends the job in bounded time. gloo (CPU) takes no such timeout."""
    if device == "gpu" and args.distributed_timeout_minutes:
        os.environ["PADDLE_PG_TIMEOUT"] = str(int(args.distributed_timeout_minutes * 60_000))


def take_output_dir(args: Arguments) -> OutputDirLock:
    """Rank 0, before any work: output_dir created and writable, locked, debris of crashed saves removed."""
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = OutputDirLock(args.output_dir).acquire()
    except OSError as error:
        raise UsageError(f"output_dir: cannot create or write {args.output_dir} "
                         f"({error.strerror or error})") from None
    for name in ckpt.remove_stale_partials(args.output_dir):
        warn(f"removed {os.path.join(args.output_dir, name)} (left by an interrupted save)")
    return lock


def _build_datasets_rank0_first(args: Arguments, num_samples, layout: Layout):
    """The first process on each node builds (and caches) the sample indices; the others then load them."""
    kwargs = dict(input_dir=args.input_dir, split=args.split, seq_length=args.max_seq_length, seed=args.seed,
                  num_samples=num_samples, data_cache=args.data_cache, skip_warmup=args.skip_warmup)
    datasets = None
    if layout.local_rank == 0:
        datasets = build_pretraining_datasets(**kwargs)
        damaged = damaged_sample_index_files(datasets)
        if damaged:  # written atomically, so damaged later on disk: rebuild once
            warn(f"the cached sample index {damaged[0]} is damaged (values out of range); rebuilding it")
            for path in damaged:
                with contextlib.suppress(OSError):
                    os.remove(path)
            datasets = build_pretraining_datasets(**kwargs)
            if damaged_sample_index_files(datasets):
                raise UsageError(f"data_cache: the sample index {damaged[0]} is still damaged after a rebuild")
    barrier(layout)
    return datasets if datasets is not None else build_pretraining_datasets(**kwargs)


def valid_samples(args: Arguments, eval_plan: BatchPlan) -> int:
    """Samples of the validation split, as PaddleNLP's llm/run_pretrain.py (create_pretrained_dataset)
    asks for them: per_device_eval_batch_size x dataset world size x eval_iters x (max_steps // eval_steps + 1)."""
    return eval_plan.global_batch_size * args.eval_iters * (args.max_steps // args.effective_eval_steps + 1)


def first_eval_sample(args: Arguments, split: str, step: int, plan: BatchPlan) -> int:
    """Where an evaluation starts in its split. PaddleNLP's PretrainingTrainer keeps one validation
    iterator for the whole run, so its k-th evaluation (at step k x eval_steps) reads the k-th run of
    eval_iters batches; prediction reads the test split from its start."""
    if split != "valid":
        return 0
    return max(step // args.effective_eval_steps - 1, 0) * args.eval_iters * plan.global_batch_size


def run_evaluation(model, dataset, split: str, step: int, plan: BatchPlan, args: Arguments, config: ModelConfig,
                   layout: Layout, precision: Precision) -> float:
    """Loss of one evaluation: eval_iters batches of the validation split, or the test split's batches."""
    iterations = args.eval_iters if split == "valid" else predict_iterations(args)
    calls = pipeline_eval_micro_batches(args, iterations, layout.virtual_pp_degree) if is_pipeline(model) else None
    return evaluate(model, dataset, plan, iterations, config.vocab_size, layout, precision,
                    first_sample=first_eval_sample(args, split, step, plan), pipeline_calls=calls)
