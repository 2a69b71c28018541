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
    kernels     each fused kernel against the plain path on random inputs, forward and
                gradients, within a bound derived from the dtype (printed).
    memory      the planner's prediction beside max_memory_allocated / max_memory_reserved.
    speed       tokens/card/s beside the planner's prediction.

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
KERNEL_FLAGS = {"flash_attention": "use_flash_attention", "fused_rope": "use_fused_rope",
                "fused_rms_norm": "use_fused_rms_norm", "fused_swiglu": "use_fused_swiglu"}


@dataclass(frozen=True)
class Row:
    name: str
    kind: str                  # parity | overflow | checkpoint | kernels | memory | speed
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


def plan_rows(device: str, layouts: list[str] | None = None, dtypes: list[str] | None = None) -> list[Row]:
    """The rows the self-check runs on `device`. On CPU: the fp32 layout rows only (Paddle's CPU build
    has no half-precision training kernels and none of the fused ones). `layouts`/`dtypes` filter."""
    rows = [production_row("parity", "fp32", name, device) for name in LAYOUTS]
    if device == "gpu":
        rows += [production_row("parity", "bf16-o2", name, device) for name in PRODUCTION_LAYOUTS]
        rows.append(production_row("parity", "bf16-o1", O1_LAYOUT, device))
        rows.append(production_row("overflow", "fp16-o2", OVERFLOW["layout"], device,
                                   name=f"fp16-o2-overflow:{OVERFLOW['layout']}"))
        rows.append(production_row("checkpoint", "bf16-o2", "single", device, name="bf16-o2:checkpoint-round-trip"))
        rows.append(Row("kernels", "kernels", "single", 1, device, "bf16",
                        {"bf16": True, **KERNEL_OPTIONS}, "bf16-o2",
                        ["fused swiglu: no argument key, on whenever the device is a GPU"]))
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


def reference_options(row: Row) -> dict:
    """The options of a row's one-process reference: the row's own, without its layout's degrees (an option
    the layout switched off, e.g. amp_master_grad under dp2 or sharding stage 3, is off there too)."""
    layout = layout_options(row.layout)
    return {key: value for key, value in row.options.items() if key not in layout}


def reference_name(row: Row) -> str:
    """The reference's directory name: the precision, plus each option that differs from the precision's."""
    options, usual = reference_options(row), PRECISIONS[row.precision]
    changed = sorted(key for key in set(options) | set(usual) if options.get(key) != usual.get(key))
    return row.precision + "".join(f"+{key}={options.get(key)}" for key in changed)


def reference_output(work_dir: Path, name: str) -> Path:
    return work_dir / "runs" / "single" / name


