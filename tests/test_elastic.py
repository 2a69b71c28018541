"""Lose a node, keep training (issue 38): the layout a job continues with on the ranks it has left.

`llm-plan elastic` (the planner's view before it happens, GPUs) and `elastic: true` (the preflight's
choice at start, llm_pretrain/planner/elastic.py continue_on), with the global batch kept.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from parity_utils import argv, base_arguments, run_record, train_records, write_json
from shared_launches import contribute
from test_planner import run_plan

# Llama-2-7B at sequence 512 on 40 GB cards, 2 per node: 8, 6 and 4 GPUs hold it, 2 do not (its AdamW
# states alone are 108 GB). Small enough to search in seconds.
SEVEN_B = {"model_name_or_path": "meta-llama/Llama-2-7b", "max_seq_length": 512, "per_device_train_batch_size": 1,
           "gradient_accumulation_steps": 1, "sharding": "stage3", "input_dir": "./data", "max_steps": 100}


def test_llm_plan_elastic_lists_each_node_lost_with_the_searchs_pick_and_the_smallest_count_that_fits(
        tmp_path, capsys):
    from llm_pretrain.arguments import Arguments
    from llm_pretrain.planner.search import search

    args_file = write_json(tmp_path / "seven_b.json", SEVEN_B)
    code, out, err = run_plan(capsys, "elastic", args_file, "--gpus", "8", "--gpus_per_node", "2", "--device",
                              "A100-40G", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert table["global_batch_size"] == 8  # 1 x 1 x 8 sharding replicas on the 8 GPUs
    assert [row["gpus"] for row in table["rows"]] == [8, 6, 4, 2]
    assert [row["nodes_lost"] for row in table["rows"]] == [0, 1, 2, 3]
    assert table["smallest_fitting"] == 4
    for row in table["rows"][:3]:
        best = row["best"]
        a = Arguments(**best["arguments"])
        layout_replicas = row["gpus"] // (max(a.tensor_parallel_degree, 1) * max(a.pipeline_parallel_degree, 1)
                                          * max(a.sep_parallel_degree, 1) * max(a.context_parallel_degree, 1))
        assert a.per_device_train_batch_size * a.gradient_accumulation_steps * layout_replicas == 8, best
        assert a.tensor_parallel_degree <= 2 and a.max_seq_length == 512  # tp inside a node
        assert best["peak_mem_reserved_mb"] <= 0.9 * 40 * 1024 and best["tokens_per_card_per_sec"] > 0
    # the row of 6 GPUs is the search's own first pick for 6 GPUs, same model, length and global batch
    first = search("meta-llama/Llama-2-7b", "A100-40G", 6, 512, 8, 2, top=1)["top"][0]
    assert table["rows"][1]["best"]["arguments"] == first["arguments"]
    assert table["rows"][3]["best"] is None and table["rows"][3]["why"] == "no valid layout fits in memory"

    code, out, _ = run_plan(capsys, "elastic", args_file, "--gpus", "8", "--gpus_per_node", "2", "--device",
                            "A100-40G")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("meta-llama/Llama-2-7b, sequence 512, global batch 8 on A100-40G")
    assert lines[-1].startswith("| 2 | 3 | no valid layout fits in memory; the smallest count that fits is 4 GPUs")
    assert lines[3].startswith(f"| 8 | 0 | {table['rows'][0]['best']['strategy']} |")


def test_elastic_keep_holds_the_pinned_key_in_every_row(tmp_path):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.elastic import elastic_table

    args_file = write_json(tmp_path / "kept.json", {**SEVEN_B, "tensor_parallel_degree": 2, "sharding": "",
                                                      "elastic": True, "elastic_keep": ["tensor_parallel_degree"]})
    args, _ = parse_arguments([str(args_file)])
    table = elastic_table(args, "A100-40G", 8, 2, 0.10)
    assert table["kept"] == {"tensor_parallel_degree": 2} and table["global_batch_size"] == 4
    assert all(row["best"]["arguments"]["tensor_parallel_degree"] == 2 for row in table["rows"] if row["best"])
    assert any(row["best"] for row in table["rows"])


@pytest.mark.parametrize("argv, fragments", [
    (["--gpus", "12", "--gpus_per_node", "8"], ("--gpus: 12 is not a positive multiple of --gpus_per_node 8",)),
    (["--gpus", "8", "--device", "cpu"], ("--device: elastic needs a GPU",)),
])
def test_llm_plan_elastic_bad_input_is_one_line(tmp_path, capsys, argv, fragments):
    args_file = write_json(tmp_path / "seven_b.json", SEVEN_B)
    argv = argv if "--device" in argv else argv + ["--device", "A100-40G"]
    code, out, err = run_plan(capsys, "elastic", args_file, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith("error: ") and all(f in err for f in fragments), err


# ----------------------------------------------------------------------------- the rule on the ranks present
def _args(**overrides):
    from llm_pretrain.arguments import Arguments

    base = {"model_name_or_path": "llama-tiny", "num_hidden_layers": 2, "max_seq_length": 32, "max_steps": 5,
            "input_dir": "./data", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "elastic": True}
    return Arguments(**{**base, **overrides})


def test_continue_on_keeps_the_global_batch_and_the_degrees_that_still_fit():
    from llm_pretrain.planner.elastic import continue_on

    # dp2 x tp2 (global batch 2 x 2 x 2 = 8) on 2 ranks: tp2 still fits, dp 1: micro 2 x accumulation 4
    args, changes = continue_on(_args(tensor_parallel_degree=2), 2, 8, "cpu")
    assert (args.tensor_parallel_degree, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2, 4)
    assert changes == {"gradient_accumulation_steps": [2, 4]}
    # on 3 ranks tp2 cannot form a layout: tp 1, dp 3 cannot split 8 samples; the nearest that can: 6 or 9
    with pytest.raises(Exception, match=r"^elastic: the global batch 8 cannot be split over the 3 ranks left "
                                        r"\(3 data replicas\); the nearest global batches they can split: 6 or 9$"):
        continue_on(_args(tensor_parallel_degree=2), 3, 8, "cpu")
    # a global batch of 12 on 3 ranks: tp 1, dp 3, micro 2 x accumulation 2
    args, changes = continue_on(_args(tensor_parallel_degree=2), 3, 12, "cpu")
    assert (args.tensor_parallel_degree, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 2, 2)
    assert changes["tensor_parallel_degree"] == [2, 1]
    # pinned: tensor_parallel_degree 2 on 3 ranks is one line naming the key
    with pytest.raises(Exception, match=r"^elastic_keep: tensor_parallel_degree 2 cannot be kept on 3 ranks"):
        continue_on(_args(tensor_parallel_degree=2, elastic_keep=["tensor_parallel_degree"]), 3, 12, "cpu")
    # a micro-batch that no longer divides the per-replica batch: the largest divisor below it
    args, _ = continue_on(_args(per_device_train_batch_size=4, gradient_accumulation_steps=1), 4, 12, "cpu")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (3, 1)


def test_bad_elastic_keys_are_one_line():
    from llm_pretrain.arguments import validate_arguments
    from llm_pretrain.errors import UsageError

    with pytest.raises(UsageError, match=r"^elastic_keep: 'tensor_parallel' is not a key elastic changes; did you "
                                         r"mean 'tensor_parallel_degree'\?"):
        validate_arguments(_args(elastic_keep=["tensor_parallel"]))
    with pytest.raises(UsageError, match=r"^elastic_keep: set elastic true too"):
        validate_arguments(_args(elastic=False, elastic_keep=["sharding"]))


# ----------------------------------------------------------------------------- a node lost: 4 ranks, then 2
# dp2 x tp2 (global batch 2 x 2 x 2 = 8) trains 5 steps in the session's dp2tp2 launch and stops with
# checkpoint-5; the same command with elastic on 2 ranks (the tp2 launch) continues to step 10 with the
# layout the rule picks (tp2 kept, dp 1: accumulation 2 -> 4, global batch 8), beside a by-hand resume of
# checkpoint-5 under that layout.
def _lost_node_file(work: Path, corpus: dict) -> Path:
    return write_json(work / "lost-node.json", base_arguments(corpus, work, num_hidden_layers=2, max_steps=10,
                                                              save_steps=5, tensor_parallel_degree=2,
                                                              per_device_train_batch_size=2,
                                                              gradient_accumulation_steps=2))


contribute("dp2tp2", 4, "elastic", lambda work, corpus: [
    {"name": "four-ranks", "argv": argv(_lost_node_file(work, corpus), work / "lost-node", exit_interval=5)}])
contribute("tp2", 2, "elastic", lambda work, corpus: [
    {"name": "by-hand", "argv": argv(_lost_node_file(work, corpus), work / "by-hand", gradient_accumulation_steps=4,
                                     resume_from_checkpoint=str(work / "lost-node" / "checkpoint-5"))},
    {"name": "elastic", "argv": argv(_lost_node_file(work, corpus), work / "lost-node", elastic=True)},
], after=("dp2tp2",))


def test_a_lost_node_continues_on_the_ranks_left_with_the_same_global_batch(shared_launches):
    shared_launches.results("tp2", "elastic")
    work = shared_launches.work_dir("elastic")
    first, continued, by_hand = (run_record(work / "lost-node"), *[
        [r for r in map(json.loads, (work / name / "train_log.jsonl").read_text().splitlines()) if r["event"] == "run"][-1]
        for name in ("lost-node", "by-hand")])
    first = [r for r in map(json.loads, (work / "lost-node" / "train_log.jsonl").read_text().splitlines())
             if r["event"] == "run"][0]
    assert first["layout"]["world_size"] == 4 and first["strategy"] == "tp2dp2" and first["global_batch_size"] == 8
    assert continued["layout"]["world_size"] == 2 and continued["strategy"] == "tp2" and continued["start_step"] == 5
    assert continued["global_batch_size"] == 8 == by_hand["global_batch_size"]
    elastic = continued["elastic"]
    assert elastic["reason"] == "checkpoint-5 was written by 4 ranks, 2 are present", elastic
    assert elastic["changes"] == {"gradient_accumulation_steps": [2, 4]} and elastic["global_batch_size"] == 8
    events = [r for r in map(json.loads, (work / "lost-node" / "train_log.jsonl").read_text().splitlines())
              if r["event"] == "elastic"]
    assert len(events) == 1 and events[0]["step"] == 5 and events[0]["changes"] == elastic["changes"]
    log0 = (shared_launches.root / "tp2.log" / "workerlog.0").read_text(errors="replace")
    assert ("elastic: checkpoint-5 was written by 4 ranks, 2 are present; continuing on 2 ranks with "
            "gradient_accumulation_steps 2 -> 4, global batch 8") in log0.splitlines()
    # from the checkpoint on, the same losses as the by-hand resume under the layout chosen
    got = {r["step"]: r["loss"] for r in train_records(work / "lost-node") if r["step"] > 5}
    want = {r["step"]: r["loss"] for r in train_records(work / "by-hand")}
    assert sorted(got) == sorted(want) == list(range(6, 11))
    assert all(abs(got[step] - want[step]) < 1e-5 for step in want), (got, want)


def _fake_checkpoint(output_dir: Path, world_size: int, dp: int, micro: int, accumulation: int) -> None:
    """A complete checkpoint's trainer_state as written by `world_size` ranks (what the preflight reads)."""
    path = output_dir / "checkpoint-5"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({
        "global_step": 5, "consumed_samples": 40, "layout": {"world_size": world_size, "data_parallel_degree": dp,
                                                             "sharding_degree": 1},
        "args": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation}}))
    (path / "COMPLETE").write_text("5\n")


