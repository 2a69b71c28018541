"""Performance tables from real runs: read the logs, summarize each run, render markdown, CSV and PNG.

One run becomes one *record* (a flat dict, one line of results.jsonl):

    name, status ("ok" | "failed" | "OOM" | "timeout"), error, model, family, seq_length, strategy,
    world_size, device, dtype, global_batch_size, steps, warmup_steps, measured_steps,
    tokens_per_card_per_sec, step_time_s, tflops_per_card, peak_tflops_per_card, mfu,
    peak_mem_allocated_mb + peak_rss_mb (CPU) | peak_mem_allocated_mb + peak_mem_reserved_mb (GPU),
    predicted_peak_mem_mb, predicted_peak_mem_allocated_mb, predicted_tokens_per_card_per_sec (the planner's),
    args_file, test_time, output_dir

How the figures are made, so that they can be trusted:

* Speed is the *median* tokens/card/sec over the logged steps after the first
  `warmup_steps` steps of the run (compilation, allocator growth and caches
  make the first steps slow; they are excluded, never averaged in). A logging
  interval that contains a warm-up step is excluded whole. The median, not the
  mean, so that one slow step (another process on a shared machine) does not
  move the figure.
* Memory is the peak over the whole run (warm-up included: the peak is the
  peak), and over all ranks: the trainer all-reduces it with max before rank 0
  logs it. The table and the chart lead with the allocator's peak -- GPU: Paddle's
  max_memory_allocated (then max_memory_reserved); CPU: Paddle's host allocator
  peak (then the process's peak resident set) -- beside the planner's prediction
  of it (the run record's "prediction", llm_pretrain/planner).
* TFLOPs are *model* FLOPs (llm_pretrain/observe/flops.py: no recompute) times the
  median speed. MFU divides them by the card's peak: the datasheet figure
  for a GPU (flops.PEAK_TFLOPS), for a CPU the fp32 matmul peak measured on
  the machine (flops.measure_cpu_peak_tflops) divided among the processes of
  the run -- a CPU "card" is one process's share of the machine.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import re
import statistics

from llm_pretrain.observe import flops

TRAIN_LOG = "train_log.jsonl"  # written by llm_pretrain/observe/metrics.py
RESULTS_FILE = "results.jsonl"  # written by scripts/benchmark.py, one record per run
ENVIRONMENT_FILE = "environment.json"  # the machine the runner ran on
DEFAULT_WARMUP_STEPS = 3

OK, FAILED, OOM, TIMEOUT = "ok", "failed", "OOM", "timeout"
MEMORY_KEYS = ("peak_mem_allocated_mb", "peak_mem_reserved_mb", "peak_rss_mb")

TABLE_COLUMNS = (
    "model", "sequence length", "strategy", "what ran", "speed (tokens/card/sec)", "TFLOPs/card", "MFU",
    "memory (MB)", "argument file", "test time",
)
CSV_COLUMNS = (
    "name", "status", "model", "family", "seq_length", "strategy", "world_size", "device", "dtype",
    "global_batch_size", "steps", "warmup_steps", "measured_steps", "tokens_per_card_per_sec", "step_time_s",
    "tflops_per_card", "peak_tflops_per_card", "mfu", "peak_mem_allocated_mb", "peak_mem_reserved_mb",
    "peak_rss_mb", "args_file", "test_time", "output_dir", "error",
    "built", "schedule", "sharding_implementation", "sequence_parallel", "recompute", "precision",
    "predicted_peak_mem_mb", "predicted_tokens_per_card_per_sec", "predicted_peak_mem_allocated_mb",
)


# ----------------------------------------------------------------------------- reading logs
def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a .jsonl file; a torn last line (a killed run) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def last_run(records: list[dict]) -> list[dict]:
    """The records of the last start in a train_log.jsonl (a resumed run appends a new "run" event)."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "run"]
    return records[starts[-1]:] if starts else records


def _intervals(train_records: list[dict], start_step: int):
    """(record, the step before its logging interval): a record at step k covers the steps after that up to k."""
    previous = start_step
    for record in sorted(train_records, key=lambda r: r["step"]):
        yield record, previous
        previous = record["step"]


def measured_steps(train_records: list[dict], warmup_steps: int, start_step: int = 0) -> list[dict]:
    """The train records whose whole logging interval lies after the first `warmup_steps` steps of the run."""
    return [r for r, before in _intervals(train_records, start_step) if before >= start_step + warmup_steps]