def run_rows(rows: list[Row], args_file: Path, work_dir: Path, device: str, gpus: int | None,
             timeout: int = 1200, say=print) -> list[dict]:
    """Run every row the node can run (rows needing more GPUs than `gpus` are skipped with a line
    saying so), then judge each. Returns one result per row (results.json)."""
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

    # One process: the uninterrupted reference of every set of row options in use (built with the row's own
    # options: reference_options), the checkpoint round trip.
    singles, references = [], {}
    for row in runnable:
        if row.kind in ("parity", "checkpoint"):
            references.setdefault(reference_name(row), reference_options(row))
    for name, options in sorted(references.items()):
        singles.append(argv(args_file, reference_output(work_dir, name), **options))
    for row in runnable:
        if row.kind == "checkpoint":
            out = row_output(work_dir, row.name)
            singles += [argv(args_file, out, **row.options, exit_interval=SAVE_STEP), argv(args_file, out, **row.options)]
    failures: dict[str, str] = {}
    if singles:
        try:
            run_single(singles, work_dir, "single", device, timeout=timeout)
        except AssertionError as error:
            failures["single"] = f"the one-process runs failed (see {work_dir / 'single.runs.json'}): {error}"[:2000]
    # Parallel runs, grouped by fleet degrees (one launch each).
    groups: dict[tuple, list] = {}
    members: dict[tuple, list[str]] = {}
    for row in runnable:
        if row.layout == "single" or row.kind == "kernels":
            continue
        out = row_output(work_dir, row.name)
        # The overflow row launches alone: a failure there must not take the other rows of its degrees with it.
        key = (*LAYOUTS[row.layout].launch_key(), row.kind == "overflow")
        if row.kind == "parity":
            runs = [argv(args_file, out, **row.options, exit_interval=SAVE_STEP), argv(args_file, out, **row.options)]
        elif row.kind == "overflow":
            runs = [{"argv": argv(args_file, out, **row.options),
                     "inject_overflow": {"rank": OVERFLOW["rank"], "step": OVERFLOW["step"]}}]
        elif row.kind == "memory":  # the speed row reads the same run
            runs = [argv(args_file, row_output(work_dir, f"perf:{row.layout}"), **row.options, max_steps=PERF_STEPS,
                         save_steps=10 * PERF_STEPS)]
        else:
            continue
        groups.setdefault(key, []).extend(runs)
        members.setdefault(key, []).append(row.name)
    launches = {}
    for i, (key, runs) in enumerate(groups.items()):
        try:
            launches[key] = run_launch(key[0], runs, work_dir, f"launch{i}", device, timeout=timeout)
        except AssertionError as error:
            print(error, file=sys.stderr, flush=True)
            for name in members[key]:
                failures[name] = f"launch {work_dir / f'launch{i}.log'} failed"

    results = []
    for row in rows:
        result = {**row.to_json(), "output_dir": str(row_output(work_dir, row.name))}
        if row.name in skipped:
            results.append({**result, "status": "skipped", "passed": None, "why": skipped[row.name]})
            continue
        try:
            if row.name in failures:
                raise AssertionError(failures[row.name])
            if "single" in failures and row.kind in ("parity", "checkpoint"):
                raise AssertionError(failures["single"])
            if row.kind == "kernels":
                measured = kernel_table(device)
            elif row.kind == "overflow":
                launch = launches[(*LAYOUTS[row.layout].launch_key(), True)]
                measured = judge_overflow(launch.results(), str(row_output(work_dir, row.name)))
            elif row.kind in ("memory", "speed"):
                measured = judge_perf(row.kind, row_output(work_dir, f"perf:{row.layout}"))
            else:
                reference = reference_output(work_dir, reference_name(row))
                measured = judge_parity(reference, row_output(work_dir, row.name), row.dtype)
            results.append({**result, **measured, "status": "pass" if measured["passed"] else "FAIL"})
        except Exception as error:  # noqa: BLE001 -- one row's failure is that row's FAIL, after hours of runs
            detail = (str(error) if isinstance(error, AssertionError) else "") or traceback.format_exc(limit=3)
            results.append({**result, "bound": "-", "passed": False, "status": "FAIL", "error": detail[:2000]})
    return results


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


def judge_overflow(ranks: dict[int, dict], output_dir: str) -> dict:
    """Every rank skipped the injected step and took the same decisions at every other step (a step
    that overflowed by itself is skipped everywhere too); the loss scale is the same on every rank."""
    observed = {rank: data["observations"][output_dir] for rank, data in ranks.items()}
    stepped = {rank: o["stepped"] for rank, o in observed.items()}
    scales = {rank: o["scale"] for rank, o in observed.items()}
    passed = (len({json.dumps(s) for s in stepped.values()}) == 1 and not stepped[0][OVERFLOW["step"] - 1]
              and len({json.dumps(s) for s in scales.values()}) == 1)
    return {"stepped": stepped, "scale": scales, "passed": passed,
            "bound": f"step {OVERFLOW['step']} skipped on every rank (inf on rank {OVERFLOW['rank']} only), "
                     "same loss scale everywhere"}


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
def format_table(results: list[dict]) -> str:
    lines = ["| row | kind | processes | dtype | loss | grad norm | weights | measured | bound | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def number(key):
            return f"{r[key]:.2e}" if isinstance(r.get(key), (int, float)) else "-"
        measured = "-"
        if r["kind"] == "kernels" and "kernels" in r:
            measured = "; ".join(f"{k} fwd {v['forward']:.1e} grad {v['gradients']:.1e}" if v["forward"] is not None
                                 else f"{k} {v['error'][:80]}" for k, v in r["kernels"].items())
        elif r["kind"] == "overflow" and "stepped" in r:
            measured = f"stepped {r['stepped']}"
        elif r["kind"] in ("memory", "speed"):
            measured = ", ".join(f"{k} {v:,.0f}" for k, v in r.items()
                                 if k.startswith(("predicted_", "measured_")) and isinstance(v, (int, float)))
        elif r.get("resynchronized"):
            measured = f"{len(r['resynchronized'])} replica(s) resynchronized"
        status = r["status"] + (f": {r['why']}" if r.get("why") else "") + (f": {r['error'][:300]}"
                                                                             if r.get("error") else "")
        lines.append(f"| {r['name']} | {r['kind']} | {r['processes']} | {r['dtype']} | {number('loss')} | "
                     f"{number('grad_norm')} | {number('weights')} | {measured} | {r.get('bound', '-')} | {status} |")
    return "\n".join(lines)