@pytest.mark.parametrize("overrides, fragments", [
    ({}, ("elastic: the global batch 8 cannot be split over the 3 ranks left (3 data replicas); the nearest "
          "global batches they can split: 6 or 9",)),
    ({"elastic_keep": ["tensor_parallel_degree"]}, ("elastic_keep: tensor_parallel_degree 2 cannot be kept on 3 ranks",)),
])
def test_elastic_bad_input_on_the_ranks_left_is_one_line_before_paddle(embedded_corpus, tmp_path, overrides, fragments):
    """checkpoint-5 of dp2 x tp2 (global batch 8), 3 ranks present: no layout keeps it. One line, exit 2,
    nothing else printed, before Paddle is imported (the preflight's checks)."""
    import os
    import subprocess
    import sys

    from parity_utils import RUN_PRETRAIN

    out = tmp_path / "out"
    _fake_checkpoint(out, 4, 2, 2, 2)
    args_file = _lost_node_file(tmp_path, embedded_corpus)
    command = [sys.executable, str(RUN_PRETRAIN), str(args_file), "--output_dir", str(out), "--elastic", "true"]
    for key, value in overrides.items():
        command += [f"--{key}", json.dumps(value)]
    env = {**os.environ, "PADDLE_TRAINERS_NUM": "3", "PADDLE_TRAINER_ID": "0"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr[-2000:])
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert all(fragment in result.stderr for fragment in fragments), result.stderr