def median_after_warmup(train_records: list[dict], key: str, warmup_steps: int, start_step: int = 0) -> float | None:
    """Median of `key` over the measured steps; None when every logged step is warm-up."""
    values = [r[key] for r in measured_steps(train_records, warmup_steps, start_step) if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_log(output_dir: str, warmup_steps: int = DEFAULT_WARMUP_STEPS, name: str | None = None,
                  environment: dict | None = None) -> dict:
    """One record from a training output directory (its train_log.jsonl), without re-running anything."""
    output_dir = os.fspath(output_dir)
    path = output_dir if output_dir.endswith(".jsonl") else os.path.join(output_dir, TRAIN_LOG)
    directory = os.path.dirname(path) if output_dir.endswith(".jsonl") else output_dir
    record = {"name": name or os.path.basename(os.path.normpath(directory)), "output_dir": directory,
              "warmup_steps": warmup_steps}
    if not os.path.isfile(path):
        return {**record, "status": FAILED, "error": f"no {TRAIN_LOG} in {directory}"}
    events = last_run(read_jsonl(path))
    run = next((r for r in events if r.get("event") == "run"), {})
    train = [r for r in events if r.get("event") == "train"]
    record.update(run_fields(run))
    record.update(speed_fields(train, run, warmup_steps, environment))
    if not train:
        record.update(status=FAILED, error=f"no training steps logged in {path}")
    elif not any(r.get("event") == "summary" for r in events):
        record.update(status=FAILED, error=f"the run stopped at step {train[-1]['step']} without finishing "
                                           f"(no summary record in {path})")
    else:
        record["status"] = OK
    return record


def run_fields(run: dict) -> dict:
    """What was run, from the "run" event of a train_log.jsonl."""
    layout = run.get("layout") or {}
    fields = {
        "model": run.get("model"), "family": run.get("family"), "seq_length": run.get("seq_length"),
        "strategy": run.get("strategy"), "world_size": layout.get("world_size"), "device": run.get("device"),
        "global_batch_size": run.get("global_batch_size"), "flops_per_token": run.get("flops_per_token"),
        "args_file": run.get("args_file"), "dtype": run.get("dtype") or _dtype_of(run),
        "device_name": run.get("device_name"),
    }
    if run.get("time") is not None:
        fields["test_time"] = format_time(run["time"])
    fields.update(built_fields(run.get("built")))
    prediction = run.get("prediction") or {}
    # The planner's allocated peak (what the trainer measures as peak_mem_allocated_mb), and its last memory
    # figure (on GPU the reserve, else the allocated peak).
    fields["predicted_peak_mem_allocated_mb"] = prediction.get("peak_mem_allocated_mb")
    fields["predicted_peak_mem_mb"] = prediction.get("peak_mem_reserved_mb") or prediction.get("peak_mem_allocated_mb")
    fields["predicted_tokens_per_card_per_sec"] = prediction.get("tokens_per_card_per_sec")
    return {k: v for k, v in fields.items() if v is not None}


def built_fields(built: dict | None) -> dict:
    """What the trainer found it had built (llm_pretrain/observe/run_record.py), for the table and the CSV."""
    if not built:
        return {}
    from llm_pretrain.observe.run_record import summary_line

    schedule, sharding = built.get("schedule"), built.get("sharding")
    recompute = built.get("recompute") or {}
    precision = built.get("precision") or {}
    return {
        "built": summary_line(built),
        "schedule": f"{schedule['kind']} ({schedule['class']}, {schedule['virtual_stages']} virtual stages)"
        if schedule else None,
        "sharding_implementation": f"stage {sharding['stage']}: {sharding['implementation']}" if sharding else None,
        "sequence_parallel": bool((built.get("sequence_parallel") or {}).get("enabled")),
        "recompute": "; ".join(f"{g}: layers {','.join(map(str, layers))}" for g, layers in recompute.items()
                               if isinstance(layers, list)) or None,
        "precision": precision.get("autocast") or "/".join(precision.get("parameter_dtypes") or []) or None,
    }


def _dtype_of(run: dict) -> str | None:
    """The compute dtype: fp32 on CPU; on GPU bf16/fp16 from the argument file when it is readable."""
    if run.get("device") == "cpu":
        return "fp32"
    args_file = run.get("args_file")
    if args_file and os.path.isfile(args_file):
        try:
            with open(args_file, encoding="utf-8") as f:
                args = json.load(f)
            return "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
        except (OSError, ValueError, AttributeError):
            return None
    return None


def speed_fields(train: list[dict], run: dict, warmup_steps: int, environment: dict | None) -> dict:
    """Median speed and TFLOPs after warm-up, peak memory, and MFU."""
    start_step = run.get("start_step", 0) or 0
    fields: dict = {
        "steps": train[-1]["step"] if train else 0,
        "measured_steps": sum(r["step"] - before for r, before in _intervals(train, start_step)
                              if before >= start_step + warmup_steps),
        "tokens_per_card_per_sec": median_after_warmup(train, "tokens_per_card_per_sec", warmup_steps, start_step),
        "step_time_s": median_after_warmup(train, "step_time_s", warmup_steps, start_step),
    }
    for key in MEMORY_KEYS:
        values = [r[key] for r in train if r.get(key) is not None]
        if values:
            fields[key] = max(values)
    speed = fields["tokens_per_card_per_sec"]
    if speed is not None:
        if run.get("flops_per_token"):
            fields["tflops_per_card"] = run["flops_per_token"] * speed / 1e12
        else:  # an older log: the median of the logged figure (same thing: TFLOPs are linear in speed)
            fields["tflops_per_card"] = median_after_warmup(train, "tflops_per_card", warmup_steps, start_step)
    peak = peak_tflops_per_card(run.get("device"), run.get("dtype") or _dtype_of(run) or "fp32",
                                (run.get("layout") or {}).get("world_size") or 1, environment,
                                run.get("device_name"))
    if peak is not None:
        fields["peak_tflops_per_card"] = peak
        fields["mfu"] = safe_mfu(fields.get("tflops_per_card"), peak)
    return fields


def format_time(epoch_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_seconds).strftime("%Y-%m-%d %H:%M")


# ----------------------------------------------------------------------------- peaks and MFU
def peak_tflops_per_card(device: str | None, dtype: str, world_size: int, environment: dict | None,
                         device_name: str | None = None) -> float | None:
    """The peak one card of the run could reach: datasheet for a GPU, measured machine peak / processes on CPU."""
    environment = environment or {}
    if device == "cpu":
        machine = environment.get("cpu_peak_tflops")
        return machine / max(1, world_size) if machine else None
    if device == "gpu":
        name = device_name or environment.get("device_name")
        return flops.device_peak_tflops(name, dtype) if name else None
    return None


def safe_mfu(tflops_per_card: float | None, peak: float | None) -> float | None:
    """flops.mfu, or None when it cannot be computed or would be above 100% (shown as n/a, never clamped)."""
    if tflops_per_card is None or not peak:
        return None
    try:
        return flops.mfu(tflops_per_card, peak)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- environment
def collect_environment(measure_cpu_peak: bool = True) -> dict:
    """Paddle version and commit, device name and count, CUDA/cuDNN/NCCL where present, CPU model and peak."""
    import paddle

    env: dict = {"paddle_version": paddle.__version__, "paddle_commit": paddle.version.commit,
                 "python": platform.python_version(), "cpu_model": cpu_model_name(), "cpu_count": flops.cpu_count()}
    gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    if gpus:
        env.update(device="gpu", device_name=paddle.device.cuda.get_device_name(0), device_count=gpus)
        for key, getter in (("cuda_version", "cuda"), ("cudnn_version", "cudnn"), ("nccl_version", "nccl")):
            value = _version(getter)
            if value:
                env[key] = value
    else:
        env.update(device="cpu", device_name=env["cpu_model"], device_count=env["cpu_count"])
        if measure_cpu_peak:
            bench = flops.cpu_matmul_benchmark()
            env.update(cpu_peak_tflops=bench["peak_tflops"], cpu_matmul=bench)
    return env


def _version(name: str) -> str | None:
    """paddle.version.cuda()/cudnn()/nccl(); CPU builds answer 'False' or 0, which mean absent."""
    import paddle

    getter = getattr(paddle.version, name, None)
    try:
        value = getter() if getter else None
    except Exception:  # noqa: BLE001 -- a version probe must never break a report
        return None
    if value in (None, False, 0, "0", "False", ""):
        return None
    if name == "nccl" and str(value).isdigit() and len(str(value)) >= 4:  # 22105 -> 2.21.5
        v = int(value)
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return str(value)


def cpu_model_name() -> str:
    return flops.cpuinfo_field("model name") or platform.processor() or platform.machine()


def format_environment(env: dict, warmup_steps: int | None) -> str:
    lines = [f"- Paddle {env.get('paddle_version', '?')} (commit {str(env.get('paddle_commit', '?'))[:12]}), "
             f"Python {env.get('python', '?')}"]
    if env.get("device") == "gpu":
        lines.append(f"- Device: {env.get('device_count')} x {env.get('device_name')}")
        versions = ", ".join(f"{label} {env[key]}" for label, key in
                             (("CUDA", "cuda_version"), ("cuDNN", "cudnn_version"), ("NCCL", "nccl_version"))
                             if env.get(key))
        if versions:
            lines.append(f"- {versions}")
    else:
        lines.append(f"- Device: CPU, {env.get('cpu_count')} cores of {env.get('cpu_model')}")
        bench = env.get("cpu_matmul")
        if bench:
            lines.append(
                f"- CPU peak {env['cpu_peak_tflops']:.4f} TFLOPs fp32, measured here: best {bench['size']}x{bench['size']}"
                f" matmul, NumPy {bench['numpy_tflops']:.4f} / Paddle {bench['paddle_tflops']:.4f} TFLOPs; "
                "a process's share of it is its card's peak")
    if warmup_steps is not None:
        lines.append(f"- Speed: median tokens/card/sec over the steps after the first {warmup_steps} "
                     f"(warm-up, excluded). {MEMORY_LEGEND} TFLOPs: model FLOPs (llm_pretrain/observe/flops.py, "
                     "no recompute). (predicted ...): the planner's prediction (llm_pretrain/planner).")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- rendering
MEMORY_LEGEND = ("Memory (MB): peak over the run and all ranks, first the allocator's peak -- CPU: Paddle's host "
                 "allocator (the process's resident set in parentheses); GPU: max allocated / max reserved.")


def _fmt(value, digits: int = 0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def lead_memory(record: dict) -> tuple[float | None, str | None]:
    """The memory figure the table leads with and the chart plots, and what it is.

    The allocator's peak (GPU: max allocated; CPU: Paddle's host allocator); a log without it
    (an older run) has only the resident set.
    """
    if record.get("peak_mem_allocated_mb") is not None:
        gpu = record.get("device") == "gpu" or record.get("peak_mem_reserved_mb") is not None
        return record["peak_mem_allocated_mb"], "GPU: max allocated" if gpu else "CPU: host allocator's peak"
    if record.get("peak_rss_mb") is not None:
        return record["peak_rss_mb"], "resident set (a log without the allocator's peak)"
    return None, None


def predicted_lead_memory(record: dict) -> float | None:
    """The planner's prediction of lead_memory (its allocated peak); None for an older log without one."""
    if record.get("predicted_peak_mem_allocated_mb") is not None:
        return record["predicted_peak_mem_allocated_mb"]
    if record.get("device") != "gpu" and record.get("peak_mem_reserved_mb") is None:
        return record.get("predicted_peak_mem_mb")  # off GPU the planner predicts only the allocated peak
    return None


def memory_cell(record: dict) -> str:
    """The measured figures, then the planner's prediction of the same figures."""
    predicted_allocated, predicted_last = record.get("predicted_peak_mem_allocated_mb"), \
        record.get("predicted_peak_mem_mb")
    if record.get("peak_mem_reserved_mb") is not None and predicted_allocated is not None \
            and predicted_last is not None and predicted_last != predicted_allocated:
        return f"{_measured_memory(record)} (predicted {_fmt(predicted_allocated)} / {_fmt(predicted_last)})"
    return _measured_memory(record) + _predicted(predicted_last, 0)


def _measured_memory(record: dict) -> str:
    """lead_memory first, then the reserve (GPU) or the resident set (CPU)."""
    if record.get("peak_mem_reserved_mb") is not None:
        return f"{_fmt(record.get('peak_mem_allocated_mb'))} / {_fmt(record.get('peak_mem_reserved_mb'))}"
    if record.get("peak_mem_allocated_mb") is not None and record.get("peak_rss_mb") is not None:
        return f"{_fmt(record['peak_mem_allocated_mb'])} (RSS {_fmt(record['peak_rss_mb'])})"  # CPU allocator
    if record.get("peak_mem_allocated_mb") is not None:
        return _fmt(record["peak_mem_allocated_mb"])
    if record.get("peak_rss_mb") is not None:
        return _fmt(record["peak_rss_mb"])
    return "-"


def _predicted(value, digits: int) -> str:
    """The planner's prediction beside a measured figure (the run record's "prediction", llm_pretrain/planner)."""
    return f" (predicted {_fmt(value, digits)})" if value is not None else ""


def table_row(record: dict) -> list[str]:
    """One markdown row; a run that did not succeed shows its status instead of figures."""
    status = record.get("status", OK)
    ok = status == OK
    if ok:
        speed = _fmt(record.get("tokens_per_card_per_sec"), 1) + _predicted(record.get("predicted_tokens_per_card_per_sec"), 1)
        tflops_cell = _fmt(record.get("tflops_per_card"), 4)
        mfu_value = record.get("mfu")
        mfu_cell = _fmt(mfu_value * 100 if mfu_value is not None else None, 2, "%")
        memory = memory_cell(record)
    else:
        speed, tflops_cell, mfu_cell = f"**{status}**", "-", "-"
        memory = memory_cell(record) if status == OOM else "-"
    seq = record.get("seq_length")
    return [
        str(record.get("model") or record.get("name") or "?"), str(seq) if seq else "?",
        str(record.get("strategy") or "?"), record.get("built") or "-", speed, tflops_cell, mfu_cell, memory,
        f"`{record['args_file']}`" if record.get("args_file") else "-", record.get("test_time") or "-",
    ]


def render_markdown(records: list[dict], environment: dict | None = None, warmup_steps: int | None = None,
                    title: str = "Performance") -> str:
    """The table in PaddleNLP's layout with an environment header and notes on runs that failed."""
    if warmup_steps is None:  # records of a benchmark carry the warm-up they were measured with
        warmups = {r.get("warmup_steps") for r in records} - {None}
        warmup_steps = warmups.pop() if len(warmups) == 1 else None
    lines = [f"## {title}", ""]
    if environment:
        lines += ["Environment:", "", format_environment(environment, warmup_steps), ""]
    lines += ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in table_row(r)) + " |" for r in records]
    notes = []
    for r in records:
        if r.get("status", OK) != OK:
            error = (r.get("error_summary") or error_summary(str(r.get("error") or "")))[-300:]
            notes.append(f"- {r.get('name')}: {r['status']}" + (f" -- {error}" if error else ""))
        elif r.get("tokens_per_card_per_sec") is None:
            notes.append(f"- {r.get('name')}: all {r.get('steps', 0)} logged steps are warm-up; no speed measured")
        elif r.get("mfu") is None and r.get("peak_tflops_per_card"):
            notes.append(f"- {r.get('name')}: MFU n/a -- {_fmt(r.get('tflops_per_card'), 4)} TFLOPs/card is above "
                         f"the peak {r['peak_tflops_per_card']:.4f}; the peak measurement is off")
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def error_summary(error: str) -> str:
    """The line that says what went wrong: the last one naming an error, else the last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"error|exception|out of memory", line, re.IGNORECASE):
            return line
    return lines[-1] if lines else ""


def write_csv(records: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})


def chart_label(record: dict) -> str:
    return f"{record.get('name')}\n{record.get('strategy') or '?'} s{record.get('seq_length') or '?'}"


def chart_series(records: list[dict]) -> dict:
    """What the chart plots, per record: the table's figures (speed; memory: lead_memory) and beside each
    the planner's prediction (None where it made none). Runs that did not succeed have no figures."""
    ok = [r.get("status", OK) == OK for r in records]
    memory = [lead_memory(r) for r in records]
    kinds = sorted({kind for (value, kind), good in zip(memory, ok) if good and kind})
    return {
        "labels": [chart_label(r) for r in records], "ok": ok,
        "speed": [r.get("tokens_per_card_per_sec") if good else None for r, good in zip(records, ok)],
        "predicted_speed": [r.get("predicted_tokens_per_card_per_sec") if good else None
                            for r, good in zip(records, ok)],
        "memory": [value if good else None for (value, _), good in zip(memory, ok)],
        "predicted_memory": [predicted_lead_memory(r) if good else None for r, good in zip(records, ok)],
        "memory_title": "peak memory -- " + "; ".join(kinds) if kinds else "peak memory",
    }


