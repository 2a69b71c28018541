"""The GPU self-check's rows: what scripts/gpu_selfcheck.py runs, how each row is judged and reported.

A row is one claim about a production run, checked on the user's GPUs (or, for the fp32 layout
rows, on CPU processes too):

    parity      a layout (dp2, tp2_sp, pp2, sd2 stages 1-3, tp2 x sd2 stage 2, ...) trains like
                one process with the same options: fp32 within 1e-5 (per-step loss, grad norm,
                final weights); bf16 O2 with amp_master_grad, flash attention and the fused rope,
                RMSNorm and swiglu kernels (sep2 and cp2: flash attention in the all-to-all's local
                attention and in every block of the ring), and bf16 O1, within a bound derived from
                bf16's precision. Each layout run stops with a checkpoint after SAVE_STEP and resumes.
    overflow    fp16 O2 with loss scaling; an infinite gradient on rank 1 alone at step 2: every
                rank skips that optimizer step and keeps the same loss scale.
    checkpoint  one process, bf16 O2: stopped after SAVE_STEP and resumed (fp32 master weights,
                moments, loss scaler state) continues like the uninterrupted run.
    rollback    one process, bf16 O2: a loss spike injected as garbage data rolls back to the checkpoint
                and skips that data; from there it equals the run that skipped that data (SPIKE).
    kernels     each fused kernel against the plain path on random inputs, forward and
                gradients, within a bound derived from the dtype (printed).
    memory      the planner's prediction beside max_memory_allocated / max_memory_reserved.
    speed       tokens/card/s beside the planner's prediction.

The one-GPU tier (`plan_rows(device, tier="one-gpu")`: a node with one visible GPU, or --gpus 1), every
row one process:

    family      each model family (models.families.FAMILY_NAMES) in bf16 O2 + amp_master_grad + flash
                + fused kernels against its own float32 run, within FAMILY_LOSS_BAND
    overflow    fp16 O2 with an infinite gradient injected at step 2 in one launched process
    checkpoint  the O2 round trip, and the same with async_save (the resume reads what the writer
                thread wrote) against the uninterrupted synchronous run
    rollback    the loss-spike rollback row, as in the full plan
    kernels     the kernel table in bf16 and in fp16
    ring        cp2 and cp4 as threads on the GPU (llm_pretrain/selfcheck/ring_threads.py): flash blocks
                against one whole attention, causal with grouped kv heads, without and with ALiBi
    perf        TinyLlama 1.1B at 4,096 tokens: tokens/s, MFU and max_memory_allocated beside the
                planner's prediction for the same arguments

`plan_rows(device)` is the list of rows (`--print-plan --json` prints it; a CPU test checks it).
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from llm_pretrain.selfcheck.parity import (
    LAYOUTS, SAVE_STEP, TOLERANCE, argv, final_weights, run_launch, run_record, run_single, summary_records,
    train_records,
)

# Argument keys of a production run on GPU, as PaddleNLP's llama pretraining configs set them
# (llm/config/llama/pretrain-*.json of PaddleNLP 2.8.1: bf16, fp16_opt_level O2, amp_master_grad,
# use_flash_attention, use_fused_rope, use_fused_rms_norm). The fused swiglu has no key: the trainer
# uses it whenever the device is a GPU, as PaddleNLP's LLaMA does (llm_pretrain/run/trainer.py build_model_config).
KERNEL_OPTIONS = {"use_flash_attention": True, "use_fused_rope": True, "use_fused_rms_norm": True}
PRECISIONS = {
    "fp32": {},
    "bf16-o2": {"bf16": True, "fp16_opt_level": "O2", "amp_master_grad": True, **KERNEL_OPTIONS},
    "bf16-o1": {"bf16": True, "fp16_opt_level": "O1", **KERNEL_OPTIONS},
    # scale_loss 1024 rather than PaddleNLP's 32768: at 32768 the first steps of a fresh model may
    # overflow by themselves; the row is about the injected overflow.
    "fp16-o2": {"fp16": True, "fp16_opt_level": "O2", "amp_master_grad": True, "scale_loss": 1024, **KERNEL_OPTIONS},
}
DTYPE_OF = {"fp32": "fp32", "bf16-o2": "bf16", "bf16-o1": "bf16", "fp16-o2": "fp16"}
# sep2 and cp2: the local attention of Ulysses and each block of the ring run the flash kernel
# (models/ring_attention.py FlashBlocks), checked nowhere else against one process.
# The later ones (issue 33, finding 10): tp x cp, the interleaved and the uneven pipeline, async_save (the resume
# reads what the writer thread wrote), and a MoE (mixtral-real) with its experts over the data replicas and over
# sharding (amp_master_grad on: the experts' optimizer reads main_grad).
PRODUCTION_LAYOUTS = ("dp2", "tp2_sp", "pp2", "sd2_stage1", "sd2_stage2", "sd2_stage3", "tp2sd2_stage2", "sep2", "cp2",
                      "tp2cp2", "pp4vpp2", "pp3_uneven", "dp2_async_save", "ep2", "ep2sd2_stage1")
O1_LAYOUT = "tp2"
OVERFLOW = {"layout": "sd2_stage1", "rank": 1, "step": 2}
PERF_LAYOUTS = ("tp2sd2_stage2", "sd2_stage2")  # the first one the node has GPUs for
PERF_STEPS = 12

# Relative bounds of a half-precision run against one process with the same options. bf16 keeps 8
# significant bits: one rounding moves a value by up to 2**-9 relative, one unit in the last place
# is 2**-8. A layout computes the same sums in another order (tensor-parallel partial products
# rounded to bf16 before their all-reduce, sharded or data-parallel gradient sums, accumulation
# over fewer micro-batches), so each matrix product and reduction may land one unit away; the
# float32 loss and master weights do not round further. Four units (2**-6, 1.6 %) cover the per-step
# loss and grad norm of the 4 steps of llama-real here. fp16 keeps 11 bits: four units are 2**-8.
# These bounds are reasoned, not measured: no GPU has run them in this project.
HALF_RELATIVE_BOUND = {"bf16": 2.0**-6, "fp16": 2.0**-8}
# The kernel table: both paths round their outputs to the dtype (one unit each, 2**-8 in bf16),
# the plain path also its intermediates (RMSNorm: square, mean, rsqrt, scale; attention: scores,
# softmax, weighted sum; swiglu: silu, product; rope: two products and a sum): four units of the
# largest reference magnitude.
KERNEL_RELATIVE_BOUND = {"bfloat16": 4 * 2.0**-8, "float16": 4 * 2.0**-10, "float32": 1e-5}
# ----------------------------------------------------------------------------- the one-GPU tier
TIERS = ("full", "one-gpu")
# The preset each family trains in its row: the real-size LLaMA and Mixtral (hidden 1024, head_dim 128 as the
# published models', the MLP and experts above Paddle's slicing thresholds), the tiny preset of every other
# family (head_dim 16; each family's own switches: norms, positions, biases, MoE routing, MLA).
FAMILY_PRESETS = {"llama": "llama-real", "mixtral": "mixtral-real"}
# bf16 O2 against float32 is not one sum order against another (the layout rows' HALF_RELATIVE_BOUND, four
# units of bf16): every matrix product's inputs, the residual stream, the attention and the norms are
# rounded to 8 significant bits, one unit 2**-8 each, and the loss (computed in float32 from bf16 logits)
# carries the sum of these roundings through both layers: about ln(vocabulary) x a few units at step 1.
# In the 3 later steps Adam moves each weight by about the learning rate in the sign of its gradient: for
# gradients near zero that sign differs between bf16 and float32, which moves the loss little (those weights
# barely change it, first order g x dw). In the MoE families a token whose top-2 experts nearly tie may pick
# another expert in bf16: a few of a step's 128 tokens, with experts that start alike. Sixteen units
# (2**-4, 6.25 %) per step covers these with a margin of about 4 over the forward's rounding and still fails
# a kernel that scales, masks or normalizes wrongly (the kernel and ring rows bound each kernel more tightly).
# The grad norm and final weights are reported, not judged (the norm sums squared bf16 gradients, the weights
# differ by the sign flips above). Reasoned, not measured: no GPU has run it in this project.
FAMILY_LOSS_BAND = 2.0**-4
# fp16 O2 in one launched process: the injection of parity_worker.py on rank 0, the only rank.
ONE_PROCESS_OVERFLOW = {"rank": 0, "step": OVERFLOW["step"]}
# async_save does not change the training, only when the files are written: a round trip with it is judged
# against the uninterrupted run with synchronous saves (the reference leaves the key out).
ROUND_TRIP_KEYS = ("async_save",)
RING_DEGREES = (2, 4)
# The speed and memory row: a LLaMA of about 1B parameters (TinyLlama 1.1B, models/families/llama.py) at
# 4,096 tokens (above its 2,048 positions: rotary positions extend, layout.py notes it), one sample per step,
# PERF_STEPS steps (the first ones, warm-up, excluded by the trainer's summary), no checkpoint.
PERF_MODEL = {"model_name_or_path": "TinyLlama/TinyLlama_v1.1", "num_hidden_layers": 22, "max_seq_length": 4096,
              "gradient_accumulation_steps": 1, "max_steps": PERF_STEPS, "save_steps": 10 * PERF_STEPS}

# The loss-spike rollback row (one process): garbage data (one unused token) at SPIKE["step"] makes a spike
# above factor x the mean of the window's losses; the run reloads checkpoint-SPIKE["save_steps"] and skips the
# data of the steps from it to the spike plus skip_steps, then trains on. Judged against the run that skips
# that data by skip_data_intervals from the start (tests/test_resilience.py proves both on CPU). The factor is
# low because the spike comes early: llama-tiny's garbage step is 1.07 x the window's mean at step 6 (float32,
# tests/test_gpu_selfcheck.py), llama-real's above 1.2; its normal steps fall below the mean.
SPIKE = {"step": 6, "max_steps": 9, "save_steps": 4, "window": 3, "factor": 1.05, "skip_steps": 1}


def rollback_options(dtype_options: dict) -> tuple[dict, dict]:
    """(the rollback run's options, its reference's): same precision and kernels, same steps and saves; the
    rollback run's input_dir is set by run_rows (the garbage copy); the reference skips the same data."""
    steps = {"max_steps": SPIKE["max_steps"], "save_steps": SPIKE["save_steps"], "save_total_limit": 2}
    skipped = [SPIKE["save_steps"] + 1, SPIKE["step"] + SPIKE["skip_steps"]]
    return ({**dtype_options, **steps, "loss_spike_factor": SPIKE["factor"], "loss_spike_window": SPIKE["window"],
             "loss_spike_action": "rollback", "loss_spike_skip_steps": SPIKE["skip_steps"]},
            {**dtype_options, **steps, "skip_data_intervals": json.dumps([skipped])})


