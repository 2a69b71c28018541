"""The pretraining loop, top to bottom, of a run the preflight planned (llm_pretrain/run/preflight.py RunPlan).

    fleet.init                           (only for several processes)
    build model, optimizer, data         (weights identical at every parallel layout)
    resume from the newest intact checkpoint every rank agrees on (Checkpointer)
    for each step: forward/backward over the micro-batches, one agreed flag (non-finite? stop
                   requested?), clip, AdamW step, log (MetricsLogger), evaluate, save (Checkpointer)

Every user mistake was found by the preflight before fleet.init and reported as a one-line
UsageError (exit code 2); divergence is exit code 3, SIGTERM/SIGINT a checkpoint and exit 0.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
import traceback
from dataclasses import dataclass

import numpy as np
import paddle

from llm_pretrain.checkpoint import checkpointer as ckpt
from llm_pretrain.checkpoint.checkpointer import Checkpointer
from llm_pretrain.arguments import Arguments, arguments_to_dict, wants_async_save
from llm_pretrain.data import build_pretraining_datasets
from llm_pretrain.parallel.distributed import (
    all_reduce_mean_over_replicas, barrier, init_distributed, record_grad_norm, wrap_for_training,
)
from llm_pretrain.data.integrity import damaged_sample_index_files
from llm_pretrain.errors import DivergenceError, RunError, UsageError
from llm_pretrain.observe.flops import training_flops_per_token
from llm_pretrain.parallel.layout import Layout, pipeline_chunks, pipeline_eval_micro_batches, pipeline_split, predict_iterations
from llm_pretrain.observe.metrics import MetricsLogger, reset_peak_memory, scalar
from llm_pretrain.parallel.optim import build_optimizer, build_schedule
from llm_pretrain.data.documents import DocumentRule, document_rule
from llm_pretrain.observe import run_record
from llm_pretrain.run.preflight import RunPlan, device_name, layout_summary, no_usable_checkpoint, warn
from llm_pretrain.checkpoint.replica_check import check_replicas
from llm_pretrain.run.resilience import DataSkips, LossSpikeGuard, sample_range
from llm_pretrain.parallel.precision import Precision
from llm_pretrain.run.run_control import Heartbeat, StopRequest, progress, wait_for_hang_report
from models.config import ModelConfig
from models.decoder import CausalLM
from models.weights import init_weights, load_weights_file


def distributed_seeds(seed: int, layout: Layout) -> tuple[int, int, int]:
    """(global, local, random) seeds of this rank, as paddlenlp/trainer/trainer_utils.py
    _get_distributed_seeds (lines 64-145): the global seed is the same within a tensor-parallel group
    and differs across sep/cp, data-parallel, pipeline and sharding ranks (dropout on activations that
    tensor-parallel ranks replicate must match; ranks holding other tokens or other samples should not
    share masks); the local seed differs on every rank; the random seed (python, numpy) per pipeline
    stage. The sep rank is fleet's sep group (sep or cp, Layout.sequence_group_degree), placed between
    tensor and pipeline as there. One process: (seed, seed + 1, seed)."""
    mp, sep, pp = layout.tensor_parallel_degree, layout.sequence_group_degree, layout.pipeline_parallel_degree
    dp = layout.data_parallel_degree
    offset = (layout.sep_parallel_rank * mp + layout.pipeline_parallel_rank * mp * sep
              + layout.data_parallel_rank * mp * sep * pp + layout.sharding_rank * mp * sep * pp * dp)
    return seed + offset, seed + layout.world_size + layout.tensor_parallel_rank + offset, \
        seed + 100 * layout.pipeline_parallel_rank


_TRACKER_SEEDS: dict[str, int] = {}  # the tracker states set_seed added in this process (tests run several trainings)


def set_seed(seed: int, layout: Layout | None = None) -> None:
    """paddlenlp/trainer/trainer_utils.py set_seed (lines 148-160): the tracker's "global_seed" and
    "local_seed" states, paddle's default generator from the global seed, python and numpy from the
    random seed. The weights do not depend on it (models/weights.py seeds its own generator)."""
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    global_seed, local_seed, random_seed = distributed_seeds(seed, layout or Layout())
    tracker = get_rng_state_tracker()
    for name, old in _TRACKER_SEEDS.items():  # an earlier training in this process: replace its states
        tracker.states_.pop(name, None)
        tracker.seeds_.discard(old)
    _TRACKER_SEEDS.clear()
    for name, value in (("global_seed", global_seed), ("local_seed", local_seed)):
        if name not in tracker.states_ and value not in tracker.seeds_:  # as trainer_utils.py:152-156
            tracker.add(name, value)
            _TRACKER_SEEDS[name] = value
    paddle.seed(global_seed)
    random.seed(random_seed)
    np.random.seed(random_seed)


# ----------------------------------------------------------------------------- batches
@dataclass
class BatchPlan:
    """Which samples each step reads: the global batch is split over data replicas, then micro-batches."""

    micro_batch_size: int
    accumulation_steps: int
    data_replicas: int
    data_replica_rank: int
    documents: DocumentRule | None = None  # packed documents' boundaries and eod loss (data/documents.py)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.data_replicas

    def host_batch(self, dataset, first_sample: int, vocab_size: int):
        """This replica's samples of the global batch that starts at first_sample (int64, on the host);
        with document masks (tokens, document ids of every token)."""
        per_replica = self.micro_batch_size * self.accumulation_steps
        start = first_sample + self.data_replica_rank * per_replica
        tokens = np.stack([dataset[i] for i in range(start, start + per_replica)]).astype("int64")
        if tokens.max() >= vocab_size:
            raise UsageError(f"input_dir: token id {tokens.max()} in the data is not below the model's vocab_size "
                             f"{vocab_size}; was the data prepared with another tokenizer?")
        if self.documents is None or not self.documents.document_masks:
            return tokens
        ids = np.stack([self.documents.window_ids(dataset, i, window)
                        for i, window in zip(range(start, start + per_replica), tokens)])
        return tokens, ids

    def to_micro_batches(self, host, device: str = "cpu") -> list:
        """(input_ids, labels) tensors of each micro-batch of host_batch's samples, with document masks
        (input_ids, labels, document_ids)."""
        tokens, ids = host if isinstance(host, tuple) else (host, None)
        batches = []
        for i in range(self.accumulation_steps):
            rows = slice(i * self.micro_batch_size, (i + 1) * self.micro_batch_size)
            inputs, labels = tokens[rows, :-1], tokens[rows, 1:]
            if self.documents is not None:
                labels = self.documents.labels(inputs, labels)
            batch = (to_device(inputs, device), to_device(labels, device))
            if ids is not None:  # each input token's document (the last window token has no input)
                batch += (to_device(ids[rows, :-1], device),)
            batches.append(batch)
        return batches

    def micro_batches(self, dataset, first_sample: int, vocab_size: int, device: str = "cpu") -> list:
        """This replica's micro-batches (input_ids, labels) of the global batch that starts at first_sample."""
        return self.to_micro_batches(self.host_batch(dataset, first_sample, vocab_size), device)


