"""tests/shared_launches.py between the two xdist workers: a launch runs once per session, whichever worker asks
first; the other reads its observations (or its failure) from the shared root, and `after` launches run first.
Two SharedLaunches on one root stand for the two workers; the launcher is replaced (no Paddle here)."""

from __future__ import annotations

import threading
import time

import pytest

import shared_launches
from shared_launches import SharedLaunches, once


class FakeLaunch:
    def __init__(self, fail: str = ""):
        self.calls, self.fail = [], fail

    def __call__(self, worker, nproc, args, log_dir, timeout, device):
        import json

        specs = json.loads(open(args[0]).read())
        self.calls.append(log_dir.name)
        time.sleep(0.2)  # long enough for the other "worker" to arrive while it runs
        fail = self.fail

        class Result:
            def check(self):
                if fail and fail in log_dir.name:
                    raise AssertionError(f"launch failed: {log_dir.name}")
                return self

            def results(self):
                return {rank: {spec["name"]: {"rank": rank, "log": log_dir.name} for spec in specs}
                        for rank in range(nproc)}
        return Result()


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setattr(shared_launches, "LAUNCHES", {})
    for name, after in (("first", ()), ("second", ("first",))):
        for owner in ("a", "b"):
            shared_launches.contribute(name, 2, owner, lambda work, corpus, owner=owner: [
                {"name": f"{owner}-run", "argv": []}], after=after)


def test_a_launch_runs_once_for_both_workers_and_its_first_launch_before_it(launches, monkeypatch, tmp_path):
    fake = FakeLaunch()
    monkeypatch.setattr(shared_launches, "launch", fake)
    workers = [SharedLaunches(tmp_path, {}), SharedLaunches(tmp_path, {})]
    seen = {}
    threads = [threading.Thread(target=lambda i=i: seen.__setitem__(i, workers[i].results("second", "ab"[i])))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fake.calls == ["first.log", "second.log"]  # once each, the one it resumes first
    assert seen[0] == {0: {"a-run": {"rank": 0, "log": "second.log"}}, 1: {"a-run": {"rank": 1, "log": "second.log"}}}
    assert seen[1][1] == {"b-run": {"rank": 1, "log": "second.log"}}
    assert workers[1].results("first", "b")[0] == {"b-run": {"rank": 0, "log": "first.log"}}
    assert fake.calls == ["first.log", "second.log"]


def test_a_failed_launch_fails_the_other_worker_without_running_again(launches, monkeypatch, tmp_path):
    fake = FakeLaunch(fail="first")
    monkeypatch.setattr(shared_launches, "launch", fake)
    with pytest.raises(AssertionError, match="launch failed: first.log"):
        SharedLaunches(tmp_path, {}).results("second", "a")
    with pytest.raises(AssertionError, match="shared launch second failed earlier:\nlaunch failed: first.log"):
        SharedLaunches(tmp_path, {}).results("second", "b")
    assert fake.calls == ["first.log"]


def test_once_runs_its_work_once_across_processes(tmp_path):
    done = []
    threads = [threading.Thread(target=once, args=(tmp_path / "work.done", lambda: (time.sleep(0.2), done.append(1))))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert done == [1] and (tmp_path / "work.done").exists()