def test_without_a_checkpoint_elastic_only_repairs_degrees_the_ranks_cannot_form(tmp_path, capsys):
    """No checkpoint: nothing to keep but the file's per-replica batch. Degrees that fit are left alone
    (no line, no record); tp2 on 3 ranks becomes tp1 x dp3, said in one line."""
    from llm_pretrain.run.preflight import adapt_to_the_ranks_present

    args = _args(tensor_parallel_degree=2, output_dir=str(tmp_path / "out"))
    assert adapt_to_the_ranks_present(args, 2, "cpu") == (args, None)
    assert capsys.readouterr().out == ""
    chosen, record = adapt_to_the_ranks_present(args, 3, "cpu")
    assert (chosen.tensor_parallel_degree, chosen.per_device_train_batch_size, chosen.gradient_accumulation_steps) \
        == (1, 2, 2)
    assert record["global_batch_size"] == 12 and record["checkpoint"] is None and record["written_by"] is None
    assert record["reason"].startswith("the argument file's degrees do not fit 3 ranks (world size 3 is not a "
                                       "multiple of tensor_parallel_degree 2")
    assert capsys.readouterr().out.splitlines() == [record["line"]]
    assert record["line"].endswith("continuing on 3 ranks with tensor_parallel_degree 2 -> 1, global batch 12")