class BatchPrefetcher:
    """Reads the next step's samples on a background thread while this step computes.

    Only the host work (memory-mapped reads, stacking) runs on the thread; the copy to the
    device stays on the main thread, as a plain copy (see to_device). The step's own host sync
    (agree_on_step) would otherwise keep a read issued after the step from overlapping the
    device's work."""

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
    """A host array as a tensor on the run's device (the current place), copied synchronously.

    No pinned staging with an asynchronous copy: Tensor.cuda(blocking=False) issues the copy through
    Tensor._copy_to on the destination's device context, i.e. on the compute stream
    (paddle/base/dygraph/tensor_patch_methods.py:1161-1191), so it cannot overlap the step's kernels,
    only spare the host a wait; and the temporary pinned tensor went back to Paddle's pinned
    allocator when this function returned, with the copy possibly still reading it. The token ids of
    a step are a few hundred KB (micro-batch x sequence x 8 bytes): the synchronous copy costs
    microseconds, and the host reads they come from already run ahead on BatchPrefetcher's thread."""
    del device  # the current place: CPU, or this rank's GPU (select_device)
    return paddle.to_tensor(array)


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
    agreed_loss: float = math.nan  # the largest loss over the ranks (the loss spike check's, llm_pretrain/run/resilience.py)
    write_pending: bool = False  # some rank's asynchronous checkpoint write is still running