def rollback_row(precision: str, device: str) -> Row:
    return Row(f"{precision}:loss-spike-rollback", "rollback", "single", 1, device, DTYPE_OF[precision],
               rollback_options(PRECISIONS[precision])[0], precision)


KERNEL_FLAGS = {"flash_attention": "use_flash_attention", "fused_rope": "use_fused_rope",
                "fused_rms_norm": "use_fused_rms_norm", "fused_swiglu": "use_fused_swiglu"}


@dataclass(frozen=True)
class Row:
    name: str
    kind: str                  # parity | overflow | checkpoint | rollback | kernels | memory | speed | family | ring | perf
    layout: str                # a name of parity.LAYOUTS, or "single"
    processes: int
    device: str
    dtype: str                 # fp32 | bf16 | fp16
    options: dict              # the argument keys the row's runs set (precision, kernels, layout degrees)
    precision: str = "fp32"    # a key of PRECISIONS: the one-process reference has the same
    notes: list = field(default_factory=list)  # why a production option is off in this row

    def to_json(self) -> dict:
        return asdict(self)


def layout_options(layout: str) -> dict:
    """The keys that make the layout (the one-process reference leaves them out)."""
    return dict(LAYOUTS[layout].overrides) if layout != "single" else {}


def shared_options(layout: str) -> dict:
    """The keys the layout's runs and their one-process reference both train with (the model, the batch)."""
    return dict(LAYOUTS[layout].shared) if layout != "single" else {}