def write_chart(records: list[dict], path: str) -> None:
    """Per configuration, the table's speed and lead memory figure (measured bars) with the planner's
    prediction beside each (hatched bars, where it made one); failed runs are marked, not drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    series = chart_series(records)
    width = max(6.0, 1.4 * len(records) + 2)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, 4.8))
    panels = ((axes[0], "speed", "predicted_speed", "tokens/card/sec (median after warm-up)",
               "speed (tokens/card/sec)", 1),
              (axes[1], "memory", "predicted_memory", "MB, peak over the run and all ranks", series["memory_title"], 0))
    positions = list(range(len(records)))
    for ax, measured_key, predicted_key, ylabel, title, digits in panels:
        measured, predicted = series[measured_key], series[predicted_key]
        shift = 0.2 if any(v is not None for v in predicted) else 0.0
        bar_width = 0.4 if shift else 0.8
        bars = ax.bar([x - shift for x in positions], [v or 0 for v in measured], bar_width, label="measured",
                      color=["tab:blue" if good else "lightgray" for good in series["ok"]])
        for bar, value, good, r in zip(bars, measured, series["ok"], records):
            text = _fmt(value, digits) if good else r.get("status", FAILED)
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, color="black" if good else "tab:red")
        if shift:
            drawn = [(x + shift, v) for x, v in zip(positions, predicted) if v is not None]
            bars = ax.bar([x for x, _ in drawn], [v for _, v in drawn], bar_width, label="predicted (planner)",
                          color="white", edgecolor="tab:orange", hatch="//")
            for bar, (_, value) in zip(bars, drawn):
                ax.annotate(_fmt(value, digits), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8, color="tab:orange")
        ax.set_xticks(positions)
        ax.set_xticklabels(series["labels"], fontsize=8, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(y=0.3)  # room for the legend above the tallest bar's figure
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(records: list[dict], environment: dict | None, out_dir: str, warmup_steps: int | None = None,
                  basename: str = "perf_table") -> dict[str, str]:
    """perf_table.md, .csv and .png in out_dir; returns their paths."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"{basename}.{ext}") for ext in ("md", "csv", "png")}
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(render_markdown(records, environment, warmup_steps))
    write_csv(records, paths["csv"])
    write_chart(records, paths["png"])
    return paths