class OwnTime:
    """This rank's own share of a step: from the step's start to where it reaches the step's flag reduction,
    before it waits for the others (the straggler record of each logging step compares it over the ranks).

    On GPU the host only queues kernels, so its clock measures the queueing, not the work: two CUDA events
    (paddle.device.Event(enable_timing=True), paddle/device/__init__.py:1083-1240 of Paddle 3.3.1: record() on
    the current stream, elapsed_time() in milliseconds) mark the same two points on the device's stream and
    are read after the step's host sync. On CPU the kernels run as the host calls them: host time is device
    time."""

    def __init__(self, device: str = "cpu"):
        self.gpu = device == "gpu"
        self.started = self.reached_at = time.perf_counter()
        self.events = None

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.gpu:
            self.events = (paddle.device.Event(enable_timing=True), paddle.device.Event(enable_timing=True))
            self.events[0].record()

    def reached(self) -> None:
        """Called where the step's flag reduction starts (agree_on_step)."""
        self.reached_at = time.perf_counter()
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float:
        """After the step's host sync (its events are done)."""
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1000.0
        return self.reached_at - self.started


OWN_TIME = OwnTime()  # the running training's (train sets the device); agree_on_step marks the reduction


def agree_on_step(loss, grad_squares, stop_requested: bool, check_grads: bool, layout: Layout,
                  write_pending: bool = False) -> tuple[np.ndarray, list]:
    """The step's flags (loss non-finite, gradients non-finite, stop requested, checkpoint write
    pending) and the loss max-reduced over all ranks, read to the host together with the local loss:
    the step's one host sync. host: [local loss, 4 flags, largest loss over the ranks, (grad squares)].

    `loss` and `grad_squares` are device tensors (grad_squares may be None)."""
    flags = [~paddle.isfinite(loss.reshape([]))]
    flags.append(~paddle.isfinite(grad_squares.reshape([])) if check_grads and grad_squares is not None
                 else paddle.to_tensor(False))
    flags.append(paddle.to_tensor(stop_requested))
    flags.append(paddle.to_tensor(write_pending))
    flags = paddle.concat([paddle.stack(flags).astype("float32"), loss.reshape([1]).astype("float32")])
    OWN_TIME.reached()
    if layout.distributed:
        import paddle.distributed as dist

        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = [loss.reshape([1]).astype("float32"), flags]
    if grad_squares is not None:
        values.append(grad_squares.reshape([1]).astype("float32"))
    host = paddle.concat(values).numpy()
    return host, [what for what, flag in zip(("loss", "gradient norm"), host[1:3]) if flag]