def master_grad_refusal(layout: str) -> str | None:
    """Why the trainer refuses amp_master_grad under this layout (llm_pretrain/precision.check_master_grad), or None."""
    from types import SimpleNamespace

    from llm_pretrain.errors import UsageError
    from llm_pretrain.parallel.layout import plan_layout
    from llm_pretrain.parallel.precision import check_master_grad

    options = {**shared_options(layout), **layout_options(layout)}
    args = SimpleNamespace(amp_master_grad=True, bf16=True, fp16=False, fp16_opt_level="O2")
    try:
        check_master_grad(args, plan_layout(_layout_arguments(options), LAYOUTS[layout].nproc if layout != "single"
                                            else 1))
    except UsageError as error:
        return str(error)
    return None


def _layout_arguments(options: dict):
    from llm_pretrain.arguments import Arguments

    keys = ("tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree", "sharding",
            "sequence_parallel", "gradient_accumulation_steps", "virtual_pp_degree", "sep_parallel_degree",
            "context_parallel_degree", "expert_parallel_degree", "pipeline_layers_per_stage")
    return Arguments(**{k: v for k, v in options.items() if k in keys})


def production_row(kind: str, precision: str, layout: str, device: str, name: str | None = None) -> Row:
    options, notes = {**PRECISIONS[precision], **shared_options(layout), **layout_options(layout)}, []
    if options.get("amp_master_grad") and layout != "single":
        refusal = master_grad_refusal(layout)
        if refusal:
            options["amp_master_grad"] = False
            notes.append(f"amp_master_grad off: {refusal}")
    return Row(name or f"{precision}:{layout}", kind, layout, LAYOUTS[layout].nproc if layout != "single" else 1,
               device, DTYPE_OF[precision], options, precision, notes)


def one_gpu_rows(device: str) -> list[Row]:
    """The one-GPU tier: every row one process (see the module docstring)."""
    from models.families import FAMILIES

    rows = []
    for family, spec in FAMILIES.items():
        preset = FAMILY_PRESETS.get(family, spec.tiny)
        rows.append(Row(f"family:{family}", "family", "single", 1, device, "bf16",
                        {**PRECISIONS["bf16-o2"], "model_name_or_path": preset}, "bf16-o2",
                        [f"{preset} against its float32 run (same options without bf16 and the kernels)"]))
    rows.append(production_row("overflow", "fp16-o2", "single", device, name="fp16-o2-overflow:single"))
    rows.append(production_row("checkpoint", "bf16-o2", "single", device, name="bf16-o2:checkpoint-round-trip"))
    rows.append(rollback_row("bf16-o2", device))
    async_save = production_row("checkpoint", "bf16-o2", "single", device, name="bf16-o2:async-save-round-trip")
    rows.append(Row(**{**asdict(async_save), "options": {**async_save.options, "async_save": True}}))
    rows += kernel_rows(device)
    for degree in RING_DEGREES:
        rows.append(Row(f"ring:cp{degree}", "ring", "single", 1, device, "bf16", {"context_parallel_degree": degree,
                                                                                   "use_flash_attention": True},
                        "bf16-o2", [f"cp{degree} as threads of one process on one GPU (flash blocks)"]))
    perf = production_row("perf", "bf16-o2", "single", device, name="perf:bf16-o2:TinyLlama-1.1B:4096")
    rows.append(Row(**{**asdict(perf), "options": {**perf.options, **PERF_MODEL}}))
    return rows


def kernel_rows(device: str) -> list[Row]:
    """The kernel table in bf16 and in fp16."""
    note = ["fused swiglu: no argument key, on whenever the device is a GPU"]
    return [Row("kernels", "kernels", "single", 1, device, "bf16", {"bf16": True, **KERNEL_OPTIONS}, "bf16-o2", note),
            Row("kernels:fp16", "kernels", "single", 1, device, "fp16", {"fp16": True, **KERNEL_OPTIONS}, "fp16-o2",
                note)]