# ----------------------------------------------------------------------------- restarts: llm_pretrain.launch
# `--max_restarts`: a rank killed with SIGKILL after checkpoint-5 in a dp2 x tp2 job (4 processes, the file
# of the shared launches above, global batch 8); the launcher restarts on the ranks left that hold the run
# (3 cannot split 8 samples over 3 data replicas: 2, tp2 with accumulation 4), which trains to step 10 with
# the losses of the shared by-hand resume of checkpoint-5 under that layout. Growing back is shown without a
# launch (the suite's time): test_each_restart_counts_from_the_configured_ranks (the launcher's counts) and
# test_the_ranks_back_return_the_file_layout_with_the_same_global_batch (the preflight's layout).
def _start_restarting_launch(nproc: int, run_argv: list[str], log_dir: Path, max_restarts: int | None = 2,
                             options: tuple[str, ...] = ()):
    import os
    import subprocess
    import sys

    from launch_utils import REPO_ROOT, TESTS_DIR
    from parity_utils import RUN_PRETRAIN

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)])}
    for key in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_LOG_DIR"):
        env.pop(key, None)
    restarts = ["--max_restarts", str(max_restarts)] if max_restarts else []
    command = [sys.executable, "-m", "llm_pretrain.launch", *restarts, *options, "--nproc_per_node", str(nproc),
               "--log_dir", str(log_dir), str(RUN_PRETRAIN), *run_argv]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _kill_rank_after_checkpoint(launcher, log_dir: Path, checkpoint: Path, rank: int, timeout: float = 240) -> int:
    """SIGKILL to `rank` once `checkpoint` is complete and the rank has finished a step after it; its pid."""
    import os
    import signal
    import time

    step = int(checkpoint.name.split("-")[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            beat = json.loads((log_dir / f"heartbeat.{rank}.json").read_text())
        except (OSError, ValueError):
            beat = {"step": 0}
        if beat["step"] > step and (checkpoint / "COMPLETE").exists():
            os.kill(beat["pid"], signal.SIGKILL)
            return beat["pid"]
        time.sleep(0.02)
    output = launcher.communicate(timeout=60)[1][-3000:] if launcher.poll() is not None else ""
    raise AssertionError(f"rank {rank} never passed step {step} (launcher exit code {launcher.poll()}) {output}")


def _run_records(output_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (output_dir / "train_log.jsonl").read_text().splitlines()) if r["event"] == "run"]


def test_a_killed_rank_restarts_on_the_ranks_left_with_the_same_global_batch(shared_launches, tmp_path):
    from launch_utils import _kill_session

    shared_launches.results("tp2", "elastic")  # the by-hand resume of checkpoint-5 on tp2, accumulation 4
    reference = shared_launches.work_dir("elastic") / "by-hand"
    # elastic in the file: `--elastic true` after the script is taken by Paddle's launcher's own parser as an
    # ambiguous abbreviation of its --elastic_level / --elastic_timeout (exit 2 before any worker starts)
    args_file = _lost_node_file(tmp_path, shared_launches.corpus)
    write_json(args_file, {**json.loads(args_file.read_text()), "elastic": True})
    out, logs = tmp_path / "out", tmp_path / "log"
    launcher = _start_restarting_launch(4, argv(args_file, out), logs)
    try:
        _kill_rank_after_checkpoint(launcher, logs, out / "checkpoint-5", rank=1)
        _, err = launcher.communicate(timeout=600)
    finally:
        _kill_session(launcher.pid)
    assert launcher.returncode == 0, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("launch: ")]
    assert said == ["launch: rank 1 stopped first (killed by SIGKILL); restart 1 of 2 on 2 of the 4 ranks (3 cannot "
                    "hold the run), from the newest complete checkpoint"], err[-3000:]
    first, continued = _run_records(out)[0], _run_records(out)[-1]
    assert first["layout"]["world_size"] == 4 and first["strategy"] == "tp2dp2" and first["global_batch_size"] == 8
    assert continued["layout"]["world_size"] == 2 and continued["strategy"] == "tp2" and continued["start_step"] == 5
    assert continued["global_batch_size"] == 8
    assert continued["elastic"]["reason"] == "checkpoint-5 was written by 4 ranks, 2 are present"
    assert continued["elastic"]["changes"] == {"gradient_accumulation_steps": [2, 4]}
    # from checkpoint-5 on (the restarted attempt's records are the last of each step), the by-hand losses
    got = {r["step"]: r["loss"] for r in train_records(out) if r["step"] > 5}
    want = {r["step"]: r["loss"] for r in train_records(reference)}
    assert sorted(got) == sorted(want) == list(range(6, 11))
    assert all(abs(got[step] - want[step]) < 1e-5 for step in want), (got, want)



