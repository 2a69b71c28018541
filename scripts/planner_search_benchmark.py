"""How long `llm-plan search` takes on this machine (issue 32's example: Llama 3.1 70B on 64 H100s).

    python scripts/planner_search_benchmark.py [--repeat 3] [--out benchmarks/planner_search.md]

Runs the search as a user would (`scripts/plan.py search ... --json`, a fresh process each time, Python's start and
the package's imports included) and reports each run's wall and CPU seconds, with the machine's cores and load.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from llm_pretrain.errors import UsageArgumentParser

COMMAND = ["search", "--model", "meta-llama/Llama-3.1-70B", "--device", "H100-80G", "--gpus", "64", "--seq", "8192",
           "--global_batch_size", "512"]


def timed_search() -> tuple[float, float, list[dict]]:
    """(wall seconds, CPU seconds of the child, its rows)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), *COMMAND, "--json"], cwd=ROOT,
                            capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(result.stdout)


def main(argv=None) -> int:
    parser = UsageArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="runs of the search (default 3)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "planner_search.md"), help="the markdown file written")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} (allowed: 1 or more)")
    load = os.getloadavg()[0]
    runs = [timed_search() for _ in range(args.repeat)]
    rows = runs[0][2]
    first = rows[0] if isinstance(rows, list) else rows
    lines = [
        "# How long `llm-plan search` takes",
        "",
        f"`python scripts/planner_search_benchmark.py` ({args.repeat} runs), on {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), load average {load:.1f} at the start: "
        f"`python scripts/plan.py {' '.join(COMMAND)} --json`, a fresh process each time (Python's start and "
        "the imports included).",
        "",
        "| run | wall s | CPU s |",
        "|---:|---:|---:|",
        *[f"| {i + 1} | {wall:.1f} | {cpu:.1f} |" for i, (wall, cpu, _) in enumerate(runs)],
        "",
        "Issue 32 asked for under 10 s on a 2-core machine (it took 2 min 05 s before the search was rewritten). "
        "The ranking is checked by `tests/test_planner_search.py::test_llama_70b_on_64_h100_first_five_rows_as_before`.",
        "",
        "The start of the answer (`--json`):",
        "",
        "```",
        json.dumps(first, indent=1)[:1500],
        "```",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[4:4 + 2 + args.repeat]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
