"""Paddle's launcher, with a graceful stop: the same arguments as `python -m paddle.distributed.launch`.

    python -m llm_pretrain.launch --nproc_per_node 8 llm_pretrain/run_pretrain.py args.json

On SIGTERM/SIGINT Paddle's launcher signals the workers, waits at most 30 s for them
(paddle/distributed/launch/controllers/controller.py:153 `pod.stop(timeout=30)`), kills them
if they are still running, and exits with the signal's number whatever they did
(controller.py:177 `sys.exit(sigint)`): a preempted job looks failed (SIGINT even exits with
2, the code of bad input), and a checkpoint that takes longer than 30 s to write is cut off.

Here the first signal is forwarded to the workers as SIGTERM (they agree on it at the next step
boundary, save a checkpoint and exit 0), the launcher waits for them up to
LLM_PRETRAIN_STOP_TIMEOUT seconds (default 600), then exits with their exit code: 0 when every
worker stopped cleanly. A second signal is Paddle's own force quit.

When the job fails, Paddle's summary shows the first failed worker in rank order ("Container
failed", controller.py:123), usually rank 0: on CPU a survivor that gloo aborted from C++ when its
peer died. Here the launcher notes which workers had failed at the first worker's death (SIGCHLD)
and prints one line naming the rank that stopped first, with its last step, host and pid from the
heartbeats (run_control.describe_first_stopped), before exiting with the job's exit code.
Everything else is Paddle's launcher unchanged.
"""

import os
import signal
import sys
import time

STOP_TIMEOUT_ENV = "LLM_PRETRAIN_STOP_TIMEOUT"


def install_graceful_stop() -> None:
    from paddle.distributed.launch.controllers.controller import ControllerBase

    paddle_handler = ControllerBase.signal_handler

    def graceful_signal_handler(self, signum, frame):
        if hasattr(self, "sigint"):  # the second signal: Paddle's force quit
            return paddle_handler(self, signum, frame)
        self.sigint = signum
        timeout = int(os.environ.get(STOP_TIMEOUT_ENV, "600"))
        self.ctx.logger.info(f"Received signal {signum}: the workers save a checkpoint and stop "
                             f"(waiting up to {timeout} s)")
        self.ctx.status.done()
        self.watcher.stop()
        for container in self.pod.containers:
            container.terminate()  # SIGTERM to the worker's process group (repeated SIGTERMs are harmless)
        if not self.pod.join(timeout):
            self.ctx.logger.info(f"Workers still running after {timeout} s: killing them")
            for container in self.pod.containers:
                container.terminate(force=True)
        self.master.stop()
        self.ctx.logger.info(f"Exit code {self.pod.exit_code}")
        sys.exit(self.pod.exit_code)

    ControllerBase.signal_handler = graceful_signal_handler


def install_dead_rank_report() -> None:
    from paddle.distributed.launch.controllers.controller import ControllerBase
    from paddle.distributed.launch.job.pod import Pod
    from paddle.distributed.launch.job.status import Status

    from llm_pretrain.run.run_control import describe_first_stopped

    launched_at = time.time()
    paddle_deploy, paddle_finalize = Pod.deploy, ControllerBase.finalize

    def deploy_watching_for_the_first_failure(self):
        # Paddle polls its workers once a second; a survivor that gloo aborts when its peer dies
        # can exit within that second. SIGCHLD arrives at each worker's death, in order.
        def on_worker_exit(signum, frame):
            if hasattr(self, "exited_first"):
                return
            failed = {int(c.env.get("PADDLE_TRAINER_ID", c.rank)): c.exit_code
                      for c in self.containers if c.status == Status.FAILED}
            if failed:  # the others were still running: they stopped after these
                self.exited_first, self.noticed_at = failed, time.time()

        signal.signal(signal.SIGCHLD, on_worker_exit)
        paddle_deploy(self)

    def finalize_naming_the_rank_that_stopped_first(self, exit=True):
        self.pod.join()
        exited_first = getattr(self.pod, "exited_first", None)
        if self.pod.exit_code != 0 and exited_first:
            line = describe_first_stopped(self.ctx.args.log_dir, exited_first, launched_at, self.pod.noticed_at)
            print(line, file=sys.stderr, flush=True)
        return paddle_finalize(self, exit)

    Pod.deploy = deploy_watching_for_the_first_failure
    ControllerBase.finalize = finalize_naming_the_rank_that_stopped_first


def main() -> None:
    install_graceful_stop()
    install_dead_rank_report()
    from paddle.distributed.launch.main import launch

    launch()


if __name__ == "__main__":
    main()
