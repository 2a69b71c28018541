"""Check a GPU machine with what a production run uses: the user's GPU acceptance test.

    python scripts/gpu_selfcheck.py                          # every row, on the GPUs (default --device gpu)
    python scripts/gpu_selfcheck.py --print-plan --json      # the rows, as JSON, without running anything
    python scripts/gpu_selfcheck.py --layouts dp2,sd2_stage3 --dtypes fp32
    python scripts/gpu_selfcheck.py --device cpu --layouts dp2,tp2   # the fp32 layout rows on CPU processes (CI)
    python scripts/gpu_selfcheck.py --gpus 1                 # the one-GPU tier (chosen by itself on a 1-GPU node)

Rows (llm_pretrain/selfcheck/rows.py): every layout in fp32 against one process within 1e-5; bf16 O2
with amp_master_grad, flash attention and the fused rope, RMSNorm and swiglu kernels under dp2,
tp2 + SP, pp2, sd2 stages 1-3, tp2 x sd2 stage 2, sep2 and cp2 (flash attention in every block of
the ring), tp2 x cp2, the interleaved (pp4 x 2) and uneven (pp3) pipelines, async_save, and a MoE
(mixtral-real) with its experts over dp2 and over sharding, against one process with the same options;
bf16 O1; fp16 O2 with loss scaling and an overflow injected on one rank; an O2 checkpoint round
trip; a loss-spike rollback against the run that skips that data; a kernel table (each fused kernel against the plain path, forward and gradients); memory and
speed beside the planner's prediction. Every layout run stops with a checkpoint after step 2 and
resumes. The model is llama-real (hidden 1024, 2 layers, vocabulary 8320: above the sizes where
sharding stage 3 slices parameters and stage 2 keeps them out of its buffers), 4 steps of 4 x 32
tokens on the embedded corpus. Processes get IEEE fp32 (no TF32) and deterministic kernels.

The one-GPU tier (a node with one visible GPU, or --gpus 1; about 8 minutes on one H100, see
docs/gpu-verification.md): every model family in bf16 O2 + amp_master_grad + flash + fused kernels
against its own float32 run; fp16 O2 with an overflow injected in one process; the O2 checkpoint and
async_save round trips; the loss-spike rollback; the kernel table in bf16 and fp16; ring attention's flash blocks as cp2 and cp4
threads on the GPU against one whole attention (causal, grouped kv heads, ALiBi); TinyLlama 1.1B at
4,096 tokens: tokens/s, MFU and max_memory_allocated beside the planner's prediction.

--gpus N caps the GPUs used (default: all visible). A row that needs more GPUs than that is skipped
with a line saying so. Prints each row's line of the table as it is judged, then the table, and
writes OUT/selfcheck.md and OUT/results.json (every row's figures; send it when a row fails).
Exit code: 0 when every row that ran passed, 1 when some did not, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error
from llm_pretrain.selfcheck.parity import DEVICES, LAYOUTS

DTYPES = ("fp32", "bf16", "fp16")


def parse_command_line(argv: list[str]):
    parser = UsageArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=DEVICES, default="gpu", help="gpu (default) or cpu")
    parser.add_argument("--layouts", default="all", help=f"comma-separated, from: {', '.join(LAYOUTS)} (default all)")
    parser.add_argument("--dtypes", help="comma-separated fp32, bf16, fp16 (default: all on gpu, fp32 on cpu)")
    parser.add_argument("--gpus", help="use at most N GPUs (default: every visible one); 1: the one-GPU tier")
    parser.add_argument("--out", default="gpu_selfcheck_output", help="work and output folder")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per launch before it is stopped")
    parser.add_argument("--print-plan", action="store_true", help="print the rows and exit without running")
    parser.add_argument("--json", action="store_true", help="with --print-plan: as a JSON list")
    return parser.parse_args(argv)


def check_options(options) -> tuple[list[str], list[str]]:
    """The layouts and dtypes to run; a UsageError (before any work) when they cannot run here."""
    layouts = list(LAYOUTS) if options.layouts == "all" else [n for n in options.layouts.split(",") if n]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown or not layouts:
        raise UsageError(f"--layouts: unknown layout {', '.join(unknown) or '(none)'}; allowed: {', '.join(LAYOUTS)}")
    default_dtypes = ",".join(DTYPES) if options.device == "gpu" else "fp32"
    dtypes = [d for d in (options.dtypes or default_dtypes).split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise UsageError(f"--dtypes: {options.dtypes!r}; allowed: a comma-separated list of {', '.join(DTYPES)}")
    if set(dtypes) - {"fp32"} and options.device != "gpu":
        raise UsageError("--dtypes: bf16 and fp16 need --device gpu (Paddle's CPU build has no half-precision "
                         "training kernels)")
    if options.gpus is not None:
        if options.device != "gpu":
            raise UsageError(f"--gpus: {options.gpus!r} needs --device gpu (the CPU check runs processes, not GPUs)")
        if not options.gpus.isdigit() or int(options.gpus) < 1:
            raise UsageError(f"--gpus: {options.gpus!r}; allowed: a whole number of GPUs, 1 or more")
    if options.device == "gpu" and not options.print_plan:
        import paddle

        if not paddle.is_compiled_with_cuda():
            raise UsageError("--device gpu: this Paddle build has no CUDA; install paddlepaddle-gpu==3.3.1 "
                             "or run the CPU check with --device cpu")
    return layouts, dtypes


def visible_gpus(device: str, plan_only: bool = False) -> int | None:
    """The GPUs this process sees (None on CPU, or with a Paddle build without CUDA). For a plan alone,
    a paddlepaddle wheel without paddlepaddle-gpu is taken as a CPU build from its metadata, without
    importing Paddle (which takes seconds)."""
    from importlib import metadata

    if device != "gpu":
        return None
    if plan_only:
        try:
            metadata.distribution("paddlepaddle-gpu")
        except metadata.PackageNotFoundError:
            return None
    import paddle

    return paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else None


def gpus_to_use(options) -> int | None:
    """The visible GPUs, capped by --gpus; --gpus alone when none can be counted (a plan on a CPU build)."""
    visible = visible_gpus(options.device, plan_only=options.print_plan)
    cap = int(options.gpus) if options.gpus is not None else None
    if visible is None or cap is None:
        return cap if visible is None else visible
    return min(visible, cap)


def choose_tier(gpus: int | None) -> str:
    """One GPU: the one-GPU tier (its rows all run in one process each); otherwise every row."""
    return "one-gpu" if gpus == 1 else "full"


def main(argv: list[str]) -> int:
    options = parse_command_line(argv)
    try:
        layouts, dtypes = check_options(options)
    except UsageError as error:
        exit_with_usage_error(error)
    from llm_pretrain.selfcheck.rows import plan_rows

    gpus = gpus_to_use(options)
    tier = choose_tier(gpus)
    rows = plan_rows(options.device, layouts, dtypes, tier)
    if options.print_plan:
        if options.json:
            print(json.dumps([row.to_json() for row in rows], indent=1))
        else:
            for row in rows:
                print(f"{row.name}: {row.kind}, {row.processes} {row.device} process(es), {row.dtype}, "
                      f"{json.dumps(row.options)}" + "".join(f"\n    {note}" for note in row.notes))
        return 0

    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.selfcheck.parity import real_size_arguments, write_json
    from llm_pretrain.selfcheck.rows import format_table, run_rows

    work = Path(options.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus = ensure_embedded_corpus(str(work / "embedded"))
    args_file = write_json(work / "llama-real.json", real_size_arguments(corpus, work, options.device))
    where = f"{gpus} GPU(s), {tier} tier" if gpus is not None else "cpu"
    print(f"checking {len(rows)} rows on {where} (work folder {work})", flush=True)
    results = run_rows(rows, args_file, work, options.device, gpus, timeout=options.timeout,
                       say=lambda line: print(line, flush=True))
    table = format_table(results)
    (work / "selfcheck.md").write_text(table + "\n")
    write_json(work / "results.json", results)
    print("\n" + table, flush=True)
    return 0 if all(r["passed"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