# ----------------------------------------------------------------------------- entry points
def load_results(results_dir: str) -> tuple[list[dict], dict | None]:
    """The records of a benchmark output folder (results.jsonl) and the environment it ran in."""
    results_dir = os.fspath(results_dir)
    records = read_jsonl(os.path.join(results_dir, RESULTS_FILE))
    env_path = os.path.join(results_dir, ENVIRONMENT_FILE)
    environment = None
    if os.path.isfile(env_path):
        with open(env_path, encoding="utf-8") as f:
            environment = json.load(f)
    return records, environment


def records_from_paths(paths: list[str], warmup_steps: int = DEFAULT_WARMUP_STEPS,
                       environment: dict | None = None) -> list[dict]:
    """Records from benchmark folders (results.jsonl) and training output folders (train_log.jsonl), in order."""
    records = []
    for path in paths:
        if os.path.isfile(os.path.join(path, RESULTS_FILE)):
            records += load_results(path)[0]
        else:
            records.append(summarize_log(path, warmup_steps, environment=environment))
    return records


def render_table_for_output_dir(output_dir: str, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                                environment: dict | None = None) -> str:
    """The markdown table of a finished run (or of a benchmark folder) -- what the quickstart prints.

    The environment is the benchmark's recorded one if there is one, else this
    machine's (on CPU this measures the matmul peak: a few seconds, once per process).
    """
    output_dir = os.fspath(output_dir)
    if os.path.isfile(os.path.join(output_dir, RESULTS_FILE)):
        records, recorded = load_results(output_dir)
        return render_markdown(records, environment or recorded, warmup_steps=None)
    environment = environment or collect_environment()
    return render_markdown([summarize_log(output_dir, warmup_steps, environment=environment)], environment,
                           warmup_steps)


def write_keeping_findings(path: str, generated: str, marker: str = "## Findings") -> None:
    """Write a benchmark file: the generated tables, then the hand-written section of the existing
    file from `marker` on, kept as it is (scripts/*_benchmark.py regenerate only their tables)."""
    kept = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        kept = "\n" + text[text.index(marker):] if marker in text else ""
    with open(path, "w", encoding="utf-8") as f:
        f.write(generated + kept)
