"""What ends a run besides its last step: signals, the launcher's death, a dead peer.

    StopRequest      SIGTERM / SIGINT set a flag; the loop agrees on it at the next step boundary,
                     saves a checkpoint and exits 0 (a second SIGINT interrupts at once)
    die_with_parent  a launched worker is killed when its launcher dies (no orphans training alone)
    Heartbeat        each launched rank records (step, time) in the launch log directory, so that
                     when a collective fails the survivors can name the rank that stopped first, and
                     the launcher can when a job fails (describe_first_stopped)
    HangWatchdog     hang_timeout_minutes: no step for that long, and every rank dumps its stacks and
                     the collective it waits in; one line names the ranks that did not reach it. Saves,
                     evaluations, rollbacks and replica checks are phases (Heartbeat.phase): each starts
                     the clock again and, while this rank works in it outside any collective (writing
                     files, computing), counts as progress, so a long save does not end a healthy job
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


def exit_after_results(code: int) -> None:
    """End a launched worker that has written everything without the interpreter's teardown.

    Launched workers that had finished every run died at exit, rarely and under load: with SIGSEGV (exit -11)
    a rank of the 4-process cp2 x sharding launch after its last run's summary (tests/test_long_context.py), a
    stage-3 planner run, rank 0 of test_expert_parallel's dp4 launch (tests/workers/moe_worker.py); with SIGABRT
    rank 0 of run_pretrain.py's dp2 launch stopped by SIGTERM, after its "stopped at step" line (CI,
    tests/test_fault_injection.py, 2026-11-26). That one left a stack: the TCP store's master daemon thread, which
    rank 0 hosts, aborted in LibUVClient::readCallback (paddle/phi/core/distributed/store/tcp_store_libuv.cc)
    while rank 0's main thread ran Paddle's atexit handlers and the static destructors (paddle/base/__init__.py:
    216-218 free the device manager, the kernel factory and the process groups) and rank 1 closed its
    connection. os._exit skips that teardown: the daemon thread and gloo's transport threads end with the
    process. Every file is closed before (Metrics.finish, the checkpointer's completed saves), so nothing
    is lost; a one-process run has no store and keeps the normal exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
        self.watchdog: HangWatchdog | None = None

    def watch_for_hangs(self, world_size: int, output_dir: str, timeout_minutes: float, step: int) -> None:
        """hang_timeout_minutes: a HangWatchdog reporting to the launch log directory (else output_dir)."""
        if timeout_minutes:
            self.watchdog = HangWatchdog(self.rank, world_size, self.log_dir or output_dir, timeout_minutes).start(step)

    def stop_watching(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def phase(self, name: str):
        """A context manager marking a part of the run between steps (save, evaluation, rollback, replica
        check) for the hang watchdog (HangWatchdog.phase); nothing without one."""
        import contextlib

        return self.watchdog.phase(name) if self.watchdog is not None else contextlib.nullcontext()

    def beat(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)
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


# What a rank's log shows when a collective failed because a peer's process is gone: gloo's transport errors
# (third_party/gloo/gloo/transport/tcp/pair.cc, e.g. "Read error [127.0.0.1]:28818: Connection reset by peer",
# or, seen when the killed node held rank 0, "pair.cc:584] TIMEOUT self_rank = 1 pair_rank = 0 peer_str = ...",
# a few seconds after the kill), raised as a RuntimeError (exit 1) or aborting from C++ (SIGABRT).
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "] TIMEOUT self_rank = ")


def peer_gone_line(log_tail: str) -> str | None:
    """The line of a rank's log saying a peer's connection closed under its collective, or None."""
    for line in reversed(log_tail.splitlines()):
        if any(marker in line for marker in PEER_GONE):
            return line.strip()[-160:]
    return None


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


# ----------------------------------------------------------------------------- hangs
# Functions of paddle.distributed a blocked rank can be waiting in (the innermost one is named).
COLLECTIVE_MODULE = os.path.join("paddle", "distributed")


# Python calls that wait for the device: on GPU a rank whose peers stopped waits there, not in a
# paddle.distributed function (NCCL's collectives are queued on the stream; the host blocks at the next read).
DEVICE_WAITS = (".numpy()", ".item()", "synchronize(", ".tolist()")


def device_wait_of(frame) -> str | None:
    """"waiting for the device (.numpy() at trainer.py:231 agree_on_step)" when the innermost Python frame's
    line reads the device (the C++ call itself has no Python frame), else None."""
    import linecache

    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    call = next((call for call in DEVICE_WAITS if call in line), None)
    if call is None:
        return None
    return (f"waiting for the device ({call.rstrip('(')} at {os.path.basename(frame.f_code.co_filename)}:"
            f"{frame.f_lineno} {frame.f_code.co_name}; on GPU, a queued collective's kernel)")


def collective_of(frame, distributed: bool = True) -> str | None:
    """The collective a thread's stack is waiting in ("all_reduce (trainer.py:171 agree_on_step)"),
    or None when it is not inside paddle.distributed. A backward of a distributed run counts: data
    parallelism and sharding all-reduce the gradients from C++ hooks during it (paddle.DataParallel's
    reducer), so a rank whose peers stopped waits there. So does a distributed run's read of the device
    (device_wait_of): on NCCL the host waits there for the collectives queued before it."""
    if distributed and (device_wait := device_wait_of(frame)) is not None:
        return device_wait
    inside, ours = None, None
    while frame is not None:
        filename = frame.f_code.co_filename
        if ours is None and (COLLECTIVE_MODULE in filename or (
                distributed and frame.f_code.co_name == "backward" and "paddle" in filename)):
            inside = frame.f_code.co_name  # the outermost: the public function (all_reduce, not its helpers)
            if inside == "backward":
                inside = "backward (the gradient all-reduce)"
        elif inside is not None and ours is None and COLLECTIVE_MODULE not in filename and "paddle" not in filename:
            ours = f"{os.path.basename(filename)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    if inside is None:
        return None
    return f"{inside} ({ours})" if ours else inside


def _hang_reporting_event():
    import threading

    return threading.Event()


HANG_REPORTING = _hang_reporting_event()  # set once a watchdog fired: it ends the process


def wait_for_hang_report() -> None:
    """When the watchdog has fired, the main thread must not end the process first (a collective
    that times out meanwhile raises): it waits for the watchdog's os._exit."""
    while HANG_REPORTING.is_set():
        time.sleep(1)


class HangWatchdog:
    """hang_timeout_minutes: when no step completes for that long, this rank writes its Python stacks
    (faulthandler, every thread) to hang.rank<N>.txt and what its main thread waits in to
    hang.rank<N>.json in the log directory, waits a little for the other ranks' reports, and the
    lowest rank that is inside a collective prints one line naming the ranks that did not reach it;
    every rank then exits with code 1 (os._exit: the main thread is blocked).

    gloo's collectives release the GIL while they wait (measured: a Python thread keeps running
    during a blocked all_reduce), so this thread runs beside them. A rank that cannot report (stopped,
    or blocked while holding the GIL) counts as not having reached the collective."""

    def __init__(self, rank: int, world_size: int, log_dir: str, timeout_minutes: float, grace_s: float | None = None):
        import threading

        self.rank, self.world_size, self.log_dir = rank, world_size, log_dir
        self.timeout_s = timeout_minutes * 60
        self.grace_s = grace_s if grace_s is not None else min(30.0, max(5.0, self.timeout_s / 2))
        self.step, self.last = 0, time.monotonic()
        self.current_phase = "training"  # or the phase the main thread is in (phase())
        self.main = threading.main_thread()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        for suffix in ("json", "txt"):  # reports of an earlier run in the same directory
            try:
                os.remove(self._path(rank, suffix))
            except OSError:
                pass

    ACTIVE: "HangWatchdog | None" = None  # the running watchdog of this process (progress())

    def start(self, step: int) -> "HangWatchdog":
        self.beat(step)
        self.thread.start()
        HangWatchdog.ACTIVE = self
        return self

    def progress(self) -> None:
        """Work inside a phase moved on (an evaluation batch finished): the clock starts again."""
        self.last = time.monotonic()

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if HangWatchdog.ACTIVE is self:
            HangWatchdog.ACTIVE = None

    def phase(self, name: str):
        """Within the block the main thread is in phase `name` (a save, an evaluation, a rollback): the clock
        starts again on entry and on exit, and while the main thread is outside any collective the phase's
        own work counts as progress (_overdue). A phase stuck in a collective (a peer that never reaches the
        save's barrier) is reported after hang_timeout_minutes as a step would be, naming the phase."""
        import contextlib

        @contextlib.contextmanager
        def marked():
            previous, self.current_phase = self.current_phase, name
            self.last = time.monotonic()
            try:
                yield
            finally:
                self.current_phase, self.last = previous, time.monotonic()

        return marked()

    def _overdue(self) -> bool:
        if time.monotonic() - self.last <= self.timeout_s:
            return False
        if self.current_phase != "training":
            frame = sys._current_frames().get(self.main.ident)
            if collective_of(frame, self.world_size > 1) is None:  # working in its own phase: progress
                self.last = time.monotonic()
                return False
        return True

    def _path(self, rank: int, suffix: str) -> str:
        return os.path.join(self.log_dir, f"hang.rank{rank}.{suffix}")

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, max(self.timeout_s / 4, 0.5))):
            if self._overdue():
                self._report_and_exit()

    def _report_and_exit(self) -> None:
        import faulthandler

        HANG_REPORTING.set()
        frame = sys._current_frames().get(self.main.ident)
        waiting_in = collective_of(frame, self.world_size > 1)
        with open(self._path(self.rank, "txt"), "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        with open(self._path(self.rank, "json") + ".tmp", "w") as f:
            json.dump({"rank": self.rank, "step": self.step, "collective": waiting_in, "phase": self.current_phase,
                       "pid": os.getpid()}, f)
        os.replace(self._path(self.rank, "json") + ".tmp", self._path(self.rank, "json"))
        reports = self._gather_reports()
        waiting = sorted(r for r, report in reports.items() if report.get("collective"))
        if self.rank == (waiting[0] if waiting else 0):
            print(describe_hang(reports, self.world_size, self.timeout_s, self.log_dir), file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # the reporting rank's line comes first
        os._exit(1)

    def _gather_reports(self) -> dict[int, dict]:
        deadline = time.monotonic() + self.grace_s
        while True:
            reports = {}
            for rank in range(self.world_size):
                try:
                    with open(self._path(rank, "json")) as f:
                        reports[rank] = json.load(f)
                except (OSError, ValueError):
                    pass
            if len(reports) == self.world_size or time.monotonic() > deadline:
                return reports
            time.sleep(0.2)


def progress() -> None:
    """A unit of work between steps finished (one evaluation batch): feeds this process's hang watchdog."""
    if HangWatchdog.ACTIVE is not None:
        HangWatchdog.ACTIVE.progress()


def describe_hang(reports: dict[int, dict], world_size: int, timeout_s: float, log_dir: str) -> str:
    """The one line of a hung job: which ranks wait in which collective, which never reached it."""
    waiting = {r: report for r, report in reports.items() if report.get("collective")}
    absent = [r for r in range(world_size) if r not in waiting]
    last_step = max((report["step"] for report in reports.values()), default=0)
    head = f"error: hang: no step finished for {timeout_s / 60:g} minutes (hang_timeout_minutes) after step {last_step}; "
    stacks = f"Python stacks in {os.path.join(log_dir, 'hang.rank*.txt')}"
    if not waiting:
        return head + f"rank(s) {_ranks(absent)} are not in a collective (stuck in their own work); {stacks}"
    collectives = sorted({report["collective"] + _in_phase(report) for report in waiting.values()})
    if not absent:
        return (head + f"every rank waits in a collective ({' / '.join(collectives)}): different collectives, or "
                f"the network; {stacks}")
    why = {r: ("no report: stopped, or blocked without Python" if r not in reports else
               f"at step {reports[r]['step']}{_in_phase(reports[r])}, not in a collective") for r in absent}
    return (head + f"rank(s) {_ranks(absent)} did not reach the collective {' / '.join(collectives)} that rank(s) "
            f"{_ranks(waiting)} wait in ({'; '.join(f'rank {r}: {why[r]}' for r in absent)}); {stacks}")


def _in_phase(report: dict) -> str:
    """" in save" for a rank that reported from a phase between steps (HangWatchdog.phase), else ""."""
    phase = report.get("phase", "training")
    return "" if phase == "training" else f" in {phase}"


def _ranks(ranks) -> str:
    return ", ".join(map(str, sorted(ranks)))
