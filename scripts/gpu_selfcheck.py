"""Check a GPU machine: every parallel layout trains exactly like one GPU, through a checkpoint and resume.

    python scripts/gpu_selfcheck.py                                  # every layout, fp32 and bf16, GPUs 0-3
    python scripts/gpu_selfcheck.py --layouts dp2,sd2_stage3 --dtypes fp32
    python scripts/gpu_selfcheck.py --device cpu --layouts dp2,tp2   # the same check on CPU processes (CI)

Each layout trains llama-real (hidden 1024, 2 layers, 8 heads, 4 kv heads, vocabulary 8320: its
matrices are above the 2**20 elements where sharding stage 3 slices parameters, its embedding and
head above the 2**23 of stage 2's gradient buffers) on the embedded corpus for 4 steps of 4 x 32
tokens, stopping with a checkpoint after step 2 and resuming from it, and is compared with one
uninterrupted process: fp32 per-step loss, grad norm and final weights within 1e-5; bf16 (AMP O2)
per-step loss within 2 % of the same layout in fp32. Layouts use at most 4 processes, one GPU each
(NCCL); on GPU, TF32 is switched off and deterministic kernels are chosen for the fp32 runs.

The harness is the one of the test suite (tests/parity_utils.py: LAYOUTS, run_layout_checks);
`LLM_PRETRAIN_TEST_DEVICE=gpu python -m pytest tests` runs the parity tests on GPUs as well.
Prints the table and writes OUT/selfcheck.md and OUT/results.json.
Exit code: 0 when every row passes, 1 when some does not, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error  # noqa: E402

DTYPES = ("fp32", "bf16")


def parse_command_line(argv: list[str]):
    from launch_utils import DEVICES
    from parity_utils import LAYOUTS

    parser = UsageArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=DEVICES, default="gpu", help="gpu (default) or cpu")
    parser.add_argument("--layouts", default="all", help=f"comma-separated, from: {', '.join(LAYOUTS)} (default all)")
    parser.add_argument("--dtypes", help="comma-separated fp32, bf16 (default: both on gpu, fp32 on cpu)")
    parser.add_argument("--out", default="gpu_selfcheck_output", help="work and output folder")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per launch before it is stopped")
    return parser.parse_args(argv)


def check_options(options) -> tuple[list[str], list[str]]:
    """The layouts and dtypes to run; a UsageError (before any work) when they cannot run here."""
    from parity_utils import LAYOUTS

    layouts = list(LAYOUTS) if options.layouts == "all" else [n for n in options.layouts.split(",") if n]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown or not layouts:
        raise UsageError(f"--layouts: unknown layout {', '.join(unknown) or '(none)'}; allowed: {', '.join(LAYOUTS)}")
    default_dtypes = "fp32,bf16" if options.device == "gpu" else "fp32"
    dtypes = [d for d in (options.dtypes or default_dtypes).split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise UsageError(f"--dtypes: {options.dtypes!r}; allowed: a comma-separated list of {', '.join(DTYPES)}")
    if "bf16" in dtypes and options.device != "gpu":
        raise UsageError("--dtypes: bf16 needs --device gpu (Paddle's CPU build has no bf16 training kernels)")
    if options.device == "gpu":
        import paddle

        if not paddle.is_compiled_with_cuda():
            raise UsageError("--device gpu: this Paddle build has no CUDA; install paddlepaddle-gpu==3.3.1 "
                             "or run the CPU check with --device cpu")
        needed, visible = max(LAYOUTS[n].nproc for n in layouts), paddle.device.cuda.device_count()
        if visible < needed:
            raise UsageError(f"--layouts need {needed} GPUs, {visible} visible; choose layouts of at most "
                             f"{visible} processes")
    return layouts, dtypes


def format_table(rows: list[dict]) -> str:
    lines = ["| layout | processes | dtype | max loss difference | max grad-norm difference | "
             "max weight difference | bound | pass |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        def number(key):
            return f"{row[key]:.2e}" if row.get(key) is not None else "-"
        status = "pass" if row["passed"] else ("FAIL: " + row["error"] if row.get("error") else "FAIL")
        lines.append(f"| {row['layout']} | {row['processes']} | {row['dtype']} | {number('loss')} | "
                     f"{number('grad_norm')} | {number('weights')} | {row['bound']} | {status} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    options = parse_command_line(argv)
    # The device of the harness is the test suite's one setting (tests/launch_utils.py).
    os.environ["LLM_PRETRAIN_TEST_DEVICE"] = options.device
    try:
        layouts, dtypes = check_options(options)
    except UsageError as error:
        exit_with_usage_error(error)
    from llm_pretrain.data import ensure_embedded_corpus
    from parity_utils import real_size_arguments, run_layout_checks, write_json

    work = Path(options.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus = ensure_embedded_corpus(str(work / "embedded"))
    args_file = write_json(work / "llama-real.json", real_size_arguments(corpus, work))
    print(f"checking {', '.join(layouts)} in {', '.join(dtypes)} on {options.device} (work folder {work})", flush=True)
    rows = run_layout_checks(args_file, work, layouts, dtypes, timeout=options.timeout)
    table = format_table(rows)
    (work / "selfcheck.md").write_text(table + "\n")
    write_json(work / "results.json", rows)
    print(table, flush=True)
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