def plan_rows(device: str, layouts: list[str] | None = None, dtypes: list[str] | None = None,
              tier: str = "full") -> list[Row]:
    """The rows the self-check runs on `device`. On CPU: the fp32 layout rows only (Paddle's CPU build
    has no half-precision training kernels and none of the fused ones). tier "one-gpu": the one-GPU
    tier's rows (a GPU device). `layouts`/`dtypes` filter."""
    if tier == "one-gpu":
        rows = one_gpu_rows(device)
    else:
        rows = [production_row("parity", "fp32", name, device) for name in LAYOUTS]
    if device == "gpu" and tier == "full":
        rows += [production_row("parity", "bf16-o2", name, device) for name in PRODUCTION_LAYOUTS]
        rows.append(production_row("parity", "bf16-o1", O1_LAYOUT, device))
        rows.append(production_row("overflow", "fp16-o2", OVERFLOW["layout"], device,
                                   name=f"fp16-o2-overflow:{OVERFLOW['layout']}"))
        rows.append(production_row("checkpoint", "bf16-o2", "single", device, name="bf16-o2:checkpoint-round-trip"))
        rows.append(rollback_row("bf16-o2", device))
        rows += kernel_rows(device)
        for layout in PERF_LAYOUTS:
            rows.append(production_row("memory", "bf16-o2", layout, device, name=f"memory:bf16-o2:{layout}"))
            rows.append(production_row("speed", "bf16-o2", layout, device, name=f"speed:bf16-o2:{layout}"))
    if layouts is not None:
        rows = [r for r in rows if r.layout in layouts or r.layout == "single"]
    if dtypes is not None:
        rows = [r for r in rows if r.dtype in dtypes]
    return rows


# ----------------------------------------------------------------------------- running
def row_output(work_dir: Path, row_name: str) -> Path:
    return work_dir / "runs" / row_name.replace(":", "/")


def layout_output(work_dir: Path, layout: str, dtype: str) -> Path:
    """Where the fp32 (or other dtype's parity) run of a layout writes (tests/test_real_size.py reads it)."""
    precision = {"fp32": "fp32", "bf16": "bf16-o2", "fp16": "fp16-o2"}[dtype]
    return row_output(work_dir, f"{precision}:{layout}")


def reference_precision(row: Row) -> str:
    """A family row is judged against float32; every other row against its own precision."""
    return "fp32" if row.kind == "family" else row.precision


def reference_options(row: Row) -> dict:
    """The options of a row's one-process reference: the row's own, without its layout's degrees (an option
    the layout switched off, e.g. amp_master_grad under dp2 or sharding stage 3, is off there too) and
    without async_save (ROUND_TRIP_KEYS); a family row's: its model alone (float32, no kernel options)."""
    drop = set(layout_options(row.layout)) | set(ROUND_TRIP_KEYS)
    if row.kind == "family":
        drop |= set(PRECISIONS[row.precision])
    return {key: value for key, value in row.options.items() if key not in drop}


def reference_name(row: Row) -> str:
    """The reference's directory name: the precision, plus each option that differs from the precision's."""
    precision = reference_precision(row)
    options, usual = reference_options(row), PRECISIONS[precision]
    changed = sorted(key for key in set(options) | set(usual) if options.get(key) != usual.get(key))
    return precision + "".join(f"+{key}={options.get(key)}" for key in changed)


def reference_output(work_dir: Path, name: str) -> Path:
    return work_dir / "runs" / "single" / name


def spike_data(args_file: Path, work_dir: Path) -> str:
    """A copy of the row's corpus with garbage at SPIKE["step"] (parity.garbage_corpus), made once."""
    from llm_pretrain.selfcheck.parity import garbage_corpus, write_json

    work = work_dir / "runs" / "spike-data"
    if not (work / "garbage").is_dir():
        args = {**json.loads(Path(args_file).read_text()), "max_steps": SPIKE["max_steps"]}
        garbage_corpus({"input_dir": args["input_dir"]}, work, write_json(work / "args.json", args), [SPIKE["step"]])
    return str(work / "garbage")


def rollback_options_of(row: Row) -> dict:
    """The reference of a rollback row: the same run skipping the spike's data from the start."""
    steps = ("max_steps", "save_steps", "save_total_limit")
    return rollback_options({k: v for k, v in row.options.items() if not k.startswith("loss_spike_") and k not in steps})[1]


def rollback_reference(work_dir: Path, row: Row) -> Path:
    return reference_output(work_dir, f"{row.precision}+skip-spike-data")


def overflow_injection(row: Row) -> dict:
    """Where the overflow row injects its infinite gradient: rank 1 of a layout, the one process alone."""
    return dict(ONE_PROCESS_OVERFLOW) if row.processes == 1 else {"rank": OVERFLOW["rank"], "step": OVERFLOW["step"]}


def launch_key(row: Row) -> tuple:
    """Rows whose runs share one launch share this key (fleet's degrees); the overflow row launches alone."""
    degrees = LAYOUTS[row.layout].launch_key() if row.layout != "single" else (1, False, "{}")
    return (*degrees, row.kind == "overflow")


