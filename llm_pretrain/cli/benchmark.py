"""Benchmark argument files: launch each for a few steps, collect the figures, write the performance table.

(The `llm-benchmark` command; `python scripts/benchmark.py` runs the same.)

    llm-benchmark configs/llama/a.json configs/llama/b.json --steps 20 --warmup 5
    llm-benchmark --suite configs/benchmark_suite.json --out benchmark_output
    llm-benchmark a.json --nproc 2 --extra --per_device_train_batch_size 2

Each file runs as

    python -m paddle.distributed.launch --nproc_per_node N llm_pretrain/run_pretrain.py <file> \\
        --max_steps STEPS --save_steps 0 --logging_steps 1 --output_dir OUT/<name> ... [extra]

with N from --nproc, else the suite entry's "nproc", else the file's degrees
(tensor x pipeline x sharding; 1 when they are all 1). A run that fails, runs
out of memory or exceeds --timeout is recorded as such and the suite goes on.

Writes OUT/results.jsonl (one record per run, appended as runs finish),
OUT/environment.json, OUT/perf_table.md, .csv and .png, and prints the table.
Exit code: 0 when every run succeeded, 1 when some did not, 2 for bad usage.

Suite file (paths relative to it; every key but "configs" optional):

    {"configs": ["a.json", {"args_file": "b.json", "name": "b-dp2", "nproc": 2, "extra": {"key": value}}],
     "steps": 20, "warmup": 3, "timeout": 1800, "extra": {"key": value}}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from llm_pretrain.observe import perf

# Launched as a script file, as users launch it (the package must be importable: installed, or on PYTHONPATH).
RUN_PRETRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run_pretrain.py")
DEFAULT_STEPS = 20
DEFAULT_TIMEOUT_S = 3600
OOM_PATTERNS = ("out of memory", "resourceexhaustederror", "memoryerror", "cannot allocate memory", "bad_alloc")
# Lines of worker logs that say nothing about a failure.
_NOISE = re.compile(r"UserWarning|warnings\.warn|^LAUNCH INFO|ccache|^\s*$")


# ----------------------------------------------------------------------------- what to run
def forced_arguments(steps: int, output_dir: str) -> list[str]:
    """Short, comparable runs: a fixed number of steps, every step logged, nothing saved or evaluated."""
    return [
        "--max_steps", str(steps), "--save_steps", "0", "--output_dir", output_dir, "--overwrite_output_dir", "true",
        "--logging_steps", "1", "--disable_tqdm", "true", "--do_eval", "false", "--do_predict", "false",
        "--exit_interval", "none",
    ]


def extra_arguments(extra: dict | list | None) -> list[str]:
    """A suite's {"key": value} (or an already split ["--key", "value"]) as command-line arguments."""
    if not extra:
        return []
    if isinstance(extra, list):
        return [str(x) for x in extra]
    out = []
    for key, value in extra.items():
        out += [f"--{key}", json.dumps(value) if isinstance(value, (bool, list)) or value is None else str(value)]
    return out


def _degree(value) -> int:
    return 1 if value in (-1, None) else int(value)


