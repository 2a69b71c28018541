"""Launches shared by several test files: one `paddle.distributed.launch` per fleet layout per session.

Each launch costs, before its first training, a Python start and Paddle's import in every process
and fleet.init (its groups): about 6 s for 2 processes and 10 s for 4 on two idle cores (measured:
from the launch to the first step), three times that on a loaded machine. Tests of different files that give fleet the same degrees (the
parity tests, the mechanism probes, the uneven pipeline, the GQA layouts) therefore train their
runs one after the other in one launch, through the mechanism probes (tests/workers/mechanism_runs.py:
they watch every run and change no number, so a parity run is the same run under them).

A test file declares its part of a launch when pytest imports it (it imports every collected file
before any test runs)::

    shared_launches.contribute("tp2", 2, "mechanisms", make_runs)

`make_runs(work, corpus)` returns the file's runs, [{"name": ..., "argv": [run_pretrain.py arguments], ...}]
(the worker's run specs), with every path under `work` (the file's own directory of the session,
`SharedLaunches.work_dir(owner)`; it writes its argument files there too: it may be called before the
file's own fixtures; `corpus` is the session's embedded corpus). The first test asking
for a launch (`SharedLaunches.results`) runs it with the runs of every collected file that
contributed, in the order of contribution (runs that fail on purpose: `last=True`), and gets back
its own file's observations, {rank: {run name: observations}}; a launch that resumes runs stopped
in other shared launches names them (`after=`), and they run first. A launch that failed fails
every test asking for it, without running again. A file collected alone (one test, a mutation
check) launches its runs alone: nothing else is imported.

Under pytest-xdist both workers share one root (the session's base directory, `session_root`): a launch runs
once per session on whichever worker asks for it first, under a file lock, and its observations (or its
failure) are files there that the other worker reads. Test files therefore need not share a worker, and the
launches spread over both. Work a make_runs or a fixture does once for several launches (a file's
single-process first parts) goes through `once` (the same lock and a marker file).
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launch_utils import REPO_ROOT, launch
from parity_utils import DEVICE, write_json

WORKER = REPO_ROOT / "tests" / "workers" / "mechanism_runs.py"


@dataclass
class Contribution:
    owner: str
    make_runs: Callable[[Path, dict], list[dict]]
    last: bool
    after: tuple[str, ...]


LAUNCHES: dict[str, tuple[int, list[Contribution]]] = {}  # launch name -> (processes, contributions)


def contribute(launch_name: str, nproc: int, owner: str, make_runs: Callable[[Path, dict], list[dict]],
               last: bool = False, after: tuple[str, ...] = ()) -> None:
    """Add `owner`'s runs to the session's launch `launch_name` (all with the same fleet degrees).
    `after`: shared launches that must have run first (they hold the first parts of runs resumed here);
    make_runs may itself run what else its runs need (a file's single-process first parts), once."""
    processes, contributions = LAUNCHES.setdefault(launch_name, (nproc, []))
    assert processes == nproc, f"launch {launch_name}: {owner} asks for {nproc} processes, others {processes}"
    if all(c.owner != owner for c in contributions):  # a module imported twice contributes once
        contributions.append(Contribution(owner, make_runs, last, tuple(after)))


def session_root(tmp_path_factory) -> Path:
    """The shared launches' directory: one per pytest session, the same for every xdist worker (their base
    directories are popen-gw0, popen-gw1 ... under the session's); a plain session's own otherwise."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "shared_launches"
        root.mkdir(exist_ok=True)
        return root
    return tmp_path_factory.mktemp("shared_launches")


@contextmanager
def locked(path: Path):
    """An exclusive lock on `path` between the session's processes (both xdist workers)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def once(marker: Path, work: Callable[[], None]) -> None:
    """Run `work` once per session whichever worker asks first; the others wait for it to end."""
    with locked(marker.with_name(marker.name + ".lock")):
        if not marker.exists():
            work()
            marker.write_text("")


class SharedLaunches:
    def __init__(self, root: Path, corpus: dict):
        self.root, self.corpus = root, corpus
        self._results: dict[str, dict[str, dict[int, dict]]] = {}  # launch -> owner -> rank -> {name: seen}

    def work_dir(self, owner: str) -> Path:
        path = self.root / owner
        path.mkdir(parents=True, exist_ok=True)
        return path

    def results(self, launch_name: str, owner: str, timeout: int = 1800) -> dict[int, dict]:
        """The observations of `owner`'s runs in the launch, running it first if it has not run."""
        if launch_name not in self._results:
            self._ensure(launch_name, timeout, ())
        return self._results[launch_name][owner]

    def _ensure(self, launch_name: str, timeout: int, waiting: tuple[str, ...]) -> None:
        """The launch's observations, from its file if it ran (on either worker), else by running it now."""
        done, failed = self.root / f"{launch_name}.results.json", self.root / f"{launch_name}.failed"
        with locked(self.root / f"{launch_name}.lock"):
            if not (done.exists() or failed.exists()):
                try:
                    per_owner = self._run_once(launch_name, timeout, waiting)
                except AssertionError as error:
                    failed.write_text(str(error))
                    raise
                done.write_text(json.dumps(per_owner))
        if failed.exists():
            raise AssertionError(f"shared launch {launch_name} failed earlier:\n{failed.read_text()}")
        self._results[launch_name] = {owner: {int(rank): seen for rank, seen in ranks.items()}
                                      for owner, ranks in json.loads(done.read_text()).items()}

    def _run_once(self, launch_name: str, timeout: int, waiting: tuple[str, ...]) -> dict:
        nproc, contributions = LAUNCHES[launch_name]
        for first in dict.fromkeys(name for c in contributions for name in c.after):
            assert first not in waiting + (launch_name,), f"shared launches wait for each other: {waiting}"
            if first not in self._results:
                self._ensure(first, timeout, waiting + (launch_name,))
        ordered = sorted(contributions, key=lambda c: c.last)  # stable: the order of contribution otherwise
        specs, owner_of = [], {}
        for contribution in ordered:
            for run in contribution.make_runs(self.work_dir(contribution.owner), self.corpus):
                name = f"{contribution.owner}/{run['name']}"
                assert name not in owner_of, f"launch {launch_name}: two runs named {name}"
                owner_of[name] = contribution.owner
                specs.append({**run, "name": name})
        runs_file = write_json(self.root / f"{launch_name}.runs.json", specs)
        result = launch(WORKER, nproc, [str(runs_file)], log_dir=self.root / f"{launch_name}.log", timeout=timeout,
                        device=DEVICE).check()
        per_owner = {c.owner: {rank: {} for rank in range(nproc)} for c in contributions}
        for rank, observed in result.results().items():
            for name, seen in observed.items():
                per_owner[owner_of[name]][rank][name.split("/", 1)[1]] = seen
        return per_owner