def run_rows(rows: list[Row], args_file: Path, work_dir: Path, device: str, gpus: int | None,
             timeout: int = 1200, say=print) -> list[dict]:
    """Run every row the node can run (rows needing more GPUs than `gpus` are skipped with a line
    saying so) and judge each as soon as its runs are done: its line of the table is said then (the
    header before the first). Returns one result per row, in plan order (results.json)."""
    skipped = {}
    for row in rows:
        if gpus is not None and row.processes > gpus:
            skipped[row.name] = f"needs {row.processes} GPUs, {gpus} visible"
            say(f"skip {row.name}: {skipped[row.name]}")
    perf_rows = [r for r in rows if r.kind in ("memory", "speed") and r.name not in skipped]
    perf_layout = perf_rows[0].layout if perf_rows else None
    runnable = [r for r in rows if r.name not in skipped and (r.kind not in ("memory", "speed")
                                                               or r.layout == perf_layout)]
    for row in rows:
        if row.name not in skipped and row not in runnable:
            skipped[row.name] = f"the memory and speed rows run one layout ({perf_layout})"
            say(f"skip {row.name}: {skipped[row.name]}")

    failures: dict[str, str] = {}
    launches: dict[tuple, object] = {}
    done: dict[str, dict] = {}

    def finish(row: Row) -> None:
        """Judge the row (its runs are done) and say its line of the table."""
        if not done:
            say("\n".join(TABLE_HEADER))
        done[row.name] = judge_row(row, work_dir, device, failures, launches)
        say(format_row(done[row.name]))

    # One process: the uninterrupted reference of every set of row options in use (built with the row's own
    # options: reference_options), the checkpoint round trips, the family rows' bf16 runs.
    singles, references = [], {}
    for row in runnable:
        if row.kind in ("parity", "checkpoint", "family"):
            references.setdefault(reference_name(row), reference_options(row))
    for name, options in sorted(references.items()):
        singles.append(argv(args_file, reference_output(work_dir, name), **options))
    for row in runnable:
        out = row_output(work_dir, row.name)
        if row.kind == "checkpoint":
            singles += [argv(args_file, out, **row.options, exit_interval=SAVE_STEP), argv(args_file, out, **row.options)]
        elif row.kind == "family":
            singles.append(argv(args_file, out, **row.options))
        elif row.kind == "rollback":
            singles += [argv(args_file, out, **row.options, input_dir=spike_data(args_file, work_dir)),
                        argv(args_file, rollback_reference(work_dir, row), **rollback_options_of(row))]
    if singles:
        try:
            run_single(singles, work_dir, "single", device, timeout=timeout)
        except AssertionError as error:
            failures["single"] = f"the one-process runs failed (see {work_dir / 'single.runs.json'}): {error}"[:2000]
        for row in runnable:
            if row.kind in ("checkpoint", "family", "rollback"):
                finish(row)
    # The speed and memory row of one process trains alone: its allocator peak and speed are its own.
    for row in runnable:
        if row.kind == "perf":
            try:
                run_single([argv(args_file, row_output(work_dir, row.name), **row.options)], work_dir, "perf", device,
                           timeout=timeout)
            except AssertionError as error:
                failures[row.name] = f"the run failed (see {work_dir / 'perf.runs.json'}): {error}"[:2000]
            finish(row)
    # Launched runs, grouped by fleet degrees (one launch each).
    groups: dict[tuple, list] = {}
    members: dict[tuple, list[Row]] = {}
    for row in runnable:
        if row.kind not in ("parity", "overflow", "memory"):
            continue
        out = row_output(work_dir, row.name)
        if row.kind == "parity":
            runs = [argv(args_file, out, **row.options, exit_interval=SAVE_STEP), argv(args_file, out, **row.options)]
        elif row.kind == "overflow":
            runs = [{"argv": argv(args_file, out, **row.options), "inject_overflow": overflow_injection(row)}]
        else:  # memory; the speed row reads the same run
            runs = [argv(args_file, row_output(work_dir, f"perf:{row.layout}"), **row.options, max_steps=PERF_STEPS,
                         save_steps=10 * PERF_STEPS)]
        groups.setdefault(launch_key(row), []).extend(runs)
        members.setdefault(launch_key(row), []).append(row)
    for row in runnable:
        if row.kind == "speed" and launch_key(row) in members:
            members[launch_key(row)].append(row)
    for i, (key, runs) in enumerate(groups.items()):
        try:
            launches[key] = run_launch(key[0], runs, work_dir, f"launch{i}", device, timeout=timeout)
        except AssertionError as error:
            print(error, file=sys.stderr, flush=True)
            for row in members[key]:
                failures[row.name] = f"launch {work_dir / f'launch{i}.log'} failed"
        for row in members[key]:
            finish(row)
    # In this process: the kernel tables, the ring as threads (and any row left, judged on what exists).
    for row in runnable:
        if row.kind in ("kernels", "ring") or row.name not in done:
            finish(row)

    results = []
    for row in rows:
        if row.name in skipped:
            results.append({**row.to_json(), "output_dir": str(row_output(work_dir, row.name)), "status": "skipped",
                            "passed": None, "why": skipped[row.name]})
        else:
            results.append(done[row.name])
    return results


HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def judge_row(row: Row, work_dir: Path, device: str, failures: dict, launches: dict) -> dict:
    """One row's result (its runs done): the figures, the bound, pass or FAIL; never raises."""
    result = {**row.to_json(), "output_dir": str(row_output(work_dir, row.name))}
    try:
        if row.name in failures:
            raise AssertionError(failures[row.name])
        if "single" in failures and row.kind in ("parity", "checkpoint", "family", "rollback"):
            raise AssertionError(failures["single"])
        if row.kind == "kernels":
            measured = kernel_table(device, HALF_DTYPES[row.dtype])
        elif row.kind == "ring":
            from llm_pretrain.selfcheck.ring_threads import ring_check

            measured = ring_check(device, HALF_DTYPES[row.dtype] if device == "gpu" else "float32",
                                  row.options["context_parallel_degree"])
        elif row.kind == "overflow":
            measured = judge_overflow(launches[launch_key(row)].results(), str(row_output(work_dir, row.name)),
                                      overflow_injection(row))
        elif row.kind in ("memory", "speed"):
            measured = judge_perf(row.kind, row_output(work_dir, f"perf:{row.layout}"))
        elif row.kind == "perf":
            measured = judge_one_gpu_perf(row_output(work_dir, row.name))
        elif row.kind == "rollback":
            measured = judge_rollback(rollback_reference(work_dir, row), row_output(work_dir, row.name), row.dtype)
        elif row.kind == "family":
            measured = judge_family(reference_output(work_dir, reference_name(row)), row_output(work_dir, row.name))
        else:
            reference = reference_output(work_dir, reference_name(row))
            measured = judge_parity(reference, row_output(work_dir, row.name), row.dtype)
        return {**result, **measured, "status": "pass" if measured["passed"] else "FAIL"}
    except Exception as error:  # noqa: BLE001 -- one row's failure is that row's FAIL, after hours of runs
        detail = (str(error) if isinstance(error, AssertionError) else "") or traceback.format_exc(limit=3)
        return {**result, "bound": "-", "passed": False, "status": "FAIL", "error": detail[:2000]}


# ----------------------------------------------------------------------------- judging
def relative_differences(reference: Path, other: Path) -> dict:
    """Largest relative differences of the per-step loss and grad norm, and of the final weights
    (each tensor's largest difference over its largest magnitude) between two runs of max_steps steps."""
    ref, got = train_records(reference), train_records(other)
    assert [r["step"] for r in got] == [r["step"] for r in ref], f"{other}: steps differ from {reference}"
    assert all(r["grad_norm"] is not None for r in got), f"{other}: no grad norm logged"
    step = ref[-1]["step"]
    ref_weights, got_weights = final_weights(reference, step), final_weights(other, step)
    assert sorted(got_weights) == sorted(ref_weights), f"{other}: parameter names differ"
    weights = {name: float(np.abs(got_weights[name].astype(np.float64) - value).max()
                           / max(float(np.abs(value).max()), 1e-30))
               for name, value in ref_weights.items()}
    worst = max(weights, key=weights.get)
    return {"loss": max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref, got)),
            "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in zip(ref, got)),
            "weights": weights[worst], "worst_weight": worst}


def replica_report(output: Path) -> dict:
    checks = [s.get("replica_check") for s in summary_records(output)]
    assert checks and all(checks), f"{output}: a run reports no replica check"
    return {"replica_groups": checks[-1]["replica_groups"],
            "resynchronized": [entry for c in checks for entry in c.get("resynchronized", [])]}


def judge_parity(reference: Path, output: Path, dtype: str) -> dict:
    """fp32: absolute 1e-5 on loss, grad norm, weights, and bitwise replicas. Half precision: relative bound."""
    from llm_pretrain.selfcheck.parity import training_differences

    starts = [r["start_step"] for r in map(json.loads, (output / "train_log.jsonl").read_text().splitlines())
              if r["event"] == "run"]
    resumed = starts == [0, SAVE_STEP]
    replicas = replica_report(output)
    built = run_record(output)["built"]
    if dtype == "fp32":
        diffs = training_differences(reference, output, train_records(reference)[-1]["step"])
        passed = max(diffs["loss"], diffs["grad_norm"], diffs["weights"]) <= TOLERANCE
        bound = f"loss, grad norm, weights <= {TOLERANCE:g}; replicas bitwise"
        passed = passed and not replicas["resynchronized"]
    else:
        # Judged on the per-step loss and grad norm; the weights are reported, not judged: Adam moves
        # each weight by about the learning rate in the sign of its gradient, and for gradients near
        # zero that sign can differ under half-precision rounding (up to 2 x lr on a weight, several
        # per cent of a tensor's largest value here), which says nothing about the layout.
        diffs = relative_differences(reference, output)
        limit = HALF_RELATIVE_BOUND[dtype]
        passed = max(diffs["loss"], diffs["grad_norm"]) <= limit
        bound = f"relative loss, grad norm <= 2**{int(np.log2(limit))} ({dtype} units, see selfcheck.py)"
    return {"loss": diffs["loss"], "grad_norm": diffs["grad_norm"], "weights": diffs["weights"],
            "worst_weight": diffs.get("worst_weight"), "bound": bound, "resumed": resumed, **replicas,
            "precision_built": built.get("precision"), "passed": bool(passed and resumed)}


def judge_overflow(ranks: dict[int, dict], output_dir: str, inject: dict = OVERFLOW) -> dict:
    """Every rank skipped the injected step and took the same decisions at every other step (a step
    that overflowed by itself is skipped everywhere too); the loss scale is the same on every rank.
    With a loss scaler (fp16), the step after the injected one runs: the overflow did not stop the run."""
    observed = {rank: data["observations"][output_dir] for rank, data in ranks.items()}
    stepped = {rank: o["stepped"] for rank, o in observed.items()}
    scales = {rank: o["scale"] for rank, o in observed.items()}
    step = inject["step"]
    passed = (len({json.dumps(s) for s in stepped.values()}) == 1 and not stepped[0][step - 1]
              and len({json.dumps(s) for s in scales.values()}) == 1)
    if scales[0][0] is not None and len(stepped[0]) > step:  # the scaler recovered: a later step ran
        passed = passed and any(stepped[0][step:])
    where = f"on rank {inject['rank']} only" if len(ranks) > 1 else "in the one process"
    return {"stepped": stepped, "scale": scales, "passed": passed,
            "bound": f"step {step} skipped on every rank (inf {where}), same loss scale everywhere"}