def train_step(model, optimizer, schedule, precision: Precision, micro_batches, parameters,
               clip_grad_norm=None, layout: Layout | None = None, stop_requested: bool = False,
               skip_above: float | None = None, write_pending: bool = False) -> StepResult:
    """Forward/backward over the micro-batches, then one optimizer step, unless some rank's loss or
    gradients are not finite (then the gradients are dropped and the weights stay as they were).

    The grad norm is the global norm before clipping, of the unscaled gradients: computed here in
    a single process, read from fleet's clip in a distributed run (None where neither is
    available). Under fp16 the loss scaler skips its own overflow steps (on every rank alike), so
    only the loss is checked there; as PaddleNLP's Trainer, the LR schedule advances only when the
    optimizer really stepped. skip_above: no update either when the largest loss over the ranks is
    above it (a loss spike; not under the pipeline, whose update comes first)."""
    layout = layout or Layout()
    check_grads = precision.scaler is None
    micro_batches = list(micro_batches)
    if is_pipeline(model):
        # fleet runs the 1F1B / interleaved schedule over the micro-batches and steps the optimizer
        # (outside autocast: pipeline_parallel.py train_batch), so the check comes after the update:
        # a non-finite step stops the run before any save. The forwards run under the run's
        # autocast, as paddlenlp/trainer/trainer.py training_pipeline_step.
        inputs, labels = pipeline_data(micro_batches, with_labels=predicts_next_tokens(model))
        with precision.autocast():
            loss = model.train_batch([inputs, labels], optimizer, scaler=precision.scaler)
        stepped = precision.optimizer_was_run()
        if stepped:
            schedule.step()
            update_router_biases(model)
        grad_norm = clip_grad_norm() if clip_grad_norm else None
        norm = grad_norm if grad_norm is not None else paddle.zeros([], dtype="float32")
        host, nonfinite = agree_on_step(loss.astype("float32"), norm.reshape([]), stop_requested, check_grads,
                                        layout, write_pending)
        return StepResult(float(host[0]), grad_norm, ", ".join(nonfinite) or None, bool(host[3]), stepped,
                          float(host[5]), bool(host[4]))
    total_loss = paddle.zeros([], dtype="float32")
    for i, (input_ids, labels, *documents) in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        # Data parallelism all-reduces gradients once, after the last micro-batch.
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with precision.autocast():
                loss = model(input_ids, labels, *documents)  # documents: [document_ids] with document masks
            precision.backward(loss / len(micro_batches))
        total_loss += loss.detach().astype("float32")
    # In a single process the squares give the grad norm (unscaled first: a one-process clip scales
    # the gradients in place during the step); distributed, fleet's clip computes the global norm
    # inside the optimizer step and the local squares only feed the finiteness flag.
    unscaled = precision.unscale(optimizer)
    grad_squares = grad_square_sum(parameters) if unscaled and (check_grads or not clip_grad_norm) else None
    host, nonfinite = agree_on_step(total_loss / len(micro_batches), grad_squares, stop_requested, check_grads, layout,
                                    write_pending)
    loss_value, stop, pending, agreed_loss = float(host[0]), bool(host[3]), bool(host[4]), float(host[5])
    if nonfinite or (skip_above is not None and agreed_loss > skip_above):
        optimizer.clear_grad()
        precision.skip_step()  # the one-process scaler already unscaled: close its step
        return StepResult(loss_value, None, ", ".join(nonfinite) or None, stop, False, agreed_loss, pending)
    grad_norm = math.sqrt(float(host[6])) if grad_squares is not None and not clip_grad_norm else None
    stepped = precision.step(optimizer)
    if clip_grad_norm:
        grad_norm = clip_grad_norm()
    elif grad_norm is None:
        grad_norm = global_grad_norm(parameters)  # unscaled by the (cross-rank) scaler's step; no clip ran
    optimizer.clear_grad()
    if stepped:
        schedule.step()
        update_router_biases(model)
    return StepResult(loss_value, grad_norm, None, stop, stepped, agreed_loss, pending)


def update_router_biases(model) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: the routers' biases move after the update (models/deepseek_moe.py;
    under the pipeline each stage moves its own layers')."""
    update_biases = getattr(getattr(model, "_layers", model), "update_router_biases", None)
    if update_biases is not None:
        update_biases()


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


def pipeline_data(micro_batches, with_labels: bool = False):
    """(inputs, labels) of fleet's train_batch / eval_batch: the micro-batches concatenated (fleet cuts them
    again); with document masks the inputs are (input_ids, document_ids), a tuple fleet's
    _load_micro_batch_impl cuts tensor by tensor (the first stage gets both: models/pipeline.py).
    `with_labels` (DeepSeek-V3's MTP): the labels end the inputs too, for the first stage to embed the next
    tokens (models/pipeline.py PipelineEmbeddings)."""
    columns = [paddle.concat(list(column)) for column in zip(*micro_batches)]
    inputs = (columns[0], *columns[2:]) + ((columns[1],) if with_labels else ())
    return (inputs if len(inputs) > 1 else inputs[0]), columns[1]


