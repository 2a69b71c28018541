"""What ends a run besides its last step: signals, the launcher's death, a dead peer.

    StopRequest      SIGTERM / SIGINT set a flag; the loop agrees on it at the next step boundary,
                     saves a checkpoint and exits 0 (a second SIGINT interrupts at once)
    die_with_parent  a launched worker is killed when its launcher dies (no orphans training alone)
    Heartbeat        each launched rank records (step, time) in the launch log directory, so that
                     when a collective fails the survivors can name the rank that stopped first, and
                     the launcher can when a job fails (describe_first_stopped)
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A flag set by SIGTERM/SIGINT, installed for the duration of a run (a context manager).

    The launcher sends SIGTERM to a worker up to three times in 0.6 s (paddle/distributed/launch/
    utils/process_context.py:97-103), so repeated SIGTERMs only confirm the request. A second
    SIGINT (Ctrl-C twice in a terminal) restores Python's default and interrupts at once.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self.stopped = False  # the run stopped on a request (this rank's or another's)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"received {self.signal_name}: stopping with a checkpoint after the current step "
                  "(press Ctrl-C again to stop at once)" if signum == signal.SIGINT else
                  f"received {self.signal_name}: stopping with a checkpoint after the current step",
                  file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    def __enter__(self) -> "StopRequest":
        import threading

        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # After a stop, the process is on its way out with exit code 0: the launcher's repeated
            # SIGTERMs must not turn that into a death by signal.
            signal.signal(signum, signal.SIG_IGN if self.stopped and signum == signal.SIGTERM else handler)
        self._previous = {}


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Launched workers: the kernel sends SIGKILL when the launcher dies (prctl PR_SET_PDEATHSIG).

    A killed launcher leaves nobody to stop the job, collect logs or report an exit code;
    without this its workers would go on training and writing checkpoints unattended.
    Paddle's launcher starts each worker from its main thread (launch/job/container.py ->
    utils/process_context.py Popen), whose exit is the launcher's exit.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return
    if os.getppid() != parent:  # the launcher died before the call above
        os._exit(1)


def launched() -> bool:
    """Started by paddle.distributed.launch (which sets the rank and the log directory)."""
    return "PADDLE_TRAINER_ID" in os.environ and "PADDLE_LOG_DIR" in os.environ


class Heartbeat:
    """heartbeat.<rank>.json in the launch log directory: this rank's pid, last finished step and time."""

    def __init__(self, rank: int, log_dir: str | None = None):
        self.rank = rank
        self.log_dir = log_dir if log_dir is not None else (os.environ.get("PADDLE_LOG_DIR") if launched() else None)
        self.path = os.path.join(self.log_dir, f"heartbeat.{rank}.json") if self.log_dir else None
        self.host = socket.gethostname()  # once: beat() runs every step

    def beat(self, step: int) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": step, "time": time.time()}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a heartbeat is a diagnostic; never fail a run over it

    def describe_failure(self, world_size: int, step: int, error: BaseException) -> str:
        """One line for a failed collective: which rank stopped first, and at which step."""
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        message = f"rank {self.rank} failed in a collective during step {step + 1} ({first_line})"
        beats = read_heartbeats(self.log_dir, world_size) if self.log_dir else {}
        others = {rank: beat for rank, beat in beats.items() if rank != self.rank}
        if not others:
            return message
        gone = [rank for rank, beat in others.items() if not _alive(beat)]
        suspects = gone or list(others)
        first = min(suspects, key=lambda r: (others[r]["step"], others[r]["time"]))
        beat = others[first]
        state = "exited" if first in gone else "still running, not answering"
        return (f"{message}; rank {first} stopped first ({state}; its last step was {beat['step']}, "
                f"{time.time() - beat['time']:.0f} s ago)")


def describe_first_stopped(log_dir: str, exit_codes: dict[int, int], since: float, noticed: float) -> str | None:
    """One line naming the rank that stopped first, for a launcher whose job failed.

    exit_codes: rank -> exit code of the workers that had already exited when the launcher noticed
    the failure (the others were still running then: they stopped later). Among those, the rank
    with the lowest last step, then the oldest heartbeat, stopped first; a rank without a heartbeat
    written since the launch (`since`) never finished a step and comes before all others.
    """
    if not exit_codes:
        return None
    beats = {rank: beat for rank, beat in read_heartbeats(log_dir, max(exit_codes) + 1).items()
             if beat.get("time", 0) >= since}
    first = min(sorted(exit_codes), key=lambda r: (beats[r]["step"], beats[r]["time"]) if r in beats else (-1, 0))
    code = exit_codes[first]
    how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
    if first in beats:
        beat = beats[first]
        last = (f"its last step was {beat['step']} (host {beat['host']}, pid {beat['pid']}, heartbeat "
                f"{noticed - beat['time']:.1f} s before the launcher noticed)")
    else:
        last = "it had not finished a step"
    return f"error: rank {first} stopped first ({how}); {last}; the other ranks' failures follow from it"


def read_heartbeats(log_dir: str, world_size: int) -> dict[int, dict]:
    beats = {}
    for rank in range(world_size):
        try:
            with open(os.path.join(log_dir, f"heartbeat.{rank}.json")) as f:
                beats[rank] = json.load(f)
        except (OSError, ValueError):
            continue
    return beats


def _alive(beat: dict) -> bool:
    """Whether a rank's process exists (ranks of other nodes count as alive: we cannot see them)."""
    pid = beat.get("pid")
    if not pid or beat.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by the launcher) is gone too
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