# 3(b): two "nodes", two launchers on this machine (--nnodes 2, one rank each: dp2, global batch 2 x 2 x 2 = 8).
# Node b (a plain launcher) is killed with its rank after checkpoint-2; node a's rank fails in its next
# collective with gloo's "Connection reset by peer" (or its TIMEOUT), so node a's supervisor (--max_restarts) restarts it
# alone (--nnodes 1, its own rendezvous): dp1, accumulation 2 -> 4, global batch 8, to step 4, with the
# losses of a by-hand resume of checkpoint-2 on one process. Cost (idle cores): ~25 s of CPU.
def test_a_lost_node_leaves_the_other_to_continue_alone_with_the_same_global_batch(embedded_corpus, tmp_path):
    import socket

    from launch_utils import _kill_session
    from parity_utils import run_single

    from llm_pretrain.run.run_control import PEER_GONE

    args_file = write_json(tmp_path / "two-nodes.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_steps=4, save_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, elastic=True))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{free.getsockname()[1]}"
    out = tmp_path / "out"
    nodes = {name: _start_restarting_launch(1, argv(args_file, out), tmp_path / f"log-{name}",
                                            max_restarts=1 if name == "a" else None,
                                            options=("--nnodes", "2", "--master", master)) for name in "ab"}
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2" / "COMPLETE").exists() or not any(
                _beat(tmp_path / "log-b", rank)["step"] > 2 for rank in (0, 1)):
            assert time.monotonic() < deadline and nodes["a"].poll() is None, nodes["a"].poll()
            time.sleep(0.02)
        _kill_session(nodes["b"].pid)  # the node: its launcher and its rank, SIGKILL
        _, err = nodes["a"].communicate(timeout=600)
    finally:
        for launcher in nodes.values():
            _kill_session(launcher.pid)
    assert nodes["a"].returncode == 0, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("launch: ")]
    assert len(said) == 1 and said[0].startswith("launch: the other node is gone (rank "), err[-3000:]
    # gloo's words for a peer that is gone: "Connection reset by peer", or a TIMEOUT when rank 0's node was killed
    assert any(marker in said[0] for marker in PEER_GONE), said
    assert said[0].endswith("restart 1 of 1 on this node alone (--nnodes 1), 1 of its 1 ranks, from the newest "
                            "complete checkpoint"), said
    first, continued = _run_records(out)[0], _run_records(out)[-1]
    assert first["layout"]["world_size"] == 2 and first["strategy"] == "dp2" and first["global_batch_size"] == 8
    assert continued["layout"]["world_size"] == 1 and continued["start_step"] == 2
    assert continued["global_batch_size"] == 8
    assert continued["elastic"]["changes"] == {"gradient_accumulation_steps": [2, 4]}
    run_single([argv(args_file, tmp_path / "by-hand", gradient_accumulation_steps=4,
                     resume_from_checkpoint=str(out / "checkpoint-2"))], tmp_path, "by-hand")
    got = {r["step"]: r["loss"] for r in train_records(out) if r["step"] > 2}
    want = {r["step"]: r["loss"] for r in train_records(tmp_path / "by-hand")}
    assert sorted(got) == sorted(want) == [3, 4]
    assert all(abs(got[step] - want[step]) < 1e-5 for step in want), (got, want)


def _beat(log_dir: Path, rank: int) -> dict:
    try:
        return json.loads((log_dir / f"heartbeat.{rank}.json").read_text())
    except (OSError, ValueError):
        return {"step": 0}


# SIGTERM to the `--max_restarts` supervisor. Its attempt is a stand-in for the launcher (a small Python child,
# no Paddle), which does what `python -m llm_pretrain.launch` does on SIGTERM (test_fault_injection:
# test_two_process_sigterm_and_launcher_sigkill): saves a checkpoint, then exits 0.
STAND_IN_LAUNCHER = """
import os, signal, sys, time
out = sys.argv[1]
def stop(signum, frame):
    os.makedirs(os.path.join(out, "checkpoint-3"))
    open(os.path.join(out, "checkpoint-3", "COMPLETE"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
with open(os.path.join(out, "attempts"), "a") as f:
    f.write(f"{os.getpid()} {' '.join(sys.argv[2:])}\\n")
time.sleep(30)
sys.exit(1)  # not stopped: a failed attempt (the supervisor would restart it)
"""

SUPERVISOR = """
import sys
from llm_pretrain import launch
class StandIn(launch.Attempts):
    launcher = (sys.argv[1], sys.argv[2])
sys.exit(launch.run_with_restarts(sys.argv[3:], StandIn))
"""


def test_sigterm_to_the_restarting_launcher_stops_its_attempt_cleanly_and_does_not_restart(embedded_corpus, tmp_path):
    """The supervisor forwards SIGTERM to its attempt, waits for it (the checkpoint is written), exits with its
    exit code, 0, and starts no other attempt; nothing it started is left running."""
    import os
    import signal
    import subprocess
    import sys

    from launch_utils import REPO_ROOT

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "launcher.py").write_text(STAND_IN_LAUNCHER)
    args_file = _lost_node_file(tmp_path, embedded_corpus)
    write_json(args_file, {**json.loads(args_file.read_text()), "elastic": True})
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "launcher.py"), str(out), "--max_restarts", "2",
         "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"), "train.py", str(args_file)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "attempts").exists() or not (out / "attempts").read_text().endswith("\n"):
            assert time.monotonic() < deadline and supervisor.poll() is None, supervisor.communicate()
            time.sleep(0.02)
        supervisor.send_signal(signal.SIGTERM)
        _, err = supervisor.communicate(timeout=60)
    finally:
        supervisor.kill()
    assert supervisor.returncode == 0, err
    attempts = (out / "attempts").read_text().splitlines()
    assert len(attempts) == 1 and " --nproc_per_node 2 train.py " in attempts[0], attempts
    assert (out / "checkpoint-3" / "COMPLETE").exists()
    child = int(attempts[0].split()[0])
    assert not os.path.exists(f"/proc/{child}"), "the attempt is still running"


