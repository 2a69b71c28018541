"""Training metrics: one log line and one JSON record per logging step, VisualDL scalars, a summary.

Records go to `output_dir/train_log.jsonl` (rank 0), one JSON object per line
with an "event" of "run" (what was trained, once per start), "train", "eval"
or "summary". Throughput is tokens/card/sec: the global tokens of the steps
divided by the number of cards and the wall time of those steps.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import statistics
import time

import paddle

from llm_pretrain.errors import RunError

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
    the tensors of an earlier run are collected first.

    The first time (before the process's first model), what survives that collection (Paddle's and the
    package's modules, fleet's groups: about 130,000 objects) is frozen out of the collector's passes
    (gc.freeze): each full pass then walks only what training created, 3 ms instead of 0.2 s here and in
    every automatic pass during training. Nothing of a run (model, optimizer, tensors) exists yet when it
    freezes; objects that become garbage later without a cycle are still freed at once."""
    import gc

    gc.collect()
    if not gc.get_freeze_count():
        gc.freeze()
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
        + (f" | slowest rank {record['slowest_rank']['rank']} {record['slowest_rank']['step_time_s']:.3f}s, fastest "
           f"rank {record['fastest_rank']['rank']} {record['fastest_rank']['step_time_s']:.3f}s"
           if len(record.get("rank_step_time_s", ())) > 1 else "")
    )


