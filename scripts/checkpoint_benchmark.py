"""Checkpoint save/load time and bytes for a >=300M-parameter model on CPU, before and after a change.

    python scripts/checkpoint_benchmark.py --before /path/to/old/tree [--out benchmarks/] [--rounds 2]

Measures this tree (the layout-free format, llm_pretrain/checkpoint/dist_checkpoint.py) and, with --before,
another checkout of the repository (e.g. `git archive <commit> | tar -x -C /tmp/old`: the
per-layout format) with the same worker (the worker imports llm_pretrain from the tree it is
given), in one process and in 4 processes (tensor parallel 2 x pipeline parallel 2). Each run:
build the model (MODEL, fp32) and AdamW under the layout, one optimizer step on a tiny batch (so
that Adam's moments exist), then --rounds times: llm_pretrain.checkpoint.checkpointer.save_checkpoint (timed on
every rank from the barrier before it to its return, the slowest rank reported), the bytes of the
checkpoint directory, and load_checkpoint into the same model and optimizer (the slowest rank).
Writes OUT/checkpoint_io.md and OUT/checkpoint_io.json. Run it on an otherwise idle machine
(about 10 minutes on 2 cores); the checkpoints go to --work (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "gpt3-350M-en"  # 24 layers, hidden 1024, vocabulary 50304 (tied): 355M parameters
STALL = "stall per save"  # results key prefix of the sync/async stall rows
STALL_KEYS = ("async_stall_s", "step_idle_s", "step_during_write_s", "async_complete_wait_s", "async_host_copy_mb")
LAYOUTS = {"1 process": (1, []), "4 processes (tp2 x pp2)": (
    4, ["--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2"])}


# ----------------------------------------------------------------------------- worker (one layout, one tree)
def worker(tree: str, model_name: str, work: str, rounds: int, extra: list[str], result_file: str) -> None:
    import paddle  # llm_pretrain comes from `tree`: measure() puts it first on PYTHONPATH

    import llm_pretrain
    assert os.path.dirname(os.path.dirname(os.path.abspath(llm_pretrain.__file__))) == os.path.abspath(tree)

    from llm_pretrain.checkpoint import checkpointer as ckpt
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import all_reduce_max, barrier, init_distributed, plan_layout, wrap_for_training
    from llm_pretrain.parallel.optim import build_optimizer, build_schedule
    from llm_pretrain.parallel.layout import build_model_config
    from llm_pretrain.run.preflight import layout_summary
    from llm_pretrain.run.trainer import build_model
    from models.registry import parameter_count
    from models.weights import init_weights

    args, _ = parse_arguments(["--model_name_or_path", model_name, "--max_seq_length", "16", "--device", "cpu",
                               "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2",
                               "--max_steps", "10", "--output_dir", work, "--input_dir", work, *extra])
    layout = plan_layout(args, int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    config, _, _ = build_model_config(args, layout, "cpu")
    layout = init_distributed(layout, "cpu", args)
    paddle.seed(1)
    model = build_model(config, layout)
    init_weights(model, config, 1)
    optimizer = build_optimizer(args, model, build_schedule(args))
    unwrapped = model
    model, optimizer = wrap_for_training(model, optimizer, layout, args.gradient_accumulation_steps)
    tokens = paddle.randint(0, config.vocab_size, [2, 17])

    def train_once() -> float:
        start = time.perf_counter()
        if hasattr(model, "train_batch"):
            model.train_batch([tokens[:, :-1], tokens[:, 1:]], optimizer)
        else:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.clear_grad()
        return all_reduce_max(time.perf_counter() - start, layout)

    train_once()
    parameters = parameter_count(config)
    state = {"global_step": 1, "consumed_samples": 2, "layout": layout_summary(layout), "args": {},
             "model_config": config.architecture_dict()}
    saves, loads, sizes = [], [], []
    for round_ in range(rounds):
        barrier(layout)
        start = time.perf_counter()
        path = ckpt.save_checkpoint(work, round_ + 1, unwrapped, optimizer, state, layout, 1)
        saves.append(all_reduce_max(time.perf_counter() - start, layout))
        sizes.append(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)))
        barrier(layout)
        start = time.perf_counter()
        ckpt.load_checkpoint(path, unwrapped, optimizer, layout)
        loads.append(all_reduce_max(time.perf_counter() - start, layout))
    files = len(os.listdir(path))  # before the asynchronous saves rotate it away
    # async_save: the stall is the save call (finite check, staging directory, host copy); the write
    # then runs on a background thread during a training step, and completing it waits for the rest.
    step_idle = [train_once() for _ in range(rounds)]
    checkpointer = ckpt.Checkpointer(work, layout, 0, 1, async_save=True)
    stalls, steps_during, completes = [], [], []
    for round_ in range(rounds):
        barrier(layout)
        start = time.perf_counter()
        checkpointer.save_async(100 + round_, unwrapped, optimizer, state)
        stalls.append(all_reduce_max(time.perf_counter() - start, layout))
        steps_during.append(train_once())
        start = time.perf_counter()
        pending = checkpointer.complete_pending()
        completes.append(all_reduce_max(time.perf_counter() - start, layout))
    if layout.is_main:
        with open(result_file, "w") as f:
            json.dump({"save_s": saves, "load_s": loads, "bytes": sizes[-1], "parameters": parameters,
                       "files": files, "async_stall_s": stalls, "step_idle_s": step_idle,
                       "step_during_write_s": steps_during, "async_complete_wait_s": completes,
                       "async_host_copy_mb": pending.host_bytes / 2**20}, f)


# ----------------------------------------------------------------------------- driver
def measure(tree: str, model_name: str, processes: int, extra: list[str], work: str, rounds: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    result_file = os.path.join(work, "result.json")
    command = [os.path.abspath(__file__), "--worker", "--tree", tree, "--model", model_name, "--work", work, "--rounds", str(rounds),
               "--result", result_file, "--", *extra]
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("PADDLE_TRAINERS_NUM", None)
    if processes == 1:
        command = [sys.executable] + command
    else:
        command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(processes),
                   "--log_dir", os.path.join(work, "log")] + command
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if completed.returncode != 0 or not os.path.isfile(result_file):
        logs = ""
        log_dir = os.path.join(work, "log")
        if os.path.isdir(log_dir):
            logs = "".join(open(os.path.join(log_dir, f)).read()[-2000:] for f in sorted(os.listdir(log_dir)))
        raise SystemExit(f"error: benchmark run failed ({tree}, {processes} processes):\n"
                         f"{completed.stderr[-3000:]}{logs}")
    with open(result_file) as f:
        result = json.load(f)
    shutil.rmtree(work, ignore_errors=True)
    return result


def write_report(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "checkpoint_io.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [
        "# Checkpoint save and load",
        "",
        f"`python scripts/checkpoint_benchmark.py --before OLD_TREE` ({datetime.date.today().isoformat()}): a "
        ">=300M-parameter model in fp32 with its AdamW moments on CPU, one process and 4 processes (tensor "
        "parallel 2 x pipeline parallel 2), the same machine and disk for both formats. Times are the "
        "median over the rounds of the slowest rank (save: from the barrier before it to the renamed "
        "directory; load: weights, optimizer state and RNG of every rank). The load average is the "
        "machine's when the measurement ended (this machine has 2 cores; other jobs were running).",
        "",
        "| format | layout | model | save s | load s | bytes | files | rounds | load average |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    stall_rows = {key: r for key, r in results.items() if key.startswith(STALL)}
    for key, r in results.items():
        if key in stall_rows:
            continue
        fmt, layout = key.split(" | ")[:2]
        lines.append(f"| {fmt} | {layout} | {r['model']} ({r['parameters'] / 1e6:.0f}M) | "
                     f"{statistics.median(r['save_s']):.1f} | {statistics.median(r['load_s']):.1f} | "
                     f"{r['bytes'] / 1e9:.2f} GB | {r['files']} | {r['rounds']} | {r['load_average_1min']:.0f} |")
    from llm_pretrain.observe import perf  # here, not at the top: worker processes import the tree they measure

    if stall_rows:
        lines += [
            "",
            "## Training stall per save: synchronous against async_save",
            "",
            "The same runs, then --rounds asynchronous saves (`Checkpointer.save_async`): the stall is the save "
            "call on the slowest rank (finite-weights check, staging directory, copy of the rank's state to "
            "host memory); one training step (a 2 x 16-token batch) then runs while the background thread "
            "writes, against the same step without a write; completing the save waits for what is left of "
            "the write, agrees, and renames (in training that happens at the first step boundary after every "
            "rank's write ended, so a long write overlaps many steps). Host copy: what each rank holds while "
            "its write runs (the planner's async_save_host_mb).",
            "",
            "| layout | model | sync save s (stall) | async stall s | step s | step during the write s "
            "| wait to complete s | host copy MB | rounds | load average |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, r in stall_rows.items():
            lines.append(f"| {key.split(' | ')[1]} | {r['model']} ({r['parameters'] / 1e6:.0f}M) | "
                         f"{statistics.median(r['save_s']):.2f} | {statistics.median(r['async_stall_s']):.2f} | "
                         f"{statistics.median(r['step_idle_s']):.2f} | "
                         f"{statistics.median(r['step_during_write_s']):.2f} | "
                         f"{statistics.median(r['async_complete_wait_s']):.2f} | {r['async_host_copy_mb']:.0f} | {r['rounds']} | "
                         f"{r['load_average_1min']:.0f} |")
    perf.write_keeping_findings(os.path.join(out, "checkpoint_io.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str]) -> int:
    if "--worker" in argv:  # import llm_pretrain from the tree under measurement, nothing before
        parser = argparse.ArgumentParser()
        for key in ("--tree", "--model", "--work", "--result"):
            parser.add_argument(key)
        parser.add_argument("--rounds", type=int)
        parser.add_argument("--worker", action="store_true")
        parser.add_argument("extra", nargs="*")
        args = parser.parse_args(argv)
        worker(args.tree, args.model, args.work, args.rounds, args.extra, args.result)
        return 0
    from llm_pretrain.errors import UsageArgumentParser

    parser = UsageArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="another checkout of this repository to measure too (the old format)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=MODEL, help=f"a built-in architecture (default {MODEL})")
    parser.add_argument("--work", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS), help="measure only this layout")
    args = parser.parse_args(argv)
    if args.before and not os.path.isfile(os.path.join(args.before, "llm_pretrain", "checkpoint.py")):
        parser.error(f"--before: {args.before} is not a checkout of this repository (no llm_pretrain/checkpoint/checkpointer.py)")
    work = args.work or tempfile.mkdtemp(prefix="checkpoint_benchmark.")
    trees = ([("before (per-layout .pdparams/.pdopt)", os.path.abspath(args.before))] if args.before else []) + \
        [("after (layout-free safetensors)", REPO_ROOT)]
    # Results accumulate in OUT/checkpoint_io.json, so that layouts can be measured one at a time.
    results_file = os.path.join(args.out, "checkpoint_io.json")
    results = {}
    if os.path.isfile(results_file):
        with open(results_file) as f:
            results = json.load(f)
    for layout, (processes, extra) in LAYOUTS.items():
        if args.layout and layout not in args.layout:
            continue
        for name, tree in trees:
            print(f"measuring {name}, {layout} ...", flush=True)
            result = measure(tree, args.model, processes, extra, os.path.join(work, "run"), args.rounds)
            suffix = f" | {args.model}" if args.model != MODEL else ""
            measured = {"model": args.model, "rounds": args.rounds, "load_average_1min": os.getloadavg()[0]}
            stall = {key: result.pop(key) for key in STALL_KEYS if key in result}
            results[f"{name} | {layout}{suffix}"] = {**result, **measured}
            if stall and tree == REPO_ROOT:  # the stall table: this tree's synchronous and asynchronous saves
                results[f"{STALL} | {layout}{suffix}"] = {**stall, "save_s": result["save_s"],
                                                          "parameters": result["parameters"], **measured}
            write_report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
