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
worker stopped cleanly. A second signal is Paddle's own force quit. Everything else is Paddle's
launcher unchanged.
"""

import os
import sys

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


def main() -> None:
    install_graceful_stop()
    from paddle.distributed.launch.main import launch

    launch()


if __name__ == "__main__":
    main()