def read_degrees(values: dict, nproc: int | None = None) -> dict:
    """Parallel degrees of an argument file and the process count they need (PaddleNLP's meaning).

    Raises ValueError/TypeError for values that are not degrees (the run itself then reports them).
    """
    tp, pp = _degree(values.get("tensor_parallel_degree")), _degree(values.get("pipeline_parallel_degree"))
    stages = [int(s) for s in re.findall(r"stage(\d)", str(values.get("sharding") or ""))]
    stage = max(stages) if stages else 0
    sharding = None
    if stage:
        for key in ("sharding_parallel_degree", "sharding_degree"):
            if values.get(key, -1) != -1:
                sharding = _degree(values[key])
                break
    world = nproc or tp * pp * (sharding or 1)
    if sharding is None:  # sharding over every remaining process (PaddleNLP derives it from the world size)
        sharding = max(1, world // (tp * pp)) if stage else 1
    return {"nproc": world, "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "sharding_degree": sharding,
            "sharding_stage": stage, "virtual_pp_degree": _degree(values.get("virtual_pp_degree")),
            "data_parallel_degree": max(1, world // (tp * pp * sharding))}


def strategy_of(degrees: dict) -> str:
    from llm_pretrain.parallel.layout import strategy_name

    return strategy_name(degrees["tensor_parallel_degree"], degrees["pipeline_parallel_degree"],
                         degrees["sharding_degree"], degrees["sharding_stage"], degrees["virtual_pp_degree"],
                         degrees["data_parallel_degree"])


def plan_runs(config_files: list[str], suite: dict | None, suite_dir: str, nproc: int | None,
              extra: list[str]) -> list[dict]:
    """One entry per run: name, args_file, nproc, extra arguments, and what the file says (for failed runs)."""
    entries = [{"args_file": f} for f in config_files]
    for item in (suite or {}).get("configs", []):
        item = {"args_file": item} if isinstance(item, str) else dict(item)
        if not os.path.isabs(item["args_file"]):
            # Relative to the suite file; shown relative to the working directory when below it.
            path = os.path.join(suite_dir, item["args_file"])
            item["args_file"] = path if os.path.relpath(path).startswith("..") else os.path.relpath(path)
        entries.append(item)
    suite_extra = extra_arguments((suite or {}).get("extra"))
    runs, names = [], set()
    for entry in entries:
        name = entry.get("name") or os.path.splitext(os.path.basename(entry["args_file"]))[0]
        base, i = name, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.add(name)
        try:
            with open(entry["args_file"], encoding="utf-8") as f:
                values = json.load(f)
            values = values if isinstance(values, dict) else {}
        except (OSError, ValueError):
            values = {}  # the launched run reports the problem
        run = {"name": name, "args_file": entry["args_file"], "file_values": values,
               "extra": suite_extra + extra_arguments(entry.get("extra")) + list(extra)}
        try:
            run["degrees"] = read_degrees(values, nproc or entry.get("nproc"))
        except (TypeError, ValueError):
            run["degrees"] = {"nproc": nproc or entry.get("nproc") or 1}
        runs.append(run)
    return runs


# ----------------------------------------------------------------------------- running
def free_port() -> int:
    """A port nobody listens on now, so that runs (and other users' jobs) don't collide on the launcher's default."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(run: dict, steps: int, output_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(run["degrees"]["nproc"]),
        "--log_dir", os.path.join(output_dir, "launch_log"), "--start_port", str(free_port()),
        RUN_PRETRAIN, run["args_file"], *forced_arguments(steps, output_dir), *run["extra"],
    ]


def run_environment(nproc: int, device: str) -> dict:
    """On CPU each process gets its share of the cores (the launcher would give it one thread):
    that share is also what MFU counts as the process's card."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, perf.flops.cpu_count() // nproc))
    return env


def execute(command: list[str], log_path: str, timeout_s: float, env: dict) -> tuple[int | None, float]:
    """Run the launcher in its own process group, output to log_path; (return code or None on timeout, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), env=env,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _stop_group(process)
    return code, time.perf_counter() - start


def _stop_group(process: subprocess.Popen) -> None:
    """The launcher and its workers (the process group we created): politely, then not."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left, e.g. workers the launcher left behind
    except ProcessLookupError:
        pass
    process.wait()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def failure_text(output_dir: str) -> str:
    """The launcher's output and every worker log: all ranks' errors, not only rank 0's."""
    parts = [_read(os.path.join(output_dir, "launcher.log"))]
    log_dir = os.path.join(output_dir, "launch_log")
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            if name.startswith("workerlog"):
                parts.append(_read(os.path.join(log_dir, name)))
    return "\n".join(parts)


def classify_failure(text: str) -> str:
    """OOM when the output says so (or a worker was SIGKILLed, the kernel OOM killer's signal); else failed."""
    lowered = text.lower()
    if any(pattern in lowered for pattern in OOM_PATTERNS):
        return perf.OOM
    if re.search(r"\bcode (-9|137)\b", text):
        return perf.OOM
    return perf.FAILED


def error_tail(output_dir: str, lines: int = 15) -> str:
    """The last meaningful lines of the first worker log that shows an error (else the launcher's)."""
    log_dir = os.path.join(output_dir, "launch_log")
    candidates = []
    if os.path.isdir(log_dir):
        candidates = [os.path.join(log_dir, n) for n in sorted(os.listdir(log_dir)) if n.startswith("workerlog")]
    candidates.append(os.path.join(output_dir, "launcher.log"))
    for path in candidates:
        text = _read(path)
        if re.search(r"Traceback|error|Error|out of memory", text):
            kept = [line for line in text.splitlines() if not _NOISE.search(line)]
            return "\n".join(kept[-lines:])
    return "\n".join(_read(candidates[-1]).splitlines()[-lines:])


def benchmark_run(run: dict, steps: int, warmup: int, out_dir: str, timeout_s: float, environment: dict) -> dict:
    output_dir = os.path.join(out_dir, run["name"])
    shutil.rmtree(output_dir, ignore_errors=True)  # a stale train_log.jsonl must not pass for this run's
    os.makedirs(output_dir)
    started = time.time()
    device = run["file_values"].get("device") or environment.get("device", "cpu")
    command = launch_command(run, steps, output_dir)
    code, seconds = execute(command, os.path.join(output_dir, "launcher.log"), timeout_s,
                            run_environment(run["degrees"]["nproc"], device))

    record = perf.summarize_log(output_dir, warmup, name=run["name"], environment=environment)
    # What the file says, for runs that died before logging it.
    values, degrees = run["file_values"], run["degrees"]
    record.setdefault("model", values.get("model_name_or_path"))
    record.setdefault("seq_length", values.get("max_seq_length"))
    record.setdefault("world_size", degrees["nproc"])
    if "strategy" not in record and "tensor_parallel_degree" in degrees:
        try:
            record["strategy"] = strategy_of(degrees)
        except Exception:  # noqa: BLE001 -- a name for the table only; the run's own error is what matters
            pass
    record.update(args_file=run["args_file"], test_time=record.get("test_time") or perf.format_time(started),
                  duration_s=round(seconds, 1), returncode=code, command=" ".join(command))
    if code is None:
        record.update(status=perf.TIMEOUT, error=f"no result after {timeout_s:.0f} s (stopped)\n" + error_tail(output_dir))
    elif code != 0:
        record.update(status=classify_failure(failure_text(output_dir)), error=error_tail(output_dir))
    elif record["status"] != perf.OK:
        pass  # exit code 0 but no complete log: summarize_log's error says why
    if record["status"] == perf.TIMEOUT:
        record["error_summary"] = f"no result after {timeout_s:.0f} s (stopped)"
    elif record["status"] != perf.OK:
        record["error_summary"] = perf.error_summary(record.get("error", ""))
    return record


def print_progress(record: dict) -> None:
    name = f"[{record['name']}]"
    if record["status"] != perf.OK:
        print(f"{name} {record['status']}: {record.get('error_summary', '')}", flush=True)
    elif record.get("tokens_per_card_per_sec") is None:
        print(f"{name} ok in {record['duration_s']} s, but every logged step was warm-up", flush=True)
    else:
        mfu = f", MFU {record['mfu']:.2%}" if record.get("mfu") is not None else ""
        print(f"{name} ok in {record['duration_s']} s: {record['tokens_per_card_per_sec']:.1f} tokens/card/sec{mfu}",
              flush=True)


# ----------------------------------------------------------------------------- main
def parse_command_line(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("configs", nargs="*", help="argument files (.json) to benchmark")
    parser.add_argument("--suite", help="a suite file listing argument files (see below)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, help=f"first steps excluded from the speed (default {perf.DEFAULT_WARMUP_STEPS})")
    parser.add_argument("--nproc", type=int, help="processes per run (default: from each file's degrees)")
    parser.add_argument("--out", default="benchmark_output", help="output folder (default benchmark_output)")
    parser.add_argument("--timeout", type=float, help=f"seconds per run before it is stopped (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--cpu-peak-tflops", type=float,
                        help="the CPU's fp32 peak instead of measuring it (e.g. to compare with an earlier suite)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="everything after it is passed to every run, e.g. --extra --per_device_train_batch_size 2")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_command_line(argv)
    suite, suite_dir = None, os.getcwd()
    if options.suite:
        try:
            with open(options.suite, encoding="utf-8") as f:
                suite = json.load(f)
        except (OSError, ValueError) as e:
            print(f"error: suite file {options.suite}: {e}", file=sys.stderr)
            return 2
        suite_dir = os.path.dirname(os.path.abspath(options.suite))
    suite_options = suite or {}
    steps = options.steps or suite_options.get("steps") or DEFAULT_STEPS
    warmup = options.warmup if options.warmup is not None else suite_options.get("warmup", perf.DEFAULT_WARMUP_STEPS)
    timeout_s = options.timeout or suite_options.get("timeout") or DEFAULT_TIMEOUT_S
    if steps <= warmup:
        print(f"error: --steps {steps} leaves no step after the {warmup} warm-up steps", file=sys.stderr)
        return 2
    runs = plan_runs(options.configs, suite, suite_dir, options.nproc, options.extra)
    if not runs:
        print("error: give argument files or --suite", file=sys.stderr)
        return 2

    os.makedirs(options.out, exist_ok=True)
    # Measured before any run, on an idle machine: the CPU peak is the reference for every run's MFU.
    environment = perf.collect_environment(measure_cpu_peak=options.cpu_peak_tflops is None)
    if options.cpu_peak_tflops is not None and environment["device"] == "cpu":
        environment["cpu_peak_tflops"] = options.cpu_peak_tflops
    with open(os.path.join(options.out, perf.ENVIRONMENT_FILE), "w", encoding="utf-8") as f:
        json.dump(environment, f, indent=2)
    results_path = os.path.join(options.out, perf.RESULTS_FILE)
    open(results_path, "w").close()
    records = []
    for i, run in enumerate(runs, 1):
        print(f"[{run['name']}] {i}/{len(runs)}: {run['args_file']} on {run['degrees']['nproc']} process(es), "
              f"{steps} steps", flush=True)
        record = benchmark_run(run, steps, warmup, options.out, timeout_s, environment)
        records.append(record)
        with open(results_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print_progress(record)

    paths = perf.write_reports(records, environment, options.out, warmup)
    print()
    print(perf.render_markdown(records, environment, warmup))
    print("wrote " + ", ".join([results_path, *paths.values()]))
    return 0 if all(r["status"] == perf.OK for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