def predicts_next_tokens(model) -> bool:
    """The pipeline runs DeepSeek-V3's multi-token prediction (its first stage needs the labels)."""
    return bool(getattr(model, "_layers", model).config.num_nextn_predict_layers)


def rows_of(inputs, start: int, end: int):
    return tuple(x[start:end] for x in inputs) if isinstance(inputs, tuple) else inputs[start:end]


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
        inputs, labels = pipeline_data(batches, with_labels=predicts_next_tokens(model))
        calls, per_call = pipeline_calls
        samples = labels.shape[0] // calls
        saved = model.accumulate_steps
        model.accumulate_steps = per_call
        try:
            with autocast():
                losses = [fed(scalar(model.eval_batch([rows_of(inputs, c * samples, (c + 1) * samples),
                                                        labels[c * samples:(c + 1) * samples]], compute_loss=True)))
                          for c in range(calls)]
        finally:
            model.accumulate_steps = saved
    else:
        with autocast():
            losses = [fed(float(model(*batch))) for batch in batches]  # (input_ids, labels[, document_ids])
    model.train()
    return all_reduce_mean_over_replicas(sum(losses) / len(losses), layout)


def fed(value):
    """`value`, after telling the hang watchdog that a batch of an evaluation finished (run_control.progress)."""
    progress()
    return value


def build_model(config: ModelConfig, layout: Layout):
    from models import constants

    constants.release()  # a run's masks are its own: another run in this process (the test workers) builds anew
    config = config.replace(sep_parallel_degree=layout.sep_parallel_degree,
                            context_parallel_degree=layout.context_parallel_degree)
    if layout.pipeline_parallel_degree > 1:
        from models.pipeline import CausalLMPipeline

        split = pipeline_split(config.num_hidden_layers, layout.pipeline_parallel_degree, pipeline_chunks(layout),
                               layout.pipeline_layers_per_stage)
        return CausalLMPipeline(config, layout.virtual_pp_degree, config.pp_recompute_interval, split,
                                use_dualpipev=layout.dualpipev)
    return CausalLM(config)


# ----------------------------------------------------------------------------- the run
def train(plan: RunPlan) -> dict:
    with contextlib.ExitStack() as run:
        if plan.output_dir_lock is not None:
            run.callback(plan.output_dir_lock.release)  # one run per output_dir, until this one ends
        stop = run.enter_context(StopRequest())  # SIGTERM/SIGINT from here on: stop at a step boundary
        try:
            return _train(plan, stop, run)
        except BaseException:
            wait_for_hang_report()  # a hang watchdog that fired ends the job with its own line
            raise


