"""Loss spikes, skipped data intervals, asynchronous checkpoints, slow and hung ranks (issue 26).

The spike tests train on a copy of the embedded corpus in which the samples of chosen steps are
overwritten with one token the corpus never holds (a window of garbage tokens): the loss of such
a step jumps well above the running mean. Each outcome is checked against a run that skips the
same data by skip_data_intervals, which must match exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_pretrain.selfcheck.parity import garbage_corpus
from parity_utils import argv, base_arguments, final_weights, train_records, write_json
from shared_launches import contribute
from test_fault_injection import checkpoints, log_lines, one_error_line, run_cli, small_run

STEPS = 20  # save every 5; the garbage sits at steps 12 and 13


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(output_dir)}


def events(output_dir: Path, event: str) -> list[dict]:
    return [r for r in log_lines(output_dir) if r["event"] == event]


def assert_same_weights(a: Path, b: Path, step: int) -> None:
    left, right = final_weights(a, step), final_weights(b, step)
    assert all(np.array_equal(left[k], right[k]) for k in left)


def test_skip_data_intervals_and_rollback_resume_exactly(embedded_corpus, tmp_path):
    """skip_data_intervals [[11, 16]] straight and interrupted inside the interval (exit_interval 13)
    are identical; a loss spike at step 12 (garbage at 12 and 13) with rollback and
    loss_spike_skip_steps 4 reloads checkpoint-10 and skips steps 11-16: the same run again, also
    when it is stopped at step 15 (inside the skip) and resumed."""
    args_file = small_run(embedded_corpus, tmp_path, max_steps=STEPS, save_steps=5, hidden_dropout_prob=0.1)
    skip = ["--skip_data_intervals", "[[11,16]]"]
    straight = tmp_path / "skip-straight"
    result = run_cli(args_file, "--output_dir", straight, *skip)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in events(straight, "skipped_data")] == list(range(11, 17))
    assert events(straight, "skipped_data")[0]["samples"] == [80, 88]
    assert set(losses(straight)) == set(range(1, 11)) | set(range(17, STEPS + 1))
    assert events(straight, "summary")[-1]["data_skipped_steps"] == 6
    assert "data skipped steps 6" in result.stdout

    interrupted = tmp_path / "skip-interrupted"
    for exit_interval in ("13", "100"):  # stop after step 13, inside the interval; then resume to the end
        result = run_cli(args_file, "--output_dir", interrupted, *skip, "--exit_interval", exit_interval)
        assert result.returncode == 0, result.stderr[-3000:]
    assert losses(interrupted) == losses(straight)
    assert_same_weights(interrupted, straight, STEPS)

    # The garbage makes a spike; rollback to checkpoint-10 and skip 11..12+4.
    garbage = garbage_corpus(embedded_corpus, tmp_path, args_file, [12, 13])
    spike = ["--input_dir", garbage, "--loss_spike_factor", "1.2", "--loss_spike_window", "4",
             "--loss_spike_action", "rollback", "--loss_spike_skip_steps", "4"]
    rolled = tmp_path / "rollback"
    for exit_interval in ("15", "100"):  # stopped inside the skipped steps, then resumed
        result = run_cli(args_file, "--output_dir", rolled, *spike, "--exit_interval", exit_interval)
        assert result.returncode == 0, result.stderr[-3000:]
        if exit_interval == "15":
            warning = [line for line in result.stdout.splitlines() if "rolled back" in line]
            assert len(warning) == 1 and warning[0].startswith("warning: step 12: loss spike"), result.stdout
            assert "rolled back to checkpoint-10, skipping the data of steps 11 to 16 (samples 80 to 127)" in warning[0]
    spikes, rollbacks = events(rolled, "loss_spike"), events(rolled, "rollback")
    assert [(r["step"], r["action"]) for r in spikes] == [(12, "rollback")], spikes
    assert spikes[0]["loss"] > spikes[0]["threshold"]
    assert [(r["checkpoint"], r["skipped_steps"], r["skipped_samples"]) for r in rollbacks] == \
        [("checkpoint-10", [11, 16], [80, 128])]
    summaries = events(rolled, "summary")
    assert summaries[0]["loss_spikes"] == 1 and summaries[0]["rollbacks"] == 1
    assert [r["step"] for r in events(rolled, "skipped_data")] == list(range(11, 17))  # 16 after the resume
    final = {step: loss for step, loss in losses(rolled).items()}
    for step in range(17, STEPS + 1):
        assert final[step] == losses(straight)[step], step
    assert_same_weights(rolled, straight, STEPS)


def test_a_spike_right_after_a_rollbacks_skipped_steps_is_caught(embedded_corpus, tmp_path):
    """A rollback restores the spike window saved with the checkpoint, so detection is on from the first
    step after the skipped range: garbage at steps 12 and 15; the spike at 12 rolls back to
    checkpoint-10 and skips steps 11-14 (loss_spike_skip_steps 2); the one at 15 is caught (a window
    emptied by the rollback would need 4 new losses first) and rolls back again, skipping 11-17."""
    args_file = small_run(embedded_corpus, tmp_path, max_steps=STEPS, save_steps=5, hidden_dropout_prob=0.0)
    garbage = garbage_corpus(embedded_corpus, tmp_path, args_file, [12, 15])
    out = tmp_path / "rollbacks"
    result = run_cli(args_file, "--output_dir", out, "--input_dir", garbage, "--loss_spike_factor", "1.1",
                     "--loss_spike_window", "4", "--loss_spike_action", "rollback", "--loss_spike_skip_steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    spikes = events(out, "loss_spike")
    assert [(r["step"], r["action"]) for r in spikes] == [(12, "rollback"), (15, "rollback")], spikes
    assert spikes[1]["loss"] > spikes[1]["threshold"]
    assert [(r["step"], r["checkpoint"], r["skipped_steps"]) for r in events(out, "rollback")] == \
        [(12, "checkpoint-10", [11, 14]), (15, "checkpoint-10", [11, 17])]
    assert set(losses(out)) == set(range(1, 12)) | set(range(18, STEPS + 1))  # 11: trained, then undone


def test_spike_skip_equals_skipping_its_data_and_stop_is_exit_3(embedded_corpus, tmp_path):
    """loss_spike_action skip drops the update of both garbage steps (no dropout here, so the run
    equals the one that skips those steps' data); stop ends the run at the first spike, exit code 3;
    warn logs it and trains on."""
    args_file = small_run(embedded_corpus, tmp_path, max_steps=STEPS, save_steps=0, hidden_dropout_prob=0.0)
    garbage = garbage_corpus(embedded_corpus, tmp_path, args_file, [12, 13])
    spike = ["--input_dir", garbage, "--loss_spike_factor", "1.2", "--loss_spike_window", "4"]
    skipped = tmp_path / "spike-skip"
    result = run_cli(args_file, "--output_dir", skipped, *spike, "--loss_spike_action", "skip", "--save_steps", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line.split(";")[1].strip() for line in result.stdout.splitlines()
            if line.startswith("warning: step")] == \
        ["update skipped (loss_spike_action skip)"] * 2, result.stdout[-3000:]
    assert [r["step"] for r in events(skipped, "loss_spike")] == [12, 13]
    summary = events(skipped, "summary")[-1]
    assert (summary["loss_spikes"], summary["spike_skipped_steps"]) == (2, 2)
    assert "loss spikes 2, spike skipped steps 2" in result.stdout

    reference = tmp_path / "data-skip"
    result = run_cli(args_file, "--output_dir", reference, "--skip_data_intervals", "[[12,13]]", "--save_steps", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(skipped) == losses(reference)
    assert_same_weights(skipped, reference, STEPS)

    result = run_cli(args_file, "--output_dir", tmp_path / "spike-stop", *spike, "--loss_spike_action", "stop")
    one_error_line(result, 3, "step 12: loss spike", "loss_spike_action stop")

    warned = tmp_path / "spike-warn"  # warn: logged and counted, the step trains
    result = run_cli(args_file, "--output_dir", warned, *spike, "--loss_spike_action", "warn")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("warning: step 12: loss spike")]
    warned_spikes = [(r["step"], r["action"]) for r in events(warned, "loss_spike")]
    assert warned_spikes[0] == (12, "warn") and {action for _, action in warned_spikes} == {"warn"}
    assert 12 in losses(warned) and "spike_skipped_steps" not in events(warned, "summary")[-1]


@pytest.mark.parametrize("overrides, fragments", [
    ({"loss_spike_factor": 1.0, "loss_spike_window": 4}, ("loss_spike_factor: 1.0", "above 1")),
    ({"loss_spike_factor": 3, "loss_spike_window": 1}, ("loss_spike_window: 1", "at least 2")),
    ({"loss_spike_factor": 3}, ("loss_spike_window: set it too",)),
    ({"loss_spike_factor": 3, "loss_spike_window": 4, "loss_spike_action": "rollback", "save_steps": 0},
     ("rollback needs checkpoints",)),
    ({"skip_data_intervals": [[5, 3]]}, ("skip_data_intervals: [5, 3]", "first <= last")),
    ({"skip_data_intervals": [[-1, 3]]}, ("skip_data_intervals: [-1, 3]",)),
    ({"skip_data_intervals": [[1, 4], [4, 6]]}, ("[1, 4] and [4, 6] overlap",)),
    ({"skip_data_intervals": [1, 4]}, ("skip_data_intervals: expected a list of [first step, last step] pairs",)),
    ({"unified_checkpoint_config": "async_save fast"}, ("unknown option 'fast'",)),
])
def test_bad_resilience_arguments_are_one_line(embedded_corpus, tmp_path, overrides, fragments):
    args_file = small_run(embedded_corpus, tmp_path, **overrides)
    result = run_cli(args_file, "--output_dir", tmp_path / "out")
    one_error_line(result, 2, *fragments)
    assert result.stdout == "" and not (tmp_path / "out").exists()


def test_spike_skip_is_refused_under_the_pipeline_and_rollback_is_not(embedded_corpus, tmp_path):
    """fleet's train_batch applies the update before the loss is known: skip is one line there;
    rollback reloads the checkpoint (discarding that update) and is allowed. check_startup runs
    before fleet.init, so a 2-stage layout needs no launch."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import Layout
    from llm_pretrain.errors import UsageError
    from llm_pretrain.parallel.layout import build_model_config
    from llm_pretrain.run.preflight import check_startup

    def startup(action, layout):
        args, _ = parse_arguments([str(small_run(embedded_corpus, tmp_path)), "--loss_spike_factor", "3",
                                   "--loss_spike_window", "4", "--loss_spike_action", action])
        check_startup(args, build_model_config(args, layout, "cpu")[0], layout, "cpu")

    pipeline = Layout(world_size=2, pipeline_parallel_degree=2)
    with pytest.raises(UsageError, match=r"^loss_spike_action: skip is not available with pipeline_parallel_degree"):
        startup("skip", pipeline)
    startup("rollback", pipeline)
    startup("skip", Layout(world_size=2, data_parallel_degree=2))


# ----------------------------------------------------------------------------- asynchronous checkpoints
def test_async_save_writes_the_same_checkpoints_and_survives_kill_9(embedded_corpus, tmp_path):
    """async_save: the same losses and checkpoints as synchronous saves, each finalized at a later
    step than it was taken; kill -9 while checkpoint-10 is being written (its .partial exists) leaves
    checkpoint-5 the newest complete one, and the resumed run ends as the uninterrupted one."""
    import signal
    import time

    from llm_pretrain.checkpoint.checkpointer import latest_checkpoint, verify_checkpoint
    from test_fault_injection import start_cli

    args_file = small_run(embedded_corpus, tmp_path, max_steps=STEPS, save_steps=5, hidden_dropout_prob=0.1)
    sync, asynchronous = tmp_path / "sync", tmp_path / "async"
    assert run_cli(args_file, "--output_dir", sync).returncode == 0
    result = run_cli(args_file, "--output_dir", asynchronous, "--async_save", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(asynchronous) == losses(sync)
    for step in (5, 10, 15, 20):
        assert verify_checkpoint(str(asynchronous / f"checkpoint-{step}")) is None
        assert_same_weights(asynchronous, sync, step)
    saves = events(asynchronous, "save")
    assert [(r["step"], r["async"]) for r in saves] == [(5, True), (10, True), (15, True), (20, True)]
    completed = {r["step"]: r["completed_at_step"] for r in events(asynchronous, "save_completed")}
    # finalized at the first step boundary after every rank's write ended: before the next save
    assert all(step < completed[step] < step + 5 for step in (5, 10, 15)) and completed[20] == 20, completed
    # The planner's host-memory term (llm_pretrain/planner/memory.py checkpoint_state_bytes) is the copy.
    predicted = [r for r in log_lines(asynchronous) if r["event"] == "run"][0]["prediction"]["async_save_host_mb"]
    assert all(r["host_copy_mb"] == pytest.approx(predicted, rel=1e-3) for r in events(asynchronous, "save_completed"))

    killed = tmp_path / "killed"  # PaddleNLP's spelling of the switch
    command = [args_file, "--output_dir", killed, "--unified_checkpoint_config", "async_save"]
    proc = start_cli(*command)
    try:
        deadline = time.monotonic() + 240
        while not (killed / "checkpoint-10.partial").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    assert latest_checkpoint(str(killed)).endswith("checkpoint-5"), checkpoints(killed)
    assert not (killed / "checkpoint-10.partial" / "COMPLETE").exists()
    result = run_cli(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(killed) == losses(sync)
    assert_same_weights(killed, sync, STEPS)
    assert "checkpoint-10.partial" not in checkpoints(killed)


def test_async_save_writes_the_state_at_the_save_while_the_disk_is_slow(monkeypatch, tmp_path):
    """async_save's host copy: the writer is held (a slow disk) while every weight and optimizer state
    is changed in place (training goes on); once the write is let through, checkpoint-1 holds the
    values at the save, not the changed ones. Without the copy the writer reads the live tensors."""
    import threading

    import paddle

    from llm_pretrain.checkpoint import dist_checkpoint
    from llm_pretrain.checkpoint.checkpointer import Checkpointer, verify_checkpoint
    from llm_pretrain.parallel.distributed import Layout
    from models.decoder import CausalLM
    from models.registry import make_config

    config = make_config("llama", vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32)
    paddle.seed(5)
    model = CausalLM(config)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    tokens = paddle.randint(0, 64, [2, 9])
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # one step: every AdamW moment exists
    optimizer.step()
    optimizer.clear_grad()
    held = dist_checkpoint.held_tensors(model, optimizer, Layout())
    at_save = {t.name: np.array(t.tensor.numpy()) for t in held}
    assert any("/moment1" in name for name in at_save) and any("/moment2" in name for name in at_save)

    disk_free, writer_waiting = threading.Event(), threading.Event()
    write_snapshot = dist_checkpoint.write_snapshot

    def slow_disk(*args, **kwargs):
        writer_waiting.set()
        assert disk_free.wait(60), "the test never let the write through"
        return write_snapshot(*args, **kwargs)

    monkeypatch.setattr(dist_checkpoint, "write_snapshot", slow_disk)
    checkpointer = Checkpointer(str(tmp_path), Layout(), save_steps=1, save_total_limit=None, async_save=True)
    checkpointer.save_async(1, model, optimizer, {"global_step": 1, "consumed_samples": 2})
    assert writer_waiting.wait(60) and checkpointer.write_pending()
    with paddle.no_grad():  # training goes on: every tensor of the checkpoint changes, in place
        for t in held:
            t.tensor.set_value(t.tensor * 2.0 + 1.0)
    changed = {t.name: t.tensor.numpy() for t in held}
    assert all(not np.array_equal(changed[name], at_save[name]) for name in at_save)
    disk_free.set()
    assert checkpointer.complete_pending() is not None
    path = tmp_path / "checkpoint-1"
    assert verify_checkpoint(str(path)) is None
    with dist_checkpoint.CheckpointReader(str(path)) as reader:
        assert set(reader.tensors) == set(at_save)
        for name, value in at_save.items():
            assert np.array_equal(reader.read_full(name).reshape(value.shape), value), name


# Two-rank runs in the session's dp2 and sd2 launches (tests/shared_launches.py): the same run saved
# synchronously and asynchronously with rank 1's disk slow (its first write, on the writer thread, starts
# only after training has gone SLOW_DISK_STEPS steps further), and on dp2 a run whose rank 1 is slow
# (STRAGGLER_DELAY_S before each step's flag reduction); tests/workers/mechanism_runs.py slowed.
SLOW_DISK_STEPS, STRAGGLER_DELAY_S = 2, 1.0


def two_rank_runs(layout: str):
    def make_runs(work: Path, corpus: dict) -> list[dict]:
        sharding = {"sharding": "stage2"} if layout == "sd2" else {}
        args_file = write_json(work / f"{layout}.json", base_arguments(corpus, work, num_hidden_layers=2, max_steps=8,
                                                                       save_steps=4, **sharding))
        runs = [{"name": f"{layout}-sync", "argv": argv(args_file, work / layout / "sync")},
                {"name": f"{layout}-async", "argv": argv(args_file, work / layout / "async", async_save=True),
                 "slow_disk": {"rank": 1, "steps": SLOW_DISK_STEPS}}]
        if layout == "dp2":
            runs.append({"name": "dp2-straggler", "slow_rank": {"rank": 1, "seconds": STRAGGLER_DELAY_S},
                         "argv": argv(args_file, work / layout / "straggler", max_steps=4, logging_steps=2,
                                      save_steps=0)})
        return runs
    return make_runs


contribute("dp2", 2, "resilience", two_rank_runs("dp2"))
contribute("sd2", 2, "resilience", two_rank_runs("sd2"))


@pytest.mark.parametrize("layout", ["dp2", "sd2"])
def test_async_save_on_two_ranks_with_a_slow_disk_writes_the_state_at_the_save(shared_launches, layout):
    """dp2 and sharding stage 2: rank 1's write of checkpoint-4 starts after steps 5 and 6 changed the
    weights (rank 0's ended at once); checkpoint-4 is finalized only after both ranks' writes ended (the
    step's flag reduction carries "write pending": not before step 7), and every checkpoint holds exactly
    the synchronous run's weights and optimizer states (each rank writes its share of them)."""
    from llm_pretrain.checkpoint.checkpointer import verify_checkpoint
    from llm_pretrain.checkpoint.dist_checkpoint import CheckpointReader

    shared_launches.results(layout, "resilience")
    work = shared_launches.work_dir("resilience") / layout
    sync, asynchronous = work / "sync", work / "async"
    assert losses(asynchronous) == losses(sync)
    assert [(r["step"], r["async"]) for r in events(asynchronous, "save")] == [(4, True), (8, True)]
    completed = {r["step"]: r["completed_at_step"] for r in events(asynchronous, "save_completed")}
    assert completed == {4: completed[4], 8: 8} and 4 + SLOW_DISK_STEPS < completed[4] <= 8, completed
    for step in (4, 8):
        path = asynchronous / f"checkpoint-{step}"
        assert verify_checkpoint(str(path)) is None
        written = json.loads((path / "manifest.json").read_text())["files"]
        assert {entry["rank"] for name, entry in written.items() if name.startswith("tensors.rank")} == {0, 1}
        with CheckpointReader(str(path)) as got, CheckpointReader(str(sync / f"checkpoint-{step}")) as want:
            assert set(got.tensors) == set(want.tensors) and any("/moment1" in n for n in got.tensors)
            for name in want.tensors:
                assert np.array_equal(got.read_full(name), want.read_full(name)), (step, name)


def test_a_slow_rank_is_named_and_its_own_time_exceeds_the_others_by_the_delay(shared_launches):
    """dp2, rank 1 slowed by STRAGGLER_DELAY_S in its own share of every step: each logging step's
    record names rank 1 the slowest, and its own step time exceeds rank 0's by about the delay (rank 0's
    own time stops where it starts waiting for rank 1: the whole step time would show no difference)."""
    shared_launches.results("dp2", "resilience")
    records = train_records(shared_launches.work_dir("resilience") / "dp2" / "straggler")
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        own = record["rank_step_time_s"]
        assert record["slowest_rank"]["rank"] == 1 and record["fastest_rank"]["rank"] == 0, record
        # about the delay: the ranks' own compute differs by a few tenths of a second on a loaded machine
        assert 0.6 * STRAGGLER_DELAY_S < own[1] - own[0] < STRAGGLER_DELAY_S + 1.0, own
        assert record["step_time_s"] > STRAGGLER_DELAY_S  # every rank's step waited for rank 1


# ----------------------------------------------------------------------------- slow and hung ranks
def test_straggler_record_and_a_stalled_rank_ends_the_job_in_one_line(embedded_corpus, tmp_path):
    """dp2: every logging step records both ranks' step times and data waits and names the slowest and
    fastest; then rank 1 is stopped (SIGSTOP) mid-run: within hang_timeout_minutes rank 0, blocked in a
    collective, dumps its stacks and ends the job with one line naming rank 1 (exit code 1)."""
    import os
    import signal
    import time

    from parity_utils import RUN_PRETRAIN, argv
    from test_fault_injection import _kill_session, _start_launch

    args_file = small_run(embedded_corpus, tmp_path, max_steps=1000, save_steps=0, hang_timeout_minutes=0.15)
    logs, out = tmp_path / "log", tmp_path / "out"
    launcher = _start_launch(2, RUN_PRETRAIN, argv(args_file, out), logs)
    try:
        deadline, beat = time.monotonic() + 240, {"step": 0}
        while launcher.poll() is None and time.monotonic() < deadline and beat["step"] < 3:
            try:
                beat = json.loads((logs / "heartbeat.1.json").read_text())
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        assert beat["step"] >= 3, (launcher.poll(), beat)
        os.kill(beat["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        launcher.communicate(timeout=240)
        waited = time.monotonic() - stopped_at
    finally:
        _kill_session(launcher.pid)
    assert launcher.returncode == 1, launcher.returncode
    assert 9 <= waited < 90, waited  # the timeout (9 s), the reports, the launcher ending the job
    log0 = (logs / "workerlog.0").read_text(errors="replace")
    errors = [line for line in log0.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in log0, log0[-3000:]
    assert errors[0].startswith("error: hang: no step finished for 0.15 minutes (hang_timeout_minutes) after step ")
    assert "rank(s) 1 did not reach the collective" in errors[0] and "that rank(s) 0 wait in" in errors[0]
    assert "rank 1: no report: stopped, or blocked without Python" in errors[0], errors[0]
    report = json.loads((logs / "hang.rank0.json").read_text())
    assert report["collective"] and report["step"] >= 3, report
    stacks = (logs / "hang.rank0.txt").read_text()
    assert "(most recent call first)" in stacks and "run_pretrain.py" in stacks, stacks[-2000:]

    records = [r for r in log_lines(out) if r["event"] == "train"]
    assert len(records) >= 3
    for record in records:
        times = record["rank_step_time_s"]
        assert len(times) == 2 and len(record["rank_data_wait_s"]) == 2
        assert record["slowest_rank"] == {"rank": times.index(max(times)), "step_time_s": max(times),
                                          "data_wait_s": record["rank_data_wait_s"][times.index(max(times))]}
        assert record["fastest_rank"]["step_time_s"] == min(times)
    assert "slowest rank " in log0 and ", fastest rank " in log0


SLOW_SAVE = """
import sys, time
from llm_pretrain.checkpoint.checkpointer import Checkpointer
from llm_pretrain.run_pretrain import main

save = Checkpointer.save
def slow_save(self, *args, **kwargs):
    time.sleep(float(sys.argv[1]))  # a slow file system: no collective, the rank's own work
    return save(self, *args, **kwargs)
Checkpointer.save = slow_save
sys.exit(main(sys.argv[2:]))
"""


def test_a_save_longer_than_the_hang_timeout_does_not_end_a_healthy_job(embedded_corpus, tmp_path):
    """hang_timeout_minutes 0.05 (3 s), every save 7 s (issue 33, finding 7): the watchdog was fed only after a
    step, so the first save ended the job as hung (exit 1, a hang report). A save is a phase of its own
    (run_control.HangWatchdog.phase): while the rank works outside any collective it is progress; the run
    ends with its two checkpoints and no hang report."""
    import subprocess
    import sys

    from launch_utils import REPO_ROOT
    from parity_utils import argv
    from test_fault_injection import _env

    args_file = small_run(embedded_corpus, tmp_path, max_steps=2, save_steps=1, hang_timeout_minutes=0.05)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", SLOW_SAVE, "7", *map(str, argv(args_file, out))],
                            capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hang" not in result.stderr and not list(out.glob("hang.rank*")), result.stderr[-3000:]
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert [r["step"] for r in train_records(out)] == [1, 2]


def test_the_hang_report_names_the_phase_and_a_device_wait():
    """What a rank waits in: a phase between steps ("in save") and, on NCCL, a read of the device (the host
    blocks in .numpy() while a queued collective waits for a peer) instead of "not in a collective"."""
    import time
    from types import SimpleNamespace

    import llm_pretrain.run.trainer as trainer
    from llm_pretrain.run.run_control import collective_of, describe_hang

    # The frame of a GPU rank blocked in agree_on_step's read of the flags (the C++ call has no frame of its own).
    source = Path(trainer.__file__).read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(source) if "host = paddle.concat(values).numpy()" in text)
    frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=trainer.__file__, co_name="agree_on_step"),
                            f_lineno=line, f_back=None)
    assert collective_of(frame, True) == (f"waiting for the device (.numpy() at trainer.py:{line} agree_on_step; "
                                          "on GPU, a queued collective's kernel)")
    assert collective_of(frame, False) is None  # one process: a device read waits for nobody
    # A phase outside any collective is progress (here: this thread, the main one, runs the check itself);
    # a step is not. Without a watchdog running, a phase is a plain context.
    from llm_pretrain.run.run_control import HangWatchdog

    watchdog = HangWatchdog(0, 1, str(Path(trainer.__file__).parent / "no-such-dir"), timeout_minutes=0.001)
    watchdog.last -= 10
    assert watchdog._overdue()  # training: no step for longer than the timeout
    with watchdog.phase("save"):
        watchdog.last -= 10
        assert not watchdog._overdue() and watchdog.current_phase == "save"
        assert watchdog.last > time.monotonic() - 1  # counted as progress
    assert watchdog.current_phase == "training"
    line = describe_hang({0: {"step": 4, "collective": "barrier (checkpointer.py:90 save)", "phase": "save"},
                          1: {"step": 4, "collective": None, "phase": "save"}}, 2, 60, "/logs")
    assert "rank(s) 1 did not reach the collective barrier (checkpointer.py:90 save) in save" in line, line
    assert "rank 1: at step 4 in save, not in a collective" in line, line


def test_a_spike_on_one_rank_rolls_back_every_rank(embedded_corpus, tmp_path):
    """dp2 (the global batch of 8 split 4 + 4): garbage only in rank 0's half of step 12. Its loss
    reaches rank 1 through the step's flag reduction (max), both ranks roll back together, and the
    run equals one process skipping steps 11-16 (fp32 parity)."""
    from parity_utils import argv, run_launch

    args_file = small_run(embedded_corpus, tmp_path, max_steps=STEPS, save_steps=5, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    garbage = garbage_corpus(embedded_corpus, tmp_path, args_file, [12], first_samples=4)
    out = tmp_path / "dp2"
    run_launch(2, [argv(args_file, out, input_dir=garbage, gradient_accumulation_steps=2, loss_spike_factor=1.2,
                        loss_spike_window=4, loss_spike_action="rollback", loss_spike_skip_steps=4)], tmp_path, "dp2")
    assert [(r["step"], r["skipped_steps"]) for r in events(out, "rollback")] == [(12, [11, 16])]
    reference = tmp_path / "single"
    result = run_cli(args_file, "--output_dir", reference, "--skip_data_intervals", "[[11,16]]",
                     "--attention_probs_dropout_prob", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = losses(out), losses(reference)
    assert set(got) - set(want) == {11}  # trained, then undone by the rollback
    assert all(abs(got[k] - want[k]) < 1e-5 for k in want), (got, want)
