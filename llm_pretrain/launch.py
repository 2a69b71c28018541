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

Restart on the ranks left (issue 38), opt-in: `--max_restarts N` (this launcher's own option, not
Paddle's `--max_restart`, which needs an etcd master and restarts every node with the same process count:
paddle/distributed/launch/controllers/collective.py:268, controller.py:87-147; see below) with an argument file
that has `elastic: true`:

    python -m llm_pretrain.launch --max_restarts 3 --nproc_per_node 4 llm_pretrain/run_pretrain.py args.json

Each attempt is one run of this launcher (Paddle's, patched as above) in a child process. When an
attempt fails, the rank that stopped first (the dead-rank report) is taken as lost: the next attempt
runs on the configured --nproc_per_node minus that rank, or fewer: the largest count on which the
elastic preflight finds a layout that keeps the checkpoint's global batch (llm_pretrain/run/preflight.py
elastic_arguments; e.g. 3 ranks cannot split a global batch of 8 over 3 data replicas, so 2). The run
resumes from the newest complete checkpoint, and the preflight says which layout it picked. One line
says what happened:

    launch: rank 1 stopped first (killed by SIGKILL); restart 1 of 3 on 2 of the 4 ranks (3 cannot hold
    the run), from the newest complete checkpoint

Growing back: a rank lost counts only against the attempt after the failure that lost it; every
later restart, and the command started again, begins from the configured count (a returned node
or, on one machine, the killed process's core), and the elastic preflight goes back to the argument
file's layout with the same global batch. Not restarted: exit 0 (finished or stopped), exit 2 (bad
input: the elastic preflight's "no layout holds the run on N ranks; the smallest number of ranks that
holds it is M"), a stop by SIGTERM/SIGINT, or no count of ranks holding the run.

Two nodes (`--nnodes 2 --master HOST:PORT`, one supervisor per node): when every rank of this node that failed
first says a peer's connection closed under its collective (run_control.peer_gone_line: gloo's "Connection reset
by peer"), the other node is gone, and this one restarts alone (`--nnodes 1`, no `--master`: Paddle's rendezvous
of two would wait for the lost node with no deadline, paddle/distributed/launch/controllers/master.py:146-181, and
the lost node may have held its HTTP master, master.py:83-93). A node whose own rank stopped first leaves the job.
A stop signal that arrives while an attempt starts is forwarded once the child exists.

Nodes that leave and return (any number of nodes), without --max_restarts: Paddle's own elastic launcher, with an
etcd server as the rendezvous (`--master etcd://HOST:PORT --nnodes MIN:MAX`, the same command on every node):

    python -m llm_pretrain.launch --master etcd://HOST:2379 --nnodes 2:4 --job_id JOB --nproc_per_node 8 \
        llm_pretrain/run_pretrain.py args.json