def judge_rollback(reference: Path, output: Path, dtype: str) -> dict:
    """The spike was caught at SPIKE["step"] and rolled back to the checkpoint; from then on the run is the one
    that skipped that data: the loss and grad norm of every step both logged (fp32: 1e-5 absolute, half:
    HALF_RELATIVE_BOUND relative) and the final weights (reported; judged in fp32)."""
    events = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    rollbacks = [(r["step"], r["checkpoint"], r["skipped_steps"]) for r in events if r["event"] == "rollback"]
    skipped = [SPIKE["save_steps"] + 1, SPIKE["step"] + SPIKE["skip_steps"]]
    caught = rollbacks == [(SPIKE["step"], f"checkpoint-{SPIKE['save_steps']}", skipped)]
    assert caught, f"{output}: expected one rollback at step {SPIKE['step']} skipping {skipped}, got {rollbacks}"
    ref = {r["step"]: r for r in train_records(reference)}
    got = {r["step"]: r for r in train_records(output) if r["step"] in ref}  # the undone steps are not in ref
    assert sorted(got) == sorted(ref), f"{output}: steps {sorted(got)} against the reference's {sorted(ref)}"
    fp32 = dtype == "fp32"
    diffs = {key: max(abs(got[s][key] - ref[s][key]) / (1 if fp32 else abs(ref[s][key])) for s in ref)
             for key in ("loss", "grad_norm")}
    ref_weights, got_weights = final_weights(reference, SPIKE["max_steps"]), final_weights(output, SPIKE["max_steps"])
    diffs["weights"] = max(float(np.abs(got_weights[name].astype(np.float64) - value).max())
                           for name, value in ref_weights.items())
    limit = TOLERANCE if fp32 else HALF_RELATIVE_BOUND[dtype]
    bound = (f"loss, grad norm, weights <= {TOLERANCE:g} against the run skipping that data" if fp32 else
             f"relative loss, grad norm <= 2**{int(np.log2(limit))} against the run skipping that data; weights reported")
    judged = [diffs["loss"], diffs["grad_norm"]] + ([diffs["weights"]] if fp32 else [])
    return {**diffs, "rollbacks": rollbacks, "bound": bound, "passed": bool(max(judged) <= limit)}


def judge_family(reference: Path, output: Path) -> dict:
    """bf16 O2 with the kernels against the family's float32 run: the per-step loss within FAMILY_LOSS_BAND
    (relative); grad norm and weights reported; the run built in bf16 O2 (its run record says so)."""
    diffs = relative_differences(reference, output)
    built = run_record(output)["built"]
    losses = [r["loss"] for r in train_records(output)]
    passed = diffs["loss"] <= FAMILY_LOSS_BAND and all(np.isfinite(losses))
    return {"loss": diffs["loss"], "grad_norm": diffs["grad_norm"], "weights": diffs["weights"],
            "worst_weight": diffs["worst_weight"], "precision_built": built.get("precision"),
            "losses": losses, "reference_losses": [r["loss"] for r in train_records(reference)],
            "bound": f"relative loss <= 2**{int(np.log2(FAMILY_LOSS_BAND))} against float32 (rows.FAMILY_LOSS_BAND); "
                     "grad norm, weights reported", "passed": bool(passed)}