class _Attempts:
    """llm_pretrain.launch's attempts with their outcomes given (the real ones are the launch test's above)."""

    def __init__(self, outcomes):
        self.outcomes, self.ranks, self.stopped = list(outcomes), [], False

    def __call__(self, options, command):
        return self

    def run(self, nproc, alone=False):
        self.ranks.append((nproc, "alone") if alone else nproc)
        return (*self.outcomes.pop(0), None)[:3]


KILLED = "error: rank 1 stopped first (killed by SIGKILL); its last step was 7 (host h, pid 1, heartbeat 0.1 s before)"


def test_each_restart_counts_from_the_configured_ranks(embedded_corpus, tmp_path, capsys):
    """The restart rule of llm_pretrain.launch: the rank that stopped first is left out of the next attempt
    only, which runs on the largest count the elastic preflight holds (checkpoint-5 of dp2 x tp2, global
    batch 8: 3 ranks cannot split it, so 2); a failure with no rank stopped first, and every later restart,
    starts from the 4 configured ranks again (growing back). Exit 2 (bad input) is never restarted."""
    from llm_pretrain.launch import run_with_restarts
    from parity_utils import RUN_PRETRAIN

    out = tmp_path / "out"
    _fake_checkpoint(out, 4, 2, 2, 2)
    args_file = _lost_node_file(tmp_path, embedded_corpus)
    write_json(args_file, {**json.loads(args_file.read_text()), "elastic": True})
    command = ["--max_restarts", "3", "--nproc_per_node", "4", "--log_dir", str(tmp_path / "log"), str(RUN_PRETRAIN),
               str(args_file), "--output_dir", str(out)]
    attempts = _Attempts([(1, KILLED), (1, KILLED), (1, None), (0, None)])
    assert run_with_restarts(command, attempts) == 0
    assert attempts.ranks == [4, 2, 2, 4]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("launch: rank 1 stopped first (killed by SIGKILL); restart 1 of 3 on 2 of the 4 ranks (3 cannot "
                        "hold the run), from the newest complete checkpoint")
    assert lines[2] == ("launch: the attempt failed with exit code 1 and no rank stopped first; restart 3 of 3 on 4 of "
                        "the 4 ranks, from the newest complete checkpoint")
    attempts = _Attempts([(1, KILLED), (2, None)])
    assert run_with_restarts(command, attempts) == 2 and attempts.ranks == [4, 2]
    attempts = _Attempts([(1, KILLED), (1, KILLED)])
    assert run_with_restarts(command[:1] + ["1"] + command[2:], attempts) == 1 and attempts.ranks == [4, 2]


