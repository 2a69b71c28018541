"""Everything a run decides before fleet.init, in the order it is decided; the result is one RunPlan.

    check_run(args, ...)       nothing here imports Paddle, so a bad input is one line `error: ...`
                               and nothing else (Paddle prints on import):
        device                 the `device` argument, else Paddle's own default (gpu when the build
                               has CUDA) read from the installed build without importing it
                               (llm_pretrain/cpu/threads.py paddle_build)
        layout, model          plan_layout, build_model_config, check_model_fits_layout, check_strategy
                               (validity is decided by llm_pretrain/parallel/layout.py; the planner runs the same
                               check_layout_and_model)
        startup checks         tokenizer, split, sequence length, activations against the CPU's memory
        data                   check_data_inputs, then check_data_integrity (reads every file once, cached)
    prepare_run(plan)          what needs Paddle or claims something, after every check passed:
        cpu defaults           threads and MKL's fast path, set before Paddle loads (cpu_threads.py);
                               the note goes into the run record
        Paddle                 imported, the device set; on GPU the activation floor against the card
        prediction             the planner's estimate (run record; a warning on GPU when it does not fit)
        output_dir             rank 0 takes the lock (one run per output_dir)
        resume                 the newest intact checkpoint and whether it is of this model
        collective timeout     PADDLE_PG_TIMEOUT on GPU

`plan_run` is both; llm_pretrain/run_pretrain.py hands its RunPlan to llm_pretrain/run/trainer.py train().
Every mistake is a one-line UsageError (exit code 2) raised before fleet.init.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from llm_pretrain.arguments import Arguments, arguments_to_dict
from llm_pretrain.cpu.standin_switch import STANDIN_OPTIONS, kernel_standins_requested
from llm_pretrain.cpu.threads import apply_cpu_defaults, import_paddle, paddle_build
from llm_pretrain.data import check_data_inputs, parse_split
from llm_pretrain.data.integrity import check_data_integrity
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.layout import Layout, check_layout_and_model
from llm_pretrain.planner import estimate_setup, setup_from
from models.config import ModelConfig

GPU_ONLY_OPTIONS = {
    "bf16": "Paddle's CPU build has no bfloat16 kernels",
    "fp16": "Paddle's CPU build has no float16 kernels",
    "use_flash_attention": "flash attention is a GPU kernel",
    "use_fused_rms_norm": "the fused RMSNorm is a GPU kernel",
    "use_fused_rope": "the fused rotary embedding is a GPU kernel",
    "use_fast_layer_norm": "the fast LayerNorm is a GPU kernel",
}

# Above this the run is refused even when no memory estimate is possible (the longest contexts
# pretrained today are 128K-1M tokens; PaddleNLP's presets stop at 32K).
MAX_SEQ_LENGTH_CEILING = 1 << 20


@dataclass
class RunPlan:
    """One run as the preflight decided it: what train() needs, nothing derived again later."""

    args: Arguments
    args_file: str | None  # the argument file, for the run record
    device: str  # "cpu" or "gpu"
    layout: Layout  # the degrees; this process's ranks are filled in by fleet.init (init_distributed)
    config: ModelConfig  # the architecture with the run's overrides and runtime options
    weights_file: str | None  # continue_training: the weights to load; None: a random initialization
    warnings: list[str]  # printed once by rank 0 after fleet.init (arguments, GPU-only options, model, resume)
    cpu_defaults: str | None = None  # the `cpu defaults: ...` note (llm_pretrain/cpu/threads.py), or None
    prediction: dict = field(default_factory=dict)  # the planner's estimate of this run (the run record)
    resume_candidates: list[str] = field(default_factory=list)  # checkpoints to resume from, newest first
    resume_index: int = 0  # the newest candidate this rank found intact (the ranks agree after fleet.init)
    output_dir_lock: object | None = None  # rank 0's llm_pretrain.checkpoint.checkpointer.OutputDirLock, held for the run
    elastic: dict | None = None  # elastic: the layout change made for the ranks present (adapt_to_the_ranks_present)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def plan_run(args: Arguments, argument_warnings: list[str], args_file: str | None = None) -> RunPlan:
    """The whole preflight: every check first (no Paddle), then what needs Paddle or claims something."""
    return prepare_run(check_run(args, argument_warnings, args_file))


# ----------------------------------------------------------------------------- checks (no Paddle)
def check_run(args: Arguments, argument_warnings: list[str], args_file: str | None = None) -> RunPlan:
    """Every check of the run that needs no Paddle; UsageError for the first thing that is wrong."""
    device = choose_device(args)
    elastic = None
    if args.elastic and args.do_train:
        args, elastic = adapt_to_the_ranks_present(args, launcher_world_size(), device)
    layout, config, weights_file, model_notes = check_layout_and_model(args, launcher_world_size(), device)
    check_startup(args, config, layout, device)
    check_data_inputs(args.input_dir, args.split)
    # The integrity passes read every .idx and .bin once (then cached): one process per node does them.
    check_data_integrity(args.input_dir, config.vocab_size, args.data_cache,
                         thorough=os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")) == "0")
    warnings = argument_warnings + gpu_only_warnings(args, device) + model_notes
    return RunPlan(args, args_file, device, layout, config, weights_file, warnings, elastic=elastic)


def newest_checkpoint_state(args: Arguments) -> tuple[str, dict] | None:
    """(path, trainer_state) of the checkpoint a resume would start from, read without Paddle (the
    preflight's checks run before it is imported): resume_from_checkpoint, else the newest complete
    checkpoint-N in output_dir whose trainer_state.json reads (the same complete-checkpoint rule as
    llm_pretrain/checkpoint/checkpointer.py complete_checkpoints, which imports Paddle)."""
    import json
    import re

    if args.overwrite_output_dir and not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint:
        paths = [args.resume_from_checkpoint]
    elif os.path.isdir(args.output_dir):
        steps = [(int(m.group(1)), name) for name in os.listdir(args.output_dir)
                 if (m := re.fullmatch(r"checkpoint-(\d+)", name))]
        paths = [os.path.join(args.output_dir, name) for _, name in sorted(steps, reverse=True)]
    else:
        paths = []
    for path in paths:
        if not os.path.isfile(os.path.join(path, "COMPLETE")):
            continue
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                state = json.load(f)
            state["layout"]["world_size"], state["args"]["per_device_train_batch_size"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # damaged: the resume falls back to an older one (find_resume), and so does this
        return path, state
    return None


def adapt_to_the_ranks_present(args: Arguments, world_size: int, device: str) -> tuple[Arguments, dict | None]:
    """elastic: when the ranks present differ from those that wrote the checkpoint being resumed, or the
    argument file's degrees cannot use them, the layout the planner's rule picks for them keeping the
    checkpoint's global batch (llm_pretrain/planner/elastic.py continue_on); one line on rank 0 says what
    changed and why. Returns the arguments to run with and the record of the change (None: no change)."""
    chosen, record = elastic_arguments(args, world_size, device)
    if record and launcher_rank() == 0:
        print(record["line"], flush=True)
    return chosen, record


def fits_this_host(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> None:
    """What the preflight can say about memory before Paddle is imported (a GPU's memory is read only
    after: there the check at start is the layout's; prepare_run warns on the planner's estimate)."""
    if device != "gpu":
        check_activation_memory(args, config, layout, device)


def elastic_arguments(args: Arguments, world_size: int, device: str) -> tuple[Arguments, dict | None]:
    """adapt_to_the_ranks_present without the line (llm_pretrain/launch.py asks it for each count of
    ranks it could restart on). When no layout holds the run on `world_size` ranks, the UsageError
    names the smallest number of ranks that does (smallest_holding)."""
    from llm_pretrain.planner.elastic import continue_on, describe_change

    try:
        layout, config, _, _ = check_layout_and_model(args, world_size, device)
        fits_this_host(args, config, layout, device)
        file_fits = True
    except UsageError as error:
        file_fits, file_refusal = False, str(error)
    resumed = newest_checkpoint_state(args)
    writers = resumed[1]["layout"]["world_size"] if resumed else None
    if file_fits and writers in (None, world_size):
        return args, None
    global_batch = None
    if resumed:
        saved_args, saved_layout = resumed[1]["args"], resumed[1]["layout"]
        global_batch = (saved_args["per_device_train_batch_size"] * saved_args["gradient_accumulation_steps"]
                        * saved_layout["data_parallel_degree"] * saved_layout.get("sharding_degree", 1))
    if writers not in (None, world_size):
        why = f"{os.path.basename(resumed[0])} was written by {writers} ranks, {world_size} are present"
    else:
        why = f"the argument file's degrees do not fit {world_size} ranks ({file_refusal})"
    try:
        chosen, changes = continue_on(args, world_size, global_batch, device, fits=fits_this_host)
    except UsageError as error:
        smallest = smallest_holding(args, global_batch, device, max(world_size, writers or 1) * 2)
        where = (f"the smallest number of ranks that holds it is {smallest}" if smallest else
                 f"no number of ranks up to {max(world_size, writers or 1) * 2} holds it")
        raise UsageError(f"{error}; {where}; nothing was changed (the checkpoints are as they were)") from None
    if global_batch is None:
        global_batch = chosen.per_device_train_batch_size * chosen.gradient_accumulation_steps * \
            check_layout_and_model(chosen, world_size, device)[0].data_replicas
    line = describe_change(changes, world_size, why, global_batch)
    return chosen, {"reason": why, "changes": changes, "world_size": world_size, "written_by": writers,
                    "checkpoint": resumed[0] if resumed else None, "global_batch_size": global_batch, "line": line}


def smallest_holding(args: Arguments, global_batch: int | None, device: str, up_to: int) -> int | None:
    """The smallest number of ranks (1..up_to) on which the elastic rule finds a layout that holds the run
    and keeps `global_batch`; None when there is none."""
    from llm_pretrain.planner.elastic import continue_on

    for world_size in range(1, up_to + 1):
        try:
            continue_on(args, world_size, global_batch, device, fits=fits_this_host)
            return world_size
        except UsageError:
            continue
    return None


def launcher_world_size() -> int:
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def launcher_rank() -> int:
    """This process's global rank as the launcher numbers it (known before fleet.init)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def choose_device(args: Arguments) -> str:
    """'cpu' or 'gpu': the `device` argument, else Paddle's default (gpu when the build has CUDA or ROCm).

    The build is read from its version file without importing Paddle (cpu_threads.paddle_build;
    tests/test_cpu_threads.py checks it agrees with paddle.is_compiled_with_cuda)."""
    built_for_gpu = paddle_build()["gpu"]
    device = args.device or ("gpu" if built_for_gpu else "cpu")
    if device == "gpu" and not built_for_gpu:
        raise UsageError("device: 'gpu' was requested but this Paddle build has no CUDA; use device 'cpu'")
    return device


def gpu_only_warnings(args: Arguments, device: str) -> list[str]:
    """On CPU, GPU-only options run the plain float32 path; say so once each."""
    if device == "gpu":
        return []
    # With the kernel stand-ins (LLM_PRETRAIN_KERNEL_STANDINS=1) the kernel options take effect on CPU.
    kept = STANDIN_OPTIONS if kernel_standins_requested(device) else ()
    return [f"{key} has no effect on CPU ({why}); training in plain float32"
            for key, why in GPU_ONLY_OPTIONS.items() if getattr(args, key) and key not in kept]


def looks_like_a_path(name: str) -> bool:
    """A local path rather than a hub/registry name such as "facebook/llama-7b" or "llama-tiny"."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1
            or name.endswith((".model", ".json", ".txt")))


def check_startup(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> None:
    """Values that would fail late (after the model and data are built, or in the OOM killer).

    The activation floor needs the device's memory: the CPU's is read here, a GPU's only once
    Paddle is loaded (prepare_run)."""
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
    if args.last_save_in_hf:  # the family must have a Hugging Face class that can express the model
        from llm_pretrain.checkpoint.hf_export import check_exportable
        check_exportable(config)
    if args.loss_spike_factor and args.loss_spike_action == "skip" and layout.pipeline_parallel_degree > 1:
        raise UsageError("loss_spike_action: skip is not available with pipeline_parallel_degree > 1 (fleet's "
                         "train_batch applies the update before the loss is known); use rollback, which reloads "
                         "the checkpoint and so discards that update, or warn/stop")
    if args.max_seq_length > MAX_SEQ_LENGTH_CEILING:
        raise UsageError(f"max_seq_length: {args.max_seq_length} is above the ceiling {MAX_SEQ_LENGTH_CEILING}")
    if device != "gpu":
        check_activation_memory(args, config, layout, device)


def device_memory_bytes(device: str) -> int:
    if device == "gpu":
        import paddle

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


def check_activation_memory(args: Arguments, config: ModelConfig, layout: Layout, device: str) -> None:
    need, have = activation_floor_bytes(args, config, layout, device), device_memory_bytes(device)
    if need > have:
        raise UsageError(f"max_seq_length: {args.max_seq_length} cannot fit: one micro-batch of "
                         f"{args.per_device_train_batch_size} needs at least {need / 2**30:.1f} GiB of activations "
                         f"(logits and attention scores) and the {device} has {have / 2**30:.1f} GiB; lower "
                         "max_seq_length or per_device_train_batch_size")


# ----------------------------------------------------------------------------- after the checks (Paddle)
def prepare_run(plan: RunPlan) -> RunPlan:
    """Set up and claim what the checked run needs before fleet.init; fills in the rest of the plan."""
    args, device = plan.args, plan.device
    plan.cpu_defaults = apply_cpu_defaults(device)  # before Paddle loads (it reads them when imported)
    import_paddle()
    set_paddle_device(device)
    if kernel_standins_requested(device):  # a testing aid: the GPU kernels' branches on CPU
        from llm_pretrain.cpu.kernel_standins import install_kernel_standins

        install_kernel_standins()
    if device == "gpu":
        check_activation_memory(args, plan.config, plan.layout, device)
    plan.prediction = predict_run(args, plan.layout, plan.config, device)
    if device == "gpu" and plan.prediction.get("fits") is False:
        warn(memory_warning(plan.prediction))
    if launcher_rank() == 0:
        plan.output_dir_lock = take_output_dir(args)  # the lock: one run per output_dir
    try:
        if args.do_train:
            plan.resume_index, plan.resume_candidates = find_resume(args, plan.layout.world_size)
        if plan.resume_candidates[plan.resume_index:]:
            plan.warnings += check_checkpoint_matches(plan.resume_candidates[plan.resume_index], plan.layout,
                                                      plan.config, args)
    except BaseException:
        if plan.output_dir_lock is not None:
            plan.output_dir_lock.release()
        raise
    set_collective_timeout(args, device)
    return plan


def set_paddle_device(device: str) -> None:
    import paddle

    if device == "gpu":
        local_gpu = os.environ.get("FLAGS_selected_gpus", "0").split(",")[0]
        paddle.set_device(f"gpu:{local_gpu}")
    else:
        paddle.set_device("cpu")


def device_name(device: str) -> str:
    """The accelerator's name for reports (the peak-TFLOPs lookup uses it): "NVIDIA A100-SXM4-80GB", "cpu"."""
    if device != "gpu":
        return "cpu"
    import paddle

    return paddle.device.cuda.get_device_name()  # the current device, this rank's


def predict_run(args: Arguments, layout: Layout, config: ModelConfig, device: str) -> dict:
    """The planner's estimate of this run (llm_pretrain/planner), for the run record and the memory warning.

    A planner failure must not stop a valid run: it is recorded as {"error": ...} instead."""
    try:
        name = device_name(device) if device == "gpu" else "cpu"
        result = estimate_setup(setup_from(args, layout, config, device), name)
    except Exception as error:  # noqa: BLE001 -- recorded, never silent
        return {"error": f"{type(error).__name__}: {error}"}
    if device == "gpu":
        import paddle

        total = paddle.device.cuda.get_device_properties().total_memory / 2**20  # this rank's GPU (current)
        result["device_memory_mb"] = total
        result["fits"] = result["peak_mem_reserved_mb"] <= total
    keys = ("peak_mem_allocated_mb", "peak_mem_reserved_mb", "async_save_host_mb", "device_memory_mb", "fits", "peak_rank", "peak_phase",
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


def take_output_dir(args: Arguments):
    """Rank 0, before any work: output_dir created and writable, locked, debris of crashed saves removed."""
    from llm_pretrain.checkpoint import checkpointer as ckpt

    try:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = ckpt.OutputDirLock(args.output_dir).acquire()
    except OSError as error:
        raise UsageError(f"output_dir: cannot create or write {args.output_dir} "
                         f"({error.strerror or error})") from None
    for name in ckpt.remove_stale_partials(args.output_dir):
        warn(f"removed {os.path.join(args.output_dir, name)} (left by an interrupted save)")
    return lock


def find_resume(args: Arguments, world_size: int) -> tuple[int, list[str]]:
    """The checkpoint candidates (newest first) and the index of the newest one this rank found intact.

    resume_from_checkpoint names one checkpoint (no fallback); otherwise every complete
    checkpoint in output_dir is a candidate (none with overwrite_output_dir). Damaged ones
    are one warning each, naming the file. The ranks agree after fleet.init (agree_on_checkpoint).
    """
    from llm_pretrain.checkpoint import checkpointer as ckpt

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
    any layout may resume it (llm_pretrain/checkpoint/dist_checkpoint.py). Returns a warning listing the other
    keys that changed (learning rate, steps, seed, degrees ...)."""
    from llm_pretrain.checkpoint import checkpointer as ckpt
    from llm_pretrain.checkpoint.dist_checkpoint import check_resumable

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
        "sharding_degree", "sharding_stage", "virtual_pp_degree", "sep_parallel_degree",
        "context_parallel_degree")}


def set_collective_timeout(args: Arguments, device: str) -> None:
    """distributed_timeout_minutes on GPU: ProcessGroupNCCL is created with PADDLE_PG_TIMEOUT (milliseconds;
    read at paddle/distributed/parallel.py:747, passed at paddle/distributed/collective.py:176), so a hung
    rank ends the job in bounded time. gloo (CPU) takes no such timeout."""
    if device == "gpu" and args.distributed_timeout_minutes:
        os.environ["PADDLE_PG_TIMEOUT"] = str(int(args.distributed_timeout_minutes * 60_000))