def judge_one_gpu_perf(output: Path) -> dict:
    """tokens/s, MFU and the allocator's peak (max_memory_allocated) beside the planner's prediction for the
    same arguments (the run record's "prediction"), as llm-benchmark reads a log (observe/perf.summarize_log)."""
    from llm_pretrain.observe.perf import OK, summarize_log

    record = summarize_log(str(output), warmup_steps=PERF_STEPS // 4)
    prediction = run_record(output).get("prediction") or {}
    values = {"measured_tokens_per_card_per_sec": record.get("tokens_per_card_per_sec"),
              "predicted_tokens_per_card_per_sec": prediction.get("tokens_per_card_per_sec"),
              "measured_mfu": record.get("mfu"), "predicted_mfu": prediction.get("mfu"),
              "measured_peak_mem_allocated_mb": record.get("peak_mem_allocated_mb"),
              "predicted_peak_mem_allocated_mb": prediction.get("peak_mem_allocated_mb"),
              "measured_peak_mem_reserved_mb": record.get("peak_mem_reserved_mb"),
              "predicted_peak_mem_reserved_mb": prediction.get("peak_mem_reserved_mb")}
    wanted = [k for k in values if "reserved" not in k]
    return {**values, "device_name": record.get("device_name"), "prediction_error": prediction.get("error"),
            "bound": f"reported: {PERF_STEPS} steps of 4,096 tokens, the first {PERF_STEPS // 4} (warm-up) excluded",
            "passed": record.get("status") == OK and all(values[k] is not None for k in wanted)}


def judge_perf(kind: str, output: Path) -> dict:
    """The measurement beside the planner's prediction (reported; passes when both exist)."""
    prediction = run_record(output).get("prediction") or {}
    summary = summary_records(output)[-1]
    if kind == "memory":
        keys = ("peak_mem_allocated_mb", "peak_mem_reserved_mb")
        values = {f"predicted_{k}": prediction.get(k) for k in keys} | {f"measured_{k}": summary.get(k) for k in keys}
        bound = "reported: predicted beside max_memory_allocated / max_memory_reserved (max over ranks)"
    else:
        values = {"predicted_tokens_per_card_per_sec": prediction.get("tokens_per_card_per_sec"),
                  "measured_tokens_per_card_per_sec": summary.get("mean_tokens_per_card_per_sec"),
                  "warmup_steps_excluded": summary.get("warmup_steps_excluded")}
        bound = f"reported: {PERF_STEPS} steps, warm-up excluded"
    return {**values, "bound": bound, "passed": all(v is not None for v in values.values()),
            "prediction_error": prediction.get("error")}


# ----------------------------------------------------------------------------- the kernel table
def kernel_config(**flags):
    """A small LLaMA (one layer, head_dim 64 as flash attention wants) with the given kernel flags."""
    from models.registry import make_config

    return make_config("llama", vocab_size=512, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256, seq_length=128,
                       **flags)


def compare_paths(plain_config, fused_config, dtype: str, seed: int = 0) -> dict:
    """Both models from the same weights on the same random tokens: the largest difference of the
    logits and of every parameter's gradient, each over the largest magnitude of the plain path's."""
    import paddle

    from models.decoder import CausalLM
    from models.weights import init_weights

    plain = CausalLM(plain_config)
    init_weights(plain, plain_config, seed)
    fused = CausalLM(fused_config)
    fused.set_state_dict(plain.state_dict())
    tokens = np.random.RandomState(seed).randint(0, plain_config.vocab_size,
                                                 size=(2, plain_config.seq_length + 1)).astype("int64")
    outputs = {}
    for name, model in (("plain", plain), ("fused", fused)):
        if dtype != "float32":
            model.to(dtype=dtype)
        input_ids, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])
        logits = model(input_ids)
        loss = paddle.nn.functional.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1)).mean()
        loss.backward()
        outputs[name] = {"logits": logits.astype("float32").numpy(),
                         **{f"grad {n}": p.grad.astype("float32").numpy() for n, p in model.named_parameters()
                            if p.grad is not None}}
    ref, got = outputs["plain"], outputs["fused"]
    assert ref.keys() == got.keys(), f"gradients of {sorted(set(ref) ^ set(got))} exist on one path only"
    return {key: float(np.abs(got[key] - value).max() / max(float(np.abs(value).max()), 1e-30))
            for key, value in ref.items()}


def kernel_table(device: str, dtype: str = "bfloat16") -> dict:
    """Each fused kernel alone against the plain path (GPU): forward (logits) and every gradient."""
    bound = KERNEL_RELATIVE_BOUND[dtype]
    table = {}
    for kernel, flag in KERNEL_FLAGS.items():
        try:
            diffs = compare_paths(kernel_config(), kernel_config(**{flag: True}), dtype)
        except Exception as error:  # noqa: BLE001 -- a kernel missing from this build is this row's failure
            table[kernel] = {"forward": None, "gradients": None, "passed": False,
                             "error": f"{type(error).__name__}: {error}"[:500]}
            continue
        worst = max(diffs, key=diffs.get)
        table[kernel] = {"forward": diffs["logits"], "gradients": max(v for k, v in diffs.items() if k != "logits"),
                         "worst": worst, "passed": diffs[worst] <= bound}
    return {"kernels": table, "bound": f"relative to the plain path's largest value <= {bound:.3g} "
                                       f"(4 units of {dtype}, see selfcheck.py)",
            "passed": all(k["passed"] for k in table.values())}


# ----------------------------------------------------------------------------- the report
TABLE_HEADER = ["| row | kind | processes | dtype | loss | grad norm | weights | measured | bound | status |",
                "|---|---|---|---|---|---|---|---|---|---|"]


def format_row(r: dict) -> str:
    """One result's line of the table."""
    def number(key):
        return f"{r[key]:.2e}" if isinstance(r.get(key), (int, float)) else "-"
    measured = "-"
    if r["kind"] == "kernels" and "kernels" in r:
        measured = "; ".join(f"{k} fwd {v['forward']:.1e} grad {v['gradients']:.1e}" if v["forward"] is not None
                             else f"{k} {v['error'][:80]}" for k, v in r["kernels"].items())
    elif r["kind"] == "ring" and "cases" in r:
        measured = f"{r['blocks']}: " + "; ".join(f"{case} " + " ".join(f"{k} {v:.1e}" for k, v in diffs.items())
                                                  for case, diffs in r["cases"].items())
    elif r["kind"] == "overflow" and "stepped" in r:
        measured = f"stepped {r['stepped']}"
    elif r["kind"] in ("memory", "speed", "perf"):
        measured = ", ".join(f"{k} {v:,.3f}" if k.endswith("mfu") else f"{k} {v:,.0f}" for k, v in r.items()
                             if k.startswith(("predicted_", "measured_")) and isinstance(v, (int, float)))
    elif r.get("resynchronized"):
        measured = f"{len(r['resynchronized'])} replica(s) resynchronized"
    status = r["status"] + (f": {r['why']}" if r.get("why") else "") + (f": {r['error'][:300]}"
                                                                         if r.get("error") else "")
    return (f"| {r['name']} | {r['kind']} | {r['processes']} | {r['dtype']} | {number('loss')} | "
            f"{number('grad_norm')} | {number('weights')} | {measured} | {r.get('bound', '-')} | {status} |")


def format_table(results: list[dict]) -> str:
    return "\n".join(TABLE_HEADER + [format_row(r) for r in results])