@pytest.mark.parametrize("elastic, launcher_options, fragment", [
    (False, [], "error: --max_restarts: the argument file must have elastic: true"),
    (True, ["--nnodes", "3", "--master", "127.0.0.1:6170"], "error: --max_restarts: --nnodes 3: restarts are built "
                                                             "for one node and for two"),
    (True, ["--nnodes", "2"], "error: --max_restarts: --nnodes 2 needs --master HOST:PORT"),
    (True, ["--master", "etcd://127.0.0.1:2379"], "error: --max_restarts: with an etcd:// master Paddle's launcher "
                                                 "restarts the nodes itself"),
    (True, ["--max_restarts", "0"], "error: --max_restarts: '0' is not a positive whole number"),
])
def test_max_restarts_bad_input_is_one_line(embedded_corpus, tmp_path, capsys, elastic, launcher_options, fragment):
    from llm_pretrain.launch import run_with_restarts
    from parity_utils import RUN_PRETRAIN

    args_file = _lost_node_file(tmp_path, embedded_corpus)
    write_json(args_file, {**json.loads(args_file.read_text()), "elastic": elastic})
    with pytest.raises(SystemExit) as stop:
        run_with_restarts([*launcher_options, "--max_restarts", "2", "--nproc_per_node", "4", str(RUN_PRETRAIN),
                           str(args_file)], _Attempts([]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(fragment) and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- (d) the ranks left cannot hold it
def _too_big_for_one_rank(tmp_path: Path, corpus: dict) -> tuple[Path, Path]:
    """checkpoint-5 of a tp2 run on 2 ranks whose micro-batch's activations (sequence 16384) fit this host's
    memory with the attention heads and logits split over 2 ranks, not on 1 (the preflight's activation
    floor, llm_pretrain/run/preflight.py activation_floor_bytes, against the host's memory)."""
    from llm_pretrain.arguments import Arguments
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.run.preflight import activation_floor_bytes, device_memory_bytes

    one = dict(model_name_or_path="llama-tiny", num_hidden_layers=2, max_seq_length=16384, input_dir="./data",
               per_device_train_batch_size=1, tensor_parallel_degree=1)
    layout, config = check_layout_and_model(Arguments(**one), 1, "cpu")[:2]
    per_sample = activation_floor_bytes(Arguments(**one), config, layout, "cpu")
    micro = device_memory_bytes("cpu") // per_sample + 1  # one rank: above the host's memory; two: half of it
    out = tmp_path / "out"
    _fake_checkpoint(out, 2, 1, micro, 1)
    args_file = write_json(tmp_path / "big.json", base_arguments(
        corpus, tmp_path, num_hidden_layers=2, max_seq_length=16384, tensor_parallel_degree=2, elastic=True,
        per_device_train_batch_size=micro, gradient_accumulation_steps=1, max_steps=10, save_steps=5))
    return args_file, out


def test_ranks_left_that_cannot_hold_the_model_name_the_smallest_count_that_does(embedded_corpus, tmp_path):
    """1 rank left of a tp2 job whose activations need two: the preflight (and so the launcher, which asks
    it before a restart) refuses in one line naming 2, the smallest number of ranks that holds the run;
    exit 2 before Paddle, nothing printed on stdout, the checkpoint untouched."""
    import os
    import subprocess
    import sys

    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.launch import ranks_to_restart_on
    from parity_utils import RUN_PRETRAIN

    args_file, out = _too_big_for_one_rank(tmp_path, embedded_corpus)
    before = {p: p.read_bytes() for p in (out / "checkpoint-5").iterdir()}
    result = subprocess.run([sys.executable, str(RUN_PRETRAIN), str(args_file), "--output_dir", str(out)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PADDLE_TRAINERS_NUM": "1", "PADDLE_TRAINER_ID": "0"})
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr[-2000:])
    line = result.stderr.strip()
    assert line.splitlines() == [line] and line.startswith("error: elastic: no layout of this run fits on 1 ranks: "
                                                           "max_seq_length: 16384 cannot fit"), line
    assert line.endswith("; the smallest number of ranks that holds it is 2; nothing was changed (the checkpoints "
                         "are as they were)"), line
    assert {p: p.read_bytes() for p in (out / "checkpoint-5").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5"]
    # the launcher's choice: 2 ranks left hold it (tp2 kept); 1 left is the preflight's line
    args, _ = parse_arguments([str(args_file), "--output_dir", str(out)])
    assert ranks_to_restart_on(args, 2, "cpu") == (2, "")
    with pytest.raises(UsageError, match=r"the smallest number of ranks that holds it is 2;"):
        ranks_to_restart_on(args, 1, "cpu")


def test_the_ranks_back_return_the_file_layout_with_the_same_global_batch(embedded_corpus, tmp_path, capsys):
    """Growing back, the preflight's half: checkpoint-10 written by the 2 ranks left (tp2, accumulation 4,
    global batch 8); with 4 ranks present again the run goes back to the file's dp2 x tp2, accumulation 2,
    global batch 8, and says so in one line."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.run.preflight import adapt_to_the_ranks_present

    out = tmp_path / "out"
    _fake_checkpoint(out, 2, 1, 2, 4)
    (out / "checkpoint-5").rename(out / "checkpoint-10")
    args_file = _lost_node_file(tmp_path, embedded_corpus)
    args, _ = parse_arguments([str(args_file), "--output_dir", str(out), "--elastic", "true"])
    chosen, record = adapt_to_the_ranks_present(args, 4, "cpu")
    assert (chosen.tensor_parallel_degree, chosen.per_device_train_batch_size, chosen.gradient_accumulation_steps) \
        == (2, 2, 2)
    assert record["changes"] == {} and record["global_batch_size"] == 8
    assert capsys.readouterr().out.splitlines() == [
        "elastic: checkpoint-10 was written by 2 ranks, 4 are present; continuing on 4 ranks with no key changes, "
        "global batch 8"]


# Nodes that leave and return under Paddle's own elastic launcher (`--master etcd://`, llm_pretrain/launch.py
# elastic_nodes_argv): an etcd server from Debian's etcd-server package (scripts/install_test_requirements.sh),
# started here on free ports, and the etcd3 client from requirements-test.txt.
def _start_etcd(work: Path):
    import shutil
    import subprocess

    from llm_pretrain.selfcheck.parity import free_port

    etcd = shutil.which("etcd")
    assert etcd, "no etcd server: install Debian's etcd-server (bash scripts/install_test_requirements.sh)"
    client, peer = free_port(), free_port()
    server = subprocess.Popen(
        [etcd, "--data-dir", str(work / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=open(work / "etcd.log", "w"), start_new_session=True)
    return server, f"etcd://127.0.0.1:{client}"


def _start_node(master: str, run_argv: list[str], log_dir: Path):
    """One node's `python -m llm_pretrain.launch` of one rank, nodes 1 to 2 (its output in files: the launcher
    copies rank 0's log to its stdout for the whole run)."""
    import os
    import subprocess
    import sys

    from launch_utils import REPO_ROOT, TESTS_DIR
    from parity_utils import RUN_PRETRAIN

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)])}
    for key in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_LOG_DIR"):
        env.pop(key, None)
    log_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "llm_pretrain.launch", "--master", master, "--nnodes", "1:2", "--job_id",
               "nodes-leave-and-return", "--elastic_timeout", "10", "--max_restart", "3", "--nproc_per_node", "1",
               "--log_dir", str(log_dir), str(RUN_PRETRAIN), *run_argv]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=open(log_dir / "launcher.out", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_nodes_leave_and_return_under_paddles_etcd_launcher_with_the_same_global_batch(embedded_corpus, tmp_path):
    """Two nodes (two launchers on this machine, one rank each: dp2, global batch 2 x 2 x 2 = 8). Node b is killed
    (launcher and rank, SIGKILL) after checkpoint-2: node a's launcher starts its rank again alone (1 rank,
    accumulation 4, global batch 8) from the newest checkpoint. Node b returns: both launchers stop their ranks
    (a saves) and start dp2 again from a's checkpoint with the file's layout, to max_steps. Every segment resumes
    where the one before saved, with the same global batch."""
    from launch_utils import _kill_session

    args_file = write_json(tmp_path / "nodes.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_steps=120, save_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, elastic=True))
    out = tmp_path / "out"
    server, master = _start_etcd(tmp_path)
    nodes = {}
    try:
        nodes["a"], nodes["b"] = (_start_node(master, argv(args_file, out), tmp_path / f"log-{n}") for n in "ab")
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2" / "COMPLETE").exists():
            assert time.monotonic() < deadline and nodes["a"].poll() is None, nodes["a"].poll()
            time.sleep(0.05)
        _kill_session(nodes["b"].pid)  # the node: its launcher and its rank
        while not ((out / "train_log.jsonl").exists() and _run_records(out)[-1]["layout"]["world_size"] == 1
                   and (out / f"checkpoint-{_run_records(out)[-1]['start_step'] + 2}" / "COMPLETE").exists()):
            assert time.monotonic() < deadline and nodes["a"].poll() is None, nodes["a"].poll()
            time.sleep(0.05)
        nodes["b"] = _start_node(master, argv(args_file, out), tmp_path / "log-b-returned")  # the node returns
        codes = {name: node.wait(timeout=600) for name, node in nodes.items()}
    finally:
        for node in nodes.values():
            _kill_session(node.pid)
        _kill_session(server.pid)
    logs = {name: (tmp_path / ("log-b-returned" if name == "b" else "log-a") / "launcher.out").read_text(errors="replace")
            for name in nodes}
    assert codes == {"a": 0, "b": 0}, (codes, logs["a"][-3000:], logs["b"][-3000:])
    runs = _run_records(out)
    sizes = [run["layout"]["world_size"] for run in runs]
    assert sizes[0] == 2 and sizes[-1] == 2 and 1 in sizes, sizes
    assert all(run["global_batch_size"] == 8 for run in runs), [run["global_batch_size"] for run in runs]
    alone = next(run for run in runs if run["layout"]["world_size"] == 1)
    assert alone["elastic"]["changes"] == {"gradient_accumulation_steps": [2, 4]}, alone["elastic"]
    assert alone["elastic"]["reason"] == f"checkpoint-{alone['start_step']} was written by 2 ranks, 1 are present"
    back = runs[-1]
    assert back["elastic"]["reason"] == f"checkpoint-{back['start_step']} was written by 1 ranks, 2 are present"
    assert back["elastic"]["changes"] == {} and back["start_step"] > alone["start_step"]
    # each segment goes on from the checkpoint the one before saved (its first step is the next), and the last
    # reaches max_steps
    events = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    for at, event in enumerate(events):
        if event["event"] == "run":
            first = next(e for e in events[at + 1:] if e["event"] == "train")
            assert first["step"] == event["start_step"] + 1, (event["start_step"], first["step"])
    assert [run["start_step"] for run in runs] == sorted({run["start_step"] for run in runs}), runs
    assert max(r["step"] for r in train_records(out)) == 120


@pytest.mark.parametrize("elastic, nnodes, fragment", [  # nnodes: and any further launcher options
    (False, "1:2", "error: --nnodes 1:2: the argument file must have elastic: true"),
    (True, "2:1", "error: --nnodes 2:1: expected N or MIN:MAX with 1 <= MIN <= MAX"),
    (True, "1:2 --elastic_timeout 3", "error: --elastic_timeout 3: at least 10 s under an etcd master"),
    (True, "1:2", "error: --master etcd://127.0.0.1:{port}: no etcd server answers there"),
])
def test_etcd_launch_bad_input_is_one_line_before_paddle(embedded_corpus, tmp_path, elastic, nnodes, fragment):
    import os
    import subprocess
    import sys

    from launch_utils import REPO_ROOT
    from llm_pretrain.selfcheck.parity import free_port
    from parity_utils import RUN_PRETRAIN

    args_file = _lost_node_file(tmp_path, embedded_corpus)
    write_json(args_file, {**json.loads(args_file.read_text()), "elastic": elastic})
    port = free_port()  # nothing listens there
    imported = tmp_path / "paddle_imported"
    probe = ("import runpy, sys\ntry:\n    runpy.run_module('llm_pretrain.launch', run_name='__main__')\nfinally:\n"
             f"    open({str(imported)!r}, 'w').write(str('paddle' in sys.modules))")
    result = subprocess.run(
        [sys.executable, "-c", probe, "--master", f"etcd://127.0.0.1:{port}", "--nnodes", *nnodes.split(), "--nproc_per_node",
         "1", str(RUN_PRETRAIN), str(args_file)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr[-2000:])
    assert result.stderr.startswith(fragment.format(port=port)) and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr
    assert imported.read_text() == "False"