Each node's launcher keeps a heartbeat key under a 10 s lease (controllers/master.py:260-296 register_heartbeat);
when a node's key goes (a lease that expired, a launcher that started) or a local rank fails, every launcher stops
its ranks (SIGTERM: they save and exit), waits up to --elastic_timeout seconds for the nodes present to settle
(master.py wait_peer_ready) and starts them again with the new count, MIN to MAX nodes, at most --max_restart
times (controllers/collective.py:268-330 CollectiveElasticController.run, controller.py:87-147 watch). The run's
elastic preflight then keeps the checkpoint's global batch on the ranks it finds. Checked here before Paddle:
`elastic: true` when MIN < MAX, --elastic_timeout of at least 10 s, the etcd3 client importable and the server
answering; `--elastic_level` defaults to 1 (Paddle's -1 ends the job when a peer fails, controller.py:129-147).
"""

import json
import os
import signal
import subprocess
import sys
import time

STOP_TIMEOUT_ENV = "LLM_PRETRAIN_STOP_TIMEOUT"
# Where an attempt (a child launcher) writes the ranks that had failed when it noticed the first death.
FAILED_RANKS_ENV = "LLM_PRETRAIN_FAILED_RANKS"


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

    from llm_pretrain.run.run_control import describe_first_stopped, peer_gone_line

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
            if os.environ.get(FAILED_RANKS_ENV):
                with open(os.environ[FAILED_RANKS_ENV], "w") as f:
                    json.dump({"exit_codes": exited_first, "line": line, "peer_gone": peer_gone(self.pod, exited_first)}, f)
        return paddle_finalize(self, exit)

    def peer_gone(pod, exited_first: dict) -> str | None:
        """When every rank of this pod that had failed first says a peer's connection closed under its
        collective (the ranks of another launcher, a node, are gone): the first one's rank and line."""
        lines = {}
        for container in pod.containers:
            rank = int(container.env.get("PADDLE_TRAINER_ID", container.rank))
            if rank in exited_first:
                try:
                    with open(container.outfile, errors="replace") as f:
                        f.seek(max(0, os.path.getsize(container.outfile) - 20000))
                        lines[rank] = peer_gone_line(f.read())
                except (OSError, TypeError):
                    lines[rank] = None
        if lines and all(lines.values()):
            rank = min(lines)
            return f"rank {rank}: {lines[rank]}"
        return None

    Pod.deploy = deploy_watching_for_the_first_failure
    ControllerBase.finalize = finalize_naming_the_rank_that_stopped_first


# ----------------------------------------------------------------------------- restarts on the ranks left
def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name V` / `--name=V` in argv and argv without it."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def _positive_int(value: str, name: str) -> int:
    from llm_pretrain.errors import UsageError

    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{name}: {value!r} is not a positive whole number")
    return int(value)


def restart_plan(argv: list[str]) -> tuple[int, int, list[str], list[str], object]:
    """(max_restarts, configured ranks, launcher options without --max_restarts, training command, the
    training Arguments). UsageError (one line, before Paddle) for what restarts cannot work with."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError

    value, argv = _option(argv, "--max_restarts")
    max_restarts = _positive_int(value, "--max_restarts")
    script_at = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), None)
    if script_at is None:
        raise UsageError("--max_restarts: no training script (a .py file) in the command")
    options, command = argv[:script_at], argv[script_at:]
    nnodes, _ = _option(options, "--nnodes")
    master = _option(options, "--master")[0]
    if master and master.startswith("etcd://"):
        raise UsageError("--max_restarts: with an etcd:// master Paddle's launcher restarts the nodes itself "
                         "(docs/failures.md); leave out --max_restarts")
    if nnodes not in (None, "1", "2"):
        raise UsageError(f"--max_restarts: --nnodes {nnodes}: restarts are built for one node and for two (the node "
                         "left continues alone; see docs/failures.md); run one launcher per node without --max_restarts")
    if nnodes == "2" and not master:
        raise UsageError("--max_restarts: --nnodes 2 needs --master HOST:PORT (the same on both nodes)")
    nproc, _ = _option(options, "--nproc_per_node")
    if nproc is None:
        raise UsageError("--max_restarts: give --nproc_per_node (the ranks the job starts with)")
    args, _ = parse_arguments(command[1:])
    if not args.elastic:
        raise UsageError("--max_restarts: the argument file must have elastic: true (a restart on fewer ranks "
                         "changes the layout; without it the run would refuse to start)")
    return max_restarts, _positive_int(nproc, "--nproc_per_node"), options, command, args


def ranks_to_restart_on(args, left: int, device: str) -> tuple[int, str]:
    """The largest count of ranks <= left on which the elastic preflight holds the run, and why the larger
    counts cannot (empty when `left` can). UsageError from the preflight when no count can: its line names
    the smallest number of ranks that holds the run."""
    from llm_pretrain.errors import UsageError
    from llm_pretrain.run.preflight import elastic_arguments

    for count in range(left, 0, -1):
        try:
            elastic_arguments(args, count, device)
        except UsageError:
            if count == 1:
                elastic_arguments(args, left, device)  # raises the line for the ranks left
            continue
        return count, "" if count == left else f" ({', '.join(map(str, range(left, count, -1)))} cannot hold the run)"
    raise AssertionError("unreachable")


class Attempts:
    """Each attempt is this launcher (Paddle's, patched) in a child process, with nproc ranks; a stop
    signal is forwarded to it, and no attempt follows a stop."""

    launcher = ("-m", "llm_pretrain.launch")  # the child's command before its options (a test's stand-in replaces it)

    def __init__(self, options: list[str], command: list[str]):
        log_dir = _option(options, "--log_dir")[0] or "log"
        os.makedirs(log_dir, exist_ok=True)
        self.options, self.command = _option(options, "--nproc_per_node")[1], command
        self.failed_file = os.path.join(log_dir, "failed_ranks.json")
        self.child, self.stopped, self.forwarded = None, 0, False  # stopped: the signal's number
        signal.signal(signal.SIGTERM, self.forward)
        signal.signal(signal.SIGINT, self.forward)

    def forward(self, signum, frame):
        self.stopped = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
            self.forwarded = True

    def run(self, nproc: int, alone: bool = False) -> tuple[int, str | None, str | None]:
        """(exit code, the dead-rank report's line naming the rank that stopped first, and its "rank R: line"
        when this node's ranks failed because a peer's connection closed; None for each it did not say).
        alone: this node on its own (--nnodes 1, its own rendezvous: no --master, --rank, --ips)."""
        if os.path.exists(self.failed_file):
            os.remove(self.failed_file)
        options = self.options
        if alone:
            for name in ("--nnodes", "--master", "--rank", "--ips"):
                options = _option(options, name)[1]
            options = [*options, "--nnodes", "1"]
        self.child, self.forwarded = None, False
        child = subprocess.Popen([sys.executable, *self.launcher, *options, "--nproc_per_node", str(nproc),
                                  *self.command], env={**os.environ, FAILED_RANKS_ENV: self.failed_file})
        self.child = child
        if self.stopped and not self.forwarded:  # it came while the child was starting (once: a second is a force quit)
            child.send_signal(self.stopped)
        code = child.wait()
        try:
            with open(self.failed_file) as f:
                report = json.load(f)
            return code, report["line"], report.get("peer_gone")
        except (OSError, ValueError, KeyError):
            return code, None, None


def run_with_restarts(argv: list[str], attempts=Attempts) -> int:
    """`--max_restarts`: the attempts, each on the ranks left after the previous failure (module docstring)."""
    from llm_pretrain.errors import UsageError, exit_with_usage_error
    from llm_pretrain.run.preflight import choose_device

    try:
        max_restarts, configured, options, command, args = restart_plan(argv)
        device = choose_device(args)
    except UsageError as error:
        exit_with_usage_error(error)
    attempts = attempts(options, command)
    two_nodes, alone = _option(options, "--nnodes")[0] == "2", False
    nproc, restarts = configured, 0
    while True:
        code, first_stopped, peer_gone = attempts.run(nproc, alone)
        if code in (0, 2) or attempts.stopped or restarts >= max_restarts:
            return code
        if two_nodes and not alone:  # the node whose ranks lost their peer continues alone, the other one leaves
            if not peer_gone:
                print(f"launch: {_what(code, first_stopped)}; this node failed first, so it leaves the job: the other "
                      "node continues alone (no restart here)", file=sys.stderr, flush=True)
                return code
            restarts, alone = restarts + 1, True
            nproc, why = _restart_count(args, configured, device)
            print(f"launch: the other node is gone ({peer_gone}); restart {restarts} of {max_restarts} on this node "
                  f"alone (--nnodes 1), {nproc} of its {configured} ranks{why}, from the newest complete checkpoint",
                  file=sys.stderr, flush=True)
            continue
        restarts += 1
        # The rank that stopped first is lost (the other ranks' failures followed from it); no rank stopped
        # first (e.g. a collective timed out): all ranks are tried again. Grow back: each restart counts
        # from the configured ranks, not from the previous attempt's.
        lost = 1 if first_stopped and configured > 1 else 0  # a job of one rank restarts on it
        nproc, why = _restart_count(args, configured - lost, device)
        print(f"launch: {_what(code, first_stopped)}; restart {restarts} of {max_restarts} on {nproc} of the "
              f"{configured} ranks{why}, from the newest complete checkpoint", file=sys.stderr, flush=True)


def _restart_count(args, left: int, device: str) -> tuple[int, str]:
    """ranks_to_restart_on, its refusal as the one line of bad input (exit 2)."""
    from llm_pretrain.errors import UsageError, exit_with_usage_error

    try:
        return ranks_to_restart_on(args, left, device)
    except UsageError as error:
        exit_with_usage_error(error)


def _what(code: int, first_stopped: str | None) -> str:
    return (first_stopped.removeprefix("error: ").split(";")[0] if first_stopped else
            f"the attempt failed with exit code {code} and no rank stopped first")


# ----------------------------------------------------------------------------- nodes leave and return (etcd)
PROTOBUF_IMPLEMENTATION_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
# Paddle's wait for the nodes present must outlast the 5 s in which a launcher puts back its own heartbeat key
# (master.py:286) after a restart deleted every key (master.py:326-327, wait_peer_ready 302-324): with 3 s a
# launcher found no node at all and ended the job ("peer not ready", collective.py:301; seen in a test run).
MIN_ELASTIC_TIMEOUT = 10


def etcd_client(endpoint: str):
    """The etcd3 client Paddle's ETCDMaster makes (controllers/master.py:185-201), imported with protobuf's
    Python implementation: etcd3 0.12.0's generated modules predate protoc 3.19 and raise "Descriptors cannot be
    created directly" under protobuf >= 4's default one. The variable must be set before protobuf is first
    imported (Paddle imports it), and is removed again so that the workers Paddle starts from this environment
    keep the default implementation. UsageError when the client is missing or no server answers."""
    from llm_pretrain.errors import UsageError

    host, _, port = endpoint.removeprefix("etcd://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--master {endpoint}: expected etcd://HOST:PORT")
    set_here = PROTOBUF_IMPLEMENTATION_ENV not in os.environ
    if set_here:
        os.environ[PROTOBUF_IMPLEMENTATION_ENV] = "python"
    try:
        import etcd3
    except ImportError as error:
        raise UsageError(f"--master {endpoint}: Paddle's elastic launcher needs the etcd3 client "
                         f"(pip install etcd3==0.12.0; {error})") from None
    finally:
        if set_here:
            del os.environ[PROTOBUF_IMPLEMENTATION_ENV]
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        client.status()
    except Exception as error:  # etcd3 raises its ConnectionFailedError or grpc's errors
        raise UsageError(f"--master {endpoint}: no etcd server answers there ({type(error).__name__})") from None
    return client


def elastic_nodes_argv(argv: list[str]) -> list[str]:
    """Paddle's launcher options for `--master etcd://` (module docstring), checked before Paddle is imported.
    UsageError (one line) for what cannot work."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError

    master = _option(argv, "--master")[0]
    script_at = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), len(argv))
    options, command = argv[:script_at], argv[script_at:]
    nnodes = _option(options, "--nnodes")[0] or "1"
    low, _, high = nnodes.partition(":")
    if not low.isdigit() or not (high or low).isdigit() or not 1 <= int(low) <= int(high or low):
        raise UsageError(f"--nnodes {nnodes}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    if int(low) < int(high or low) and command[1:]:
        args, _ = parse_arguments(command[1:])  # imports no protobuf (etcd_client needs to be its first importer)
        if not args.elastic:
            raise UsageError(f"--nnodes {nnodes}: the argument file must have elastic: true (on fewer nodes the "
                             "layout changes; without it the run would refuse to start)")
    wait = _option(options, "--elastic_timeout")[0] or "30"
    if not wait.isdigit() or int(wait) < MIN_ELASTIC_TIMEOUT:
        raise UsageError(f"--elastic_timeout {wait}: at least {MIN_ELASTIC_TIMEOUT} s under an etcd master (each launcher "
                         "writes its heartbeat key again every 5 s after a restart deleted it, paddle/distributed/launch/"
                         "controllers/master.py:286, 326-327; a shorter wait can find no node and end the job)")
    etcd_client(master)
    if _option(options, "--elastic_level")[0] is None:
        options = [*options, "--elastic_level", "1"]
    return [*options, *command]


def main() -> None:
    if any(arg == "--max_restarts" or arg.startswith("--max_restarts=") for arg in sys.argv[1:]):
        sys.exit(run_with_restarts(sys.argv[1:]))
    if (_option(sys.argv[1:], "--master")[0] or "").startswith("etcd://"):
        from llm_pretrain.errors import UsageError, exit_with_usage_error

        try:
            sys.argv[1:] = elastic_nodes_argv(sys.argv[1:])
        except UsageError as error:
            exit_with_usage_error(error)
    install_graceful_stop()
    install_dead_rank_report()
    from paddle.distributed.launch.main import launch

    launch()


if __name__ == "__main__":
    main()