def _train(plan: RunPlan, stop: StopRequest, run: contextlib.ExitStack) -> dict:
    # 1. The run as the preflight checked and planned it (llm_pretrain/run/preflight.py).
    args, args_file, device, config = plan.args, plan.args_file, plan.device, plan.config
    weights_file, prediction = plan.weights_file, plan.prediction
    resume_index, resume_candidates = plan.resume_index, plan.resume_candidates

    # 2. Processes and groups.
    layout = init_distributed(plan.layout, device, args)
    if layout.is_main:
        for message in plan.warnings:
            warn(message)
    set_seed(args.seed, layout)  # per rank, as PaddleNLP

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

    documents = document_rule(args)  # packed documents: masks, eod loss (llm_pretrain/data/documents.py)
    train_plan = BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                           layout.data_replicas, layout.data_replica_rank, documents)
    eval_plan = BatchPlan(args.per_device_eval_batch_size, 1, layout.data_replicas, layout.data_replica_rank,
                          documents)
    num_samples = (args.max_steps * train_plan.global_batch_size if args.do_train else 0,
                   valid_samples(args, eval_plan) if args.do_eval else 0,
                   predict_iterations(args) * eval_plan.global_batch_size if args.do_predict else 0)
    datasets = _build_datasets_rank0_first(args, num_samples, layout)
    train_data, valid_data, test_data = datasets

    # 4. Checkpoints: resume from the newest one every rank found intact.
    checkpointer = Checkpointer(args.output_dir, layout, args.save_steps, args.save_total_limit, args.exit_interval,
                                wants_async_save(args))
    if layout.is_main and args.overwrite_output_dir and not args.resume_from_checkpoint:
        for name in ckpt.remove_checkpoints(args.output_dir):
            warn(f"overwrite_output_dir: removed {os.path.join(args.output_dir, name)} of an earlier run")
    start_step, consumed_samples, resume_from, state = 0, 0, None, {}
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
    built = run_record.describe_built_run(model, optimizer, precision,  # what the wrappers and layers are
                                          document_masks=bool(args.reset_attention_mask))
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
        "prediction": prediction, "cpu_defaults": plan.cpu_defaults,
        "lr_schedule": schedule.describe(),  # the learning-rate schedule as built (parallel/optim.py)
        "documents": None if documents is None else {  # what the batches and the model were built with
            "document_masks": documents.document_masks, "eod_token_id": documents.eod_token_id,
            "eod_mask_loss": documents.eod_mask_loss, "reset_position_ids": unwrapped_model.config.reset_position_ids},
        **({"elastic": plan.elastic} if plan.elastic else {}),
    })
    if plan.elastic:  # the layout change the preflight made for the ranks present, also as its own record
        metrics.write({"event": "elastic", "step": start_step, **plan.elastic})
    if plan.cpu_defaults:
        metrics.say(plan.cpu_defaults)  # what llm_pretrain/cpu/threads.py set before Paddle loaded
    resumed = f", resumed from {resume_from}" if resume_from else ""
    metrics.say(f"training {args.model_name_or_path} ({config.family}, "
                f"{sum(int(np.prod(p.shape)) for p in parameters):,} parameters on rank 0) with {name} on "
                f"{layout.world_size} {device} process(es), global batch {train_plan.global_batch_size} x "
                f"{args.max_seq_length} tokens{resumed}")

    # 5. The loop: step, check, log, evaluate, save; stop on divergence, a signal or exit_interval.
    heartbeat = Heartbeat(layout.rank)
    heartbeat.watch_for_hangs(layout.world_size, args.output_dir, args.hang_timeout_minutes, start_step)
    run.callback(heartbeat.stop_watching)
    OWN_TIME.gpu = device == "gpu"
    replicas, replica_checks = None, 0  # what the last replica check compared (llm_pretrain/checkpoint/replica_check.py)
    gpu = device == "gpu"  # GPU kernels are not deterministic by construction: resynchronize, never fail
    divergence = DivergenceGuard(args.skip_nan_inf_steps)
    spikes, data_skips = LossSpikeGuard.from_args(args, state), DataSkips(args.skip_data_intervals, state)
    events = {"loss_spikes": 0, "spike_skipped_steps": 0, "rollbacks": 0, "data_skipped_steps": 0}
    step = start_step
    prefetcher = BatchPrefetcher(train_plan, train_data, config.vocab_size, device)
    run.callback(prefetcher.close)
    while args.do_train and step < args.max_steps:
        learning_rate = optimizer.get_lr()
        step_start = time.perf_counter()
        OWN_TIME.start()
        following = consumed_samples + train_plan.global_batch_size if step + 1 < args.max_steps else None
        skipping_data = data_skips.covers(step + 1)
        threshold = spikes.threshold()
        wait_start = time.perf_counter()
        batches = None if skipping_data else prefetcher.get(consumed_samples, following)
        data_wait = time.perf_counter() - wait_start
        try:
            if skipping_data:  # no step, only the stop request and the pending write to agree on
                stop_requested, write_pending = agree_flags([stop.requested, checkpointer.write_pending()], layout)
                result = StepResult(math.nan, None, None, stop_requested, False, write_pending=write_pending)
            else:
                result = train_step(model, optimizer, schedule, precision, batches, parameters, clip_grad_norm, layout, stop.requested,
                                    threshold if spikes.drops_update else None, checkpointer.write_pending())
        except (RuntimeError, OSError) as error:
            if not layout.distributed:
                raise
            traceback.print_exc()  # in case it is a bug rather than a lost peer
            raise RunError(heartbeat.describe_failure(layout.world_size, step, error)) from error
        if device == "gpu":
            paddle.device.synchronize()
        step_time = time.perf_counter() - step_start
        timing = {"own_time": OWN_TIME.seconds(), "data_wait": data_wait}
        step += 1
        consumed_samples += train_plan.global_batch_size
        heartbeat.beat(step)
        if checkpointer.pending and not result.write_pending:  # every rank's write has ended: finalize it
            log_completed_save(checkpointer.complete_pending(), step, metrics)

        spike = threshold is not None and not result.nonfinite and result.agreed_loss > threshold
        if skipping_data:
            events["data_skipped_steps"] += 1
            metrics.write({"event": "skipped_data", "step": step,
                           "samples": sample_range(step, step, train_plan.global_batch_size)})
        elif result.nonfinite:  # the update was not applied; stop (exit code 3) unless skips are allowed
            metrics.say(divergence.skip_or_stop(step, result))
            metrics.write({"event": "skipped", "step": step, "nonfinite": result.nonfinite})
        elif spike:
            events["loss_spikes"] += 1
            metrics.write({"event": "loss_spike", "step": step, "loss": result.agreed_loss, "threshold": threshold,
                           "action": spikes.action})
            what = (f"step {step}: loss spike, loss {result.agreed_loss:.4f} above {threshold:.4f} "
                    f"(loss_spike_factor {args.loss_spike_factor} x the mean of the last {args.loss_spike_window})")
            if spikes.action == "stop":
                raise DivergenceError(f"{what}; stopped without saving this state (loss_spike_action stop)")
            if spikes.action == "rollback":
                with heartbeat.phase("rollback"):
                    log_completed_save(checkpointer.complete_pending(), step, metrics)
                    step, consumed_samples = roll_back(step, checkpointer, unwrapped_model, optimizer, precision,
                                                       args, train_plan, spikes, data_skips, metrics, what)
                events["rollbacks"] += 1
                divergence.reset()
                continue
            if spikes.action == "skip":
                events["spike_skipped_steps"] += 1
                metrics.say(f"warning: {what}; update skipped (loss_spike_action skip)")
            else:
                metrics.say(f"warning: {what}")
                metrics.step(step, result.loss, result.grad_norm, learning_rate, step_time, consumed_samples, **timing)
        else:
            spikes.observe(result.agreed_loss)
            divergence.reset()
            if not result.optimizer_stepped:
                metrics.say(f"warning: step {step}: the fp16 loss scale overflowed; the optimizer step and the LR "
                            "schedule were skipped on every rank")
            metrics.step(step, result.loss, result.grad_norm, learning_rate, step_time, consumed_samples,
                         router_metrics=getattr(unwrapped_model, "router_metrics", None), **timing)

        if args.do_eval and valid_data is not None and step % args.effective_eval_steps == 0:
            with heartbeat.phase("evaluation"):
                metrics.evaluation("valid", step, run_evaluation(model, valid_data, "valid", step, eval_plan, args,
                                                                 config, layout, precision))

        stopping = result.stop_requested and step < args.max_steps
        if checkpointer.due(step, args.max_steps) or stopping:
            trainer_state = {"global_step": step, "consumed_samples": consumed_samples,
                             "layout": layout_summary(layout), "args": arguments_to_dict(args),
                             "model_config": config.architecture_dict(), **spikes.state(), **data_skips.state()}
            save_start = time.perf_counter()
            with heartbeat.phase("save"):
                log_completed_save(checkpointer.complete_pending(), step, metrics)  # at most one save in flight
                if checkpointer.async_save and not stopping and not checkpointer.exit_due(step, args.max_steps):
                    checkpointer.save_async(step, unwrapped_model, optimizer, trainer_state, precision.scaler)
                else:
                    checkpointer.save(step, unwrapped_model, optimizer, trainer_state, precision.scaler)
            if checkpointer.async_save:  # how long this save held training up
                metrics.write({"event": "save", "step": step, "async": checkpointer.pending is not None,
                               "stall_s": time.perf_counter() - save_start})
        if stopping:
            stop.stopped = True
            metrics.say(f"stopped at step {step} ({stop.signal_name or 'signal on another rank'}), "
                        f"checkpoint-{step} saved; run the same command to resume")
            break
        if checkpointer.exit_due(step, args.max_steps):
            metrics.say(f"stopping after step {step} (exit_interval); run the same command again to resume")
            break
        if args.check_replicas_interval and step % args.check_replicas_interval == 0 and step < args.max_steps:
            with heartbeat.phase("replica check"):
                replicas = check_replicas(unwrapped_model, optimizer, layout, step, resynchronize_differences=gpu)
            replica_checks += 1

    with heartbeat.phase("save"):
        log_completed_save(checkpointer.complete_pending(), step, metrics)  # the last save, finished before the end
    # Every replicated weight and optimizer state the same on every rank (they are saved once).
    if step > start_step:
        with heartbeat.phase("replica check"):
            replicas = {**check_replicas(unwrapped_model, optimizer, layout, step, resynchronize_differences=gpu),
                        "checks": replica_checks + 1}
    if args.do_predict and test_data is not None:
        with heartbeat.phase("evaluation"):
            metrics.evaluation("test", step, run_evaluation(model, test_data, "test", step, eval_plan, args, config,
                                                            layout, precision))
    if args.last_save_in_hf and layout.is_main and step == args.max_steps and step > start_step:
        # After every collective (other ranks need not wait): the final checkpoint, saved in the loop.
        from llm_pretrain.checkpoint.hf_export import export_final_checkpoint
        metrics.say(export_final_checkpoint(args.output_dir, step))
    return metrics.finish(**({"replica_check": replicas} if replicas else {}), **resilience_summary(events))


