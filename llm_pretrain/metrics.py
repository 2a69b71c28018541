"""Training metrics: one log line and one JSON record per logging step, VisualDL scalars, a summary.

Records go to `output_dir/train_log.jsonl` (rank 0), one JSON object per line
with an "event" of "run" (what was trained, once per start), "train", "eval"
or "summary". Throughput is tokens/card/sec: the global tokens of the steps
divided by the number of cards and the wall time of those steps.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time

import paddle

TRAIN_LOG = "train_log.jsonl"


def peak_memory_mb(device: str) -> dict[str, float]:
    """GPU: max allocated and reserved by Paddle's allocator; CPU: the peak of Paddle's host
    allocator (bytes its tensors held at once, what llm_pretrain/planner predicts) and the peak
    resident set size (that plus the Python interpreter, Paddle's libraries and NumPy)."""
    if device == "gpu":
        return {
            "peak_mem_allocated_mb": paddle.device.cuda.max_memory_allocated() / 2**20,
            "peak_mem_reserved_mb": paddle.device.cuda.max_memory_reserved() / 2**20,
        }
    # paddle/fluid/memory/stats.h: HOST_MEMORY_STAT_PEAK_VALUE(Allocated, 0), the host allocator's
    # peak of allocated bytes since the process started.
    return {"peak_mem_allocated_mb": paddle.base.core.host_memory_stat_peak_value("Allocated", 0) / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def reset_peak_memory(device: str) -> None:
    """Start the allocator's peak afresh (several runs in one process each report their own peak);
    the tensors of an earlier run are collected first."""
    import gc

    gc.collect()
    if device == "gpu":
        paddle.device.cuda.reset_max_memory_allocated()
        paddle.device.cuda.reset_max_memory_reserved()
    else:
        paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0)


def format_train_line(record: dict, max_steps: int) -> str:
    memory = " ".join(f"{k.replace('_mb', '')} {v:.0f}MB" for k, v in record.items() if k.startswith("peak_"))
    grad_norm = f"{record['grad_norm']:.4f}" if record.get("grad_norm") is not None else "n/a"
    return (
        f"step {record['step']}/{max_steps} | loss {record['loss']:.6f} | lr {record['learning_rate']:.3e}"
        f" | grad_norm {grad_norm} | tokens/card/sec {record['tokens_per_card_per_sec']:.1f}"
        f" | step_time {record['step_time_s']:.3f}s | {memory} | tflops/card {record['tflops_per_card']:.4f}"
    )


class MetricsLog:
    """Writes records on the main rank; every other rank's calls do nothing."""

    def __init__(self, output_dir: str, enabled: bool, use_visualdl: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, TRAIN_LOG)
        self._writer = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if use_visualdl:
                from visualdl import LogWriter

                self._writer = LogWriter(logdir=os.path.join(output_dir, "visualdl"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"event": record.pop("event"), "time": round(time.time(), 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None and record["event"] in ("train", "eval"):
            prefix = "train" if record["event"] == "train" else record.get("split", "eval")
            for key, value in record.items():
                if key not in ("event", "time", "step", "split") and isinstance(value, (int, float)):
                    self._writer.add_scalar(tag=f"{prefix}/{key}", value=value, step=record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def summarize(step_records: list[dict], warmup_steps: int) -> dict:
    """Mean throughput over the steps after warm-up, and the peak memory of the run."""
    measured = [r for r in step_records if r["step"] > warmup_steps] or step_records
    summary = {
        "steps": step_records[-1]["step"] if step_records else 0,
        "warmup_steps_excluded": warmup_steps if measured is not step_records else 0,
        "mean_tokens_per_card_per_sec": statistics.fmean(r["tokens_per_card_per_sec"] for r in measured) if measured else 0.0,
        "mean_tflops_per_card": statistics.fmean(r["tflops_per_card"] for r in measured) if measured else 0.0,
        "final_loss": step_records[-1]["loss"] if step_records else None,
    }
    for key in ("peak_mem_allocated_mb", "peak_mem_reserved_mb", "peak_rss_mb"):
        values = [r[key] for r in step_records if key in r]
        if values:
            summary[key] = max(values)
    return summary


def format_summary(summary: dict) -> str:
    memory = ", ".join(f"{k} {v:.0f}" for k, v in summary.items() if k.startswith("peak_"))
    return (
        f"summary: {summary['steps']} steps, mean tokens/card/sec {summary['mean_tokens_per_card_per_sec']:.1f}"
        f" (excluding {summary['warmup_steps_excluded']} warm-up steps), {memory}, final loss "
        + (f"{summary['final_loss']:.6f}" if summary["final_loss"] is not None else "n/a")
    )