def drop_torn_last_line(path: str) -> bool:
    """Cut a half-written last line (a crash or a full disk during a write) off a JSON-lines file."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        keep = 0  # the end of the last whole line
        for start in range(max(0, size - (1 << 20)), -1, -(1 << 20)):
            f.seek(start)
            chunk = f.read(min(1 << 20, size - start))
            if b"\n" in chunk:
                keep = start + chunk.rindex(b"\n") + 1
                break
        f.truncate(keep)
    return True


class MetricsLog:
    """Appends records to train_log.jsonl on the main rank, whole lines only; other ranks' calls do nothing.

    Each record is one write of one complete line; a write that fails part way (disk full) is
    cut off again, so the file never holds a half line. A torn last line left by a crash is
    dropped when the log is opened. `fresh` (overwrite_output_dir) starts an empty log.
    """

    def __init__(self, output_dir: str, enabled: bool, use_visualdl: bool = True, fresh: bool = False):
        self.enabled = enabled
        self.path = os.path.join(output_dir, TRAIN_LOG)
        self._writer = None
        self._fd = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            if fresh and os.path.exists(self.path):
                os.remove(self.path)
            self.dropped_torn_line = drop_torn_last_line(self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if use_visualdl:
                from visualdl import LogWriter

                self._writer = LogWriter(logdir=os.path.join(output_dir, "visualdl"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"event": record.pop("event"), "time": round(time.time(), 3), **record}
        self._append((json.dumps(record) + "\n").encode())
        if self._writer is not None and record["event"] in ("train", "eval"):
            prefix = "train" if record["event"] == "train" else record.get("split", "eval")
            for key, value in record.items():
                if key not in ("event", "time", "step", "split") and isinstance(value, (int, float)):
                    self._writer.add_scalar(tag=f"{prefix}/{key}", value=value, step=record["step"])

    def _append(self, line: bytes) -> None:
        size = os.fstat(self._fd).st_size
        try:
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise RunError(f"cannot write {self.path}: {error.strerror or error}") from None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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


# What the summary counts besides steps (llm_pretrain/run/trainer.py, llm_pretrain/run/resilience.py).
RESILIENCE_COUNTS = ("loss_spikes", "spike_skipped_steps", "rollbacks", "data_skipped_steps")


def format_summary(summary: dict) -> str:
    memory = ", ".join(f"{k} {v:.0f}" for k, v in summary.items() if k.startswith("peak_"))
    events = "".join(f", {key.replace('_', ' ')} {summary[key]}" for key in RESILIENCE_COUNTS if key in summary)
    return (
        f"summary: {summary['steps']} steps{events}, mean tokens/card/sec {summary['mean_tokens_per_card_per_sec']:.1f}"
        f" (excluding {summary['warmup_steps_excluded']} warm-up steps), {memory}, final loss "
        + (f"{summary['final_loss']:.6f}" if summary["final_loss"] is not None else "n/a")
    )


def reduce_for_log(loss: float, norms: list, memory: dict[str, float], layout) -> tuple[float, float | None, dict]:
    """A logged step's values with one host read: the loss averaged over the data replicas (data-parallel
    and sharding groups), the mean of the step norms (device tensors from fleet's clip, or floats), the
    peak memory's maximum over every rank. The all-reduces are queued on the device and read together
    (four separate reads before: loss, norms, allocated, reserved)."""
    values = {"loss": paddle.to_tensor([loss], dtype="float64"),  # float64: the logged loss as exact as before
              "memory": paddle.to_tensor(list(memory.values()), dtype="float64")}
    if None not in norms:
        values["norms"] = paddle.stack([n.reshape([]).astype("float64") if isinstance(n, paddle.Tensor)
                                        else paddle.to_tensor(float(n), dtype="float64") for n in norms]).mean()
    if layout.distributed:
        import paddle.distributed as dist
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
        for degree, group in ((layout.data_parallel_degree, hcg.get_data_parallel_group()),
                              (layout.sharding_degree, hcg.get_sharding_parallel_group())):
            if degree > 1:
                dist.all_reduce(values["loss"], group=group)
        values["loss"] = values["loss"] / layout.data_replicas
        dist.all_reduce(values["memory"], op=dist.ReduceOp.MAX)
    host = paddle.concat([v.reshape([-1]) for v in values.values()]).numpy()
    grad_norm = float(host[-1]) if "norms" in values else None
    return float(host[0]), grad_norm, dict(zip(memory, map(float, host[1:1 + len(memory)])))


def scalar(value) -> float:
    """A number, or a one-element tensor read to the host (fleet's pipeline returns losses of shape [1])."""
    return value if isinstance(value, (int, float)) else float(value.numpy().reshape(-1)[0])


def gather_router_metrics(router_metrics, layout) -> dict:
    """A mixture-of-experts model's router metrics (models.moe.RouterMetrics) over every rank's tokens, as
    one process reports them: taken from the last pipeline stage (its loss sees every stage's layers,
    models/pipeline.py RouterCarry), then the expert picks per layer, the pairs dropped and the aux losses
    summed over the data replicas (the aux loss and DeepSeek-V3's MTP loss: their mean). At logging steps only:
    one broadcast and one all-reduce of [layers x experts + 5] numbers."""
    metrics = router_metrics
    if layout.distributed:
        import paddle.distributed as dist
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
        # one row per router (not every layer: ERNIE 4.5 MoE and DeepSeek-V3 have dense ones too; DeepSeek-V3's
        # multi-token-prediction block has one)
        shape = [metrics.config.router_count, metrics.config.num_experts]
        picks = metrics.picks if metrics.forwards else paddle.zeros(shape, dtype="float32")
        scalars = [metrics.dropped, metrics.balance] if metrics.forwards else [paddle.zeros([]), paddle.zeros([])]
        # the MTP loss (computed by the last stage only) and its forwards
        scalars += [metrics.mtp_loss if metrics.mtp_forwards else paddle.zeros([]),
                    paddle.full([1], metrics.mtp_forwards, dtype="float64")]
        packed = paddle.concat([picks.reshape([-1]).astype("float64")] + [v.reshape([1]).astype("float64") for v in scalars]
                               + [paddle.full([1], metrics.forwards, dtype="float64")])
        if layout.pipeline_parallel_degree > 1:
            group = hcg.get_pipe_parallel_group()
            dist.broadcast(packed, src=group.ranks[-1], group=group)
        for degree, group in ((layout.data_parallel_degree, hcg.get_data_parallel_group()),
                              (layout.sharding_degree, hcg.get_sharding_parallel_group())):
            if degree > 1:
                dist.all_reduce(packed, group=group)
        values = packed.numpy()
        replicas = layout.data_replicas
        metrics.forwards = int(round(values[-1] / replicas))
        metrics.mtp_forwards = int(round(values[-2] / replicas))
        if metrics.mtp_forwards:
            metrics.mtp_loss = paddle.to_tensor(values[-3] / replicas, dtype="float32")
        if metrics.forwards:
            metrics.picks = paddle.to_tensor(values[:-5].reshape(shape).astype("float32"))
            metrics.dropped = paddle.to_tensor(int(round(values[-5])), dtype="int64")
            metrics.balance = paddle.to_tensor(values[-4] / replicas, dtype="float32")
    return metrics.summary()


def rank_times(own_time: float, data_wait: float, layout) -> dict:
    """Every rank's mean step time (its own share, before waiting for the others) and data wait, and
    the slowest and fastest rank, as Megatron's straggler detector reports them: one small
    all_gather, at logging steps only."""
    times = [[own_time, data_wait]]
    if layout.distributed:
        import paddle
        import paddle.distributed as dist

        gathered = []
        dist.all_gather(gathered, paddle.to_tensor([own_time, data_wait], dtype="float32"))
        times = [tensor.numpy().tolist() for tensor in gathered]
    own = [t[0] for t in times]
    slowest, fastest = own.index(max(own)), own.index(min(own))
    return {"rank_step_time_s": own, "rank_data_wait_s": [t[1] for t in times],
            "slowest_rank": {"rank": slowest, "step_time_s": own[slowest], "data_wait_s": times[slowest][1]},
            "fastest_rank": {"rank": fastest, "step_time_s": own[fastest], "data_wait_s": times[fastest][1]}}


class MetricsLogger:
    """Owns the run's records: accumulates steps, writes one train record per logging step
    (loss averaged over the interval and the data replicas), eval records and the summary,
    and prints the matching lines (through a progress bar when stderr is a terminal).

    Every rank calls it (the loss and peak memory are reduced over ranks); rank 0 writes.
    """

    def __init__(self, output_dir: str, layout, device: str, *, max_steps: int, logging_steps: int,
                 flops_per_token: float, global_tokens_per_step: int, start_step: int,
                 disable_tqdm: bool | None, fresh: bool = False):
        self.log = MetricsLog(output_dir, enabled=layout.is_main, fresh=fresh)
        self.layout, self.device = layout, device
        self.max_steps, self.logging_steps, self.start_step = max_steps, logging_steps, start_step
        self.flops_per_token, self.global_tokens_per_step = flops_per_token, global_tokens_per_step
        self.records: list[dict] = []
        self._losses, self._norms, self._time = [], [], 0.0
        self._own, self._wait = 0.0, 0.0
        self.progress = _progress_bar(max_steps, start_step, disable_tqdm, layout.is_main)

    def write(self, record: dict) -> None:
        self.log.write(record)

    def say(self, line: str) -> None:
        if self.layout.is_main:
            self.progress.write(line)

    def step(self, step: int, loss: float, grad_norm: float | None, learning_rate: float, step_time: float,
             consumed_samples: int, router_metrics=None, own_time: float | None = None,
             data_wait: float = 0.0) -> None:
        """router_metrics: a mixture-of-experts model's models.moe.RouterMetrics (read and reset at logging
        steps, over every rank's tokens: gather_router_metrics).
        own_time: this rank's share of the step before it waited for the others (the step's flag
        reduction); data_wait: its wait for the batch. Both compared over the ranks at logging steps."""
        self._losses.append(loss)
        self._norms.append(grad_norm)
        self._time += step_time
        self._own += own_time if own_time is not None else step_time
        self._wait += data_wait
        self.progress.update(1)
        if step % self.logging_steps and step != self.max_steps:
            return
        steps = len(self._losses)
        tokens_per_card_per_sec = self.global_tokens_per_step * steps / self.layout.world_size / self._time
        loss, grad_norm, memory = reduce_for_log(sum(self._losses) / steps, self._norms,
                                                 peak_memory_mb(self.device), self.layout)
        record = {
            "event": "train", "step": step,
            "loss": loss,
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_card_per_sec": tokens_per_card_per_sec,
            "step_time_s": self._time / steps,
            "global_tokens_per_step": self.global_tokens_per_step,
            "tflops_per_card": self.flops_per_token * tokens_per_card_per_sec / 1e12,
            "consumed_samples": consumed_samples,
            **memory,
            **rank_times(self._own / steps, self._wait / steps, self.layout),
        }
        if router_metrics is not None:
            record.update(gather_router_metrics(router_metrics, self.layout))
        self.records.append(dict(record))
        self.log.write(record)
        self.say(format_train_line(self.records[-1], self.max_steps))
        self._losses, self._norms, self._time = [], [], 0.0
        self._own, self._wait = 0.0, 0.0

    def drop_unlogged_steps(self) -> None:
        """Forget the steps since the last train record (a rollback undid them)."""
        self._losses, self._norms, self._time = [], [], 0.0
        self._own, self._wait = 0.0, 0.0

    def evaluation(self, split: str, step: int, loss: float) -> None:
        record = {"event": "eval", "split": split, "step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
        self.log.write(dict(record))
        self.say(f"eval {split} at step {step} | loss {loss:.6f} | ppl {record['ppl']:.3f}")

    def finish(self, **extra) -> dict:
        """The summary record (written and printed), with `extra` keys; closes the log."""
        self.progress.close()
        records = self.records
        summary = summarize(records, warmup_steps=min(3, len(records) // 5) * self.logging_steps + self.start_step)
        summary.update(extra)
        self.log.write({"event": "summary", **summary})
        self.log.close()
        if self.layout.is_main and records:
            print(format_summary(summary), flush=True)
        return summary

    def close(self) -> None:
        self.progress.close()
        self.log.close()


class _NoProgress:
    def update(self, n):
        pass

    def write(self, line):
        print(line, flush=True)

    def close(self):
        pass


def _progress_bar(max_steps: int, start_step: int, disable_tqdm: bool | None, is_main: bool):
    import sys

    disabled = disable_tqdm if disable_tqdm is not None else not sys.stderr.isatty()
    if disabled or not is_main:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True)