def roll_back(step: int, checkpointer: Checkpointer, model, optimizer, precision: Precision, args: Arguments,
              plan: BatchPlan, spikes: LossSpikeGuard, data_skips: DataSkips, metrics, what: str) -> tuple[int, int]:
    """loss_spike_action rollback: reload the newest complete checkpoint (weights, optimizer, RNG, the
    spike window) and skip the data from it to the spike plus loss_spike_skip_steps. Returns the
    checkpoint's (global step, consumed samples)."""
    latest = ckpt.latest_checkpoint(args.output_dir)
    if latest is None:
        raise DivergenceError(f"{what}; no checkpoint to roll back to (loss_spike_action rollback)")
    state = checkpointer.load(latest, model, optimizer, precision.scaler)
    first, last = state["global_step"] + 1, step + args.loss_spike_skip_steps
    spikes.losses.clear()
    spikes.losses.extend(state.get("loss_spike_window_losses", []))
    metrics.drop_unlogged_steps()
    data_skips.rollbacks = DataSkips(trainer_state=state).rollbacks
    data_skips.add_rollback(first, last)
    samples = sample_range(first, last, plan.global_batch_size)
    metrics.write({"event": "rollback", "step": step, "checkpoint": os.path.basename(latest),
                   "skipped_steps": [first, last], "skipped_samples": samples})
    metrics.say(f"warning: {what}; rolled back to {os.path.basename(latest)}, skipping the data of steps {first} "
                f"to {last} (samples {samples[0]} to {samples[1] - 1}) (loss_spike_action rollback)")
    return state["global_step"], state["consumed_samples"]


def agree_flags(flags: list[bool], layout: Layout) -> list[bool]:
    """Boolean flags max-reduced over all ranks (one collective), for steps that run no train_step."""
    if not layout.distributed:
        return flags
    import paddle.distributed as dist

    tensor = paddle.to_tensor([float(flag) for flag in flags], dtype="float32")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(value) for value in tensor.numpy()]


def log_completed_save(pending, step: int, metrics) -> None:
    """The train_log record of an asynchronous save that has just been finalized."""
    if pending is not None:
        metrics.write({"event": "save_completed", "step": pending.step, "completed_at_step": step,
                       "host_copy_mb": pending.host_bytes / 2**20})


def resilience_summary(events: dict) -> dict:
    """The summary's counts of spikes, skips and rollbacks (only those that happened)."""
    return {key: count for key, count in events.items() if count}


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
