"""The performance table of runs that already happened -- nothing is re-run.

(The `llm-perf-table` command; `python scripts/perf_table.py` runs the same.)

    llm-perf-table benchmark_output                 # a scripts/benchmark.py folder
    llm-perf-table output/run_a output/run_b        # training output folders (train_log.jsonl)
    llm-perf-table output/ --warmup 5 --out reports # every run folder below output/

Prints the markdown table; with --out also writes perf_table.md, .csv and .png there.
A benchmark folder keeps the figures and environment it recorded. Training
folders are summarized now (median speed after --warmup steps); their
environment is this machine's, and on CPU the matmul peak is measured here
unless --cpu-peak-tflops gives it.
"""

from __future__ import annotations

import argparse
import os
import sys

from llm_pretrain.observe import perf


def expand(paths: list[str]) -> list[str]:
    """Benchmark folders and run folders as given; a folder holding neither stands for its run subfolders."""
    expanded = []
    for path in paths:
        if path.endswith(".jsonl") or any(os.path.isfile(os.path.join(path, f)) for f in (perf.RESULTS_FILE, perf.TRAIN_LOG)):
            expanded.append(path)
        elif os.path.isdir(path):
            subfolders = sorted(os.path.join(path, d) for d in os.listdir(path)
                                if os.path.isfile(os.path.join(path, d, perf.TRAIN_LOG)))
            expanded += subfolders or [path]  # an empty folder: summarize_log reports the missing log
        else:
            expanded.append(path)
    return expanded


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="benchmark folders, training output folders or train_log.jsonl files")
    parser.add_argument("--warmup", type=int, default=perf.DEFAULT_WARMUP_STEPS,
                        help=f"first steps of each run excluded from the speed (default {perf.DEFAULT_WARMUP_STEPS})")
    parser.add_argument("--out", help="write perf_table.md, .csv and .png to this folder")
    parser.add_argument("--cpu-peak-tflops", type=float, help="the CPU's peak instead of measuring it here")
    options = parser.parse_args(argv)

    paths = expand(options.paths)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"error: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    benchmarks = [p for p in paths if os.path.isfile(os.path.join(p, perf.RESULTS_FILE))]
    environment = None
    if len(benchmarks) == len(paths) == 1:
        environment = perf.load_results(paths[0])[1]
    if environment is None:
        environment = perf.collect_environment(measure_cpu_peak=options.cpu_peak_tflops is None)
        if options.cpu_peak_tflops is not None:
            environment["cpu_peak_tflops"] = options.cpu_peak_tflops
    records = perf.records_from_paths(paths, options.warmup, environment)
    warmup = None if benchmarks else options.warmup  # benchmark records carry their own warm-up
    print(perf.render_markdown(records, environment, warmup))
    if options.out:
        written = perf.write_reports(records, environment, options.out, warmup)
        print("wrote " + ", ".join(written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
