"""Run several trainings one after the other in this process (the parity harness launches it once per layout).

    python llm_pretrain/selfcheck/parity_worker.py runs.json
    python -m paddle.distributed.launch --nproc_per_node 2 llm_pretrain/selfcheck/parity_worker.py runs.json

runs.json is a list of runs, each an argument list for llm_pretrain/run_pretrain.py, e.g.
[["base.json", "--tensor_parallel_degree", "2", "--output_dir", "out/tp2"], ...], or
{"argv": [...], "inject_overflow": {"rank": 1, "step": 2}}: that rank alone gets an infinite
gradient (a hook on its first parameter) in that step of the run, the fp16 self-check's overflow;
{"argv": [...], "env": {name: value}}: set in this process for that run only (the tests'
LLM_PRETRAIN_KERNEL_STANDINS=1: the GPU kernels' branches through their CPU stand-ins; such a run's stand-in
calls on this rank, llm_pretrain/cpu/kernel_standins.py CALLS, are observed as "kernel_calls").
Every run of one launch must have the same parallel layout (fleet is initialized once).
Under llm_pretrain.selfcheck.parity.launch each rank writes what it observed in the runs with an injection:
whether each step's optimizer step ran and the loss scale after it, and in the stand-in runs their kernel
calls (keyed by output_dir). Only
those runs import the trainer before run_pretrain does: the others keep run_pretrain's order
(its CPU defaults are set before Paddle loads, llm_pretrain/cpu/threads.py).
"""

import contextlib
import json
import os
import sys


@contextlib.contextmanager
def run_environment(env: dict):
    """The run's own environment variables, set for the run and restored after it (tests/workers share it)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def observe_steps(inject: dict | None, observed: dict):
    """Wrap the trainer's train_step: record each step's outcome; inject the overflow if asked."""
    from llm_pretrain.run import trainer

    original = trainer.train_step
    calls = {"n": 0}
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))

    def train_step(model, optimizer, schedule, precision, micro_batches, parameters, *args, **kwargs):
        calls["n"] += 1
        hook = None
        if inject and inject["rank"] == rank and inject["step"] == calls["n"]:
            hook = parameters[0].register_hook(lambda grad: grad * float("inf"))
        try:
            result = original(model, optimizer, schedule, precision, micro_batches, parameters, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        scaler = precision.scaler
        observed.setdefault("stepped", []).append(bool(result.optimizer_stepped))
        observed.setdefault("scale", []).append(
            float(scaler._scale.numpy().reshape(-1)[0]) if scaler is not None else None)
        return result

    trainer.train_step = train_step
    return lambda: setattr(trainer, "train_step", original)


def main(runs_file: str) -> int:
    from llm_pretrain.run_pretrain import main as run_pretrain

    with open(runs_file) as f:
        runs = json.load(f)
    observations = {}
    for run in runs:
        run = run if isinstance(run, dict) else {"argv": run}
        argv = [str(a) for a in run["argv"]]
        restore = None
        stand_ins = "LLM_PRETRAIN_KERNEL_STANDINS" in run.get("env", {})
        if stand_ins and "llm_pretrain.cpu.kernel_standins" in sys.modules:  # (imported by an earlier run)
            sys.modules["llm_pretrain.cpu.kernel_standins"].CALLS.clear()
        if run.get("inject_overflow"):
            observed = observations.setdefault(argv[argv.index("--output_dir") + 1], {})
            restore = observe_steps(run["inject_overflow"], observed)
        try:
            with run_environment(run.get("env", {})):
                code = run_pretrain(argv)
            from llm_pretrain.selfcheck.parity import catch_crashes  # (numpy after run_pretrain's CPU defaults)

            catch_crashes()  # Paddle is imported now
        finally:
            if restore:
                restore()
        if code:
            return code
        if stand_ins:  # which stand-ins this rank called (tests: every rank took the GPU branches)
            from llm_pretrain.cpu.kernel_standins import CALLS

            observations.setdefault(argv[argv.index("--output_dir") + 1], {})["kernel_calls"] = dict(CALLS)
        # fleet.distributed_optimizer keeps the run's optimizer (and through it every weight, gradient
        # and moment) in fleet's singleton until the next call: drop it, so that the next run's
        # allocator peak (metrics.peak_memory_mb) is its own.
        if "paddle.distributed.fleet" in sys.modules:
            sys.modules["paddle.distributed.fleet"].fleet.user_defined_optimizer = None
    if os.environ.get("LAUNCH_RESULT_DIR"):  # under llm_pretrain.selfcheck.parity.launch: report what was observed
        from llm_pretrain.selfcheck.parity import write_result

        write_result({"runs": len(runs), "observations": observations})
    return 0


if __name__ == "__main__":
    from llm_pretrain.run.run_control import exit_after_results

    exit_after_results(main(sys.argv[1]))
