"""Fault injection: divergence, signals, a busy output_dir, a killed launcher, damaged checkpoints and
data, a full disk, late startup errors. Each fault must end in a clean, named outcome: a checkpoint
and exit 0, one line and exit 2/3/1, or a fallback with one warning; never a traceback, never a
non-finite or half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launch_utils import REPO_ROOT, TESTS_DIR, _descendants, _kill_session
from parity_utils import RUN_PRETRAIN, argv, base_arguments, final_weights, run_launch, train_records, write_json


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_LOG_DIR"):
        env.pop(key, None)
    return env


def run_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN_PRETRAIN), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO_ROOT)


def start_cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUN_PRETRAIN), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO_ROOT)


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 120) -> str:
    """The process's output up to the first line containing marker."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} never appeared:\n{''.join(seen)[-3000:]}")


def one_error_line(result, code: int, *fragments: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def small_run(corpus, tmp_path, name="run.json", **overrides) -> Path:
    return write_json(tmp_path / name, base_arguments(corpus, tmp_path, num_hidden_layers=2, **overrides))


def log_lines(output_dir: Path) -> list[dict]:
    with open(output_dir / "train_log.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]  # every line whole


def checkpoints(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")),
                  key=lambda n: (n.endswith(".partial"), int(n.split("-")[1].split(".")[0])))


@pytest.fixture(scope="module")
def reference(embedded_corpus, tmp_path_factory):
    """(argument file, output_dir of its uninterrupted run): 40 steps, with dropout so that resuming
    must restore the RNG states too. Tests stop, damage and resume runs of the same file."""
    work = tmp_path_factory.mktemp("reference")
    args_file = small_run(embedded_corpus, work, max_steps=40, save_steps=0, hidden_dropout_prob=0.1)
    result = run_cli(args_file, "--output_dir", work / "straight")
    assert result.returncode == 0, result.stderr[-3000:]
    return args_file, work / "straight"


# ----------------------------------------------------------------------------- divergence
def test_divergence_stops_with_exit_3_and_keeps_only_finite_checkpoints(embedded_corpus, tmp_path):
    """A learning rate of 1e30: step 1 is finite (checkpoint-1), step 2's loss is not."""
    args_file = small_run(embedded_corpus, tmp_path, learning_rate=1e30, min_learning_rate=0.0, warmup_steps=0,
                          max_grad_norm=0.0, max_steps=8, save_steps=1, save_total_limit=1)
    out = tmp_path / "diverged"
    result = run_cli(args_file, "--output_dir", out)
    line = one_error_line(result, 3, "divergence at step 2", "not finite", "without saving")
    assert checkpoints(out) == ["checkpoint-1"], line
    weights = final_weights(out, 1)
    assert all(np.isfinite(value).all() for value in weights.values())

    # skip_nan_inf_steps 2: steps 2 and 3 are skipped with a warning each (the weights stay those
    # of step 1), step 4 stops the run; still nothing non-finite on disk.
    out = tmp_path / "skipping"
    result = run_cli(args_file, "--output_dir", out, "--skip_nan_inf_steps", "2")
    one_error_line(result, 3, "divergence at step 4", "after skipping 2 step(s) in a row")
    assert [line.split(":")[1].strip() for line in result.stdout.splitlines() if "update skipped" in line] == \
        ["step 2", "step 3"], result.stdout[-2000:]
    skipped = [r for r in log_lines(out) if r["event"] == "skipped"]
    assert [r["step"] for r in skipped] == [2, 3]
    assert checkpoints(out) == ["checkpoint-3"]  # saves after skipped steps hold step 1's finite weights
    assert all(np.isfinite(value).all() for value in final_weights(out, 3).values())
    assert all(np.array_equal(final_weights(out, 3)[k], v) for k, v in weights.items())


# ----------------------------------------------------------------------------- signals, lock, torn log
def test_sigterm_saves_and_resume_is_identical(reference, tmp_path):
    args_file, straight = reference
    stopped = tmp_path / "stopped"
    proc = start_cli(args_file, "--output_dir", stopped)
    try:
        read_until(proc, "step 2/40")
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    stop_lines = [line for line in output.splitlines() if line.startswith("stopped at step")]
    assert len(stop_lines) == 1, output[-3000:]
    stopped_step = int(stop_lines[0].split()[3])
    assert stop_lines[0] == (f"stopped at step {stopped_step} (SIGTERM), checkpoint-{stopped_step} saved; "
                             "run the same command to resume"), stop_lines
    assert 2 <= stopped_step < 40 and checkpoints(stopped) == [f"checkpoint-{stopped_step}"]
    assert log_lines(stopped)[-1]["event"] == "summary"

    # A torn last line (a crash mid-write) is dropped when the next run opens the log.
    with open(stopped / "train_log.jsonl", "a") as f:
        f.write('{"event": "train", "step": 99, "lo')
    resumed = run_cli(args_file, "--output_dir", stopped)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = train_records(straight), train_records(stopped)
    assert [r["step"] for r in got] == list(range(1, 41))
    for key in ("loss", "grad_norm", "learning_rate", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    assert all(r.get("step") != 99 for r in log_lines(stopped))


def test_second_run_on_a_busy_output_dir_is_refused(embedded_corpus, tmp_path):
    """Another process holds output_dir's lock (as a running training does): a new run is one line, exit 2,
    naming the directory and the holder, and touches nothing."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the loop (as the command)

    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from llm_pretrain.checkpoint.checkpointer import OutputDirLock; "
        "lock = OutputDirLock(sys.argv[2]); import os; os.makedirs(sys.argv[2], exist_ok=True); lock.acquire(); "
        "print('locked', flush=True); time.sleep(120)"), str(REPO_ROOT), str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args, warnings = parse_arguments([str(small_run(embedded_corpus, tmp_path)), "--output_dir", str(out)])
        with pytest.raises(UsageError) as raised:
            train(args, warnings)
        assert f"output_dir: {out} is in use by another run" in str(raised.value)
        assert f"pid {holder.pid}" in str(raised.value)
        assert sorted(os.listdir(out)) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    # Once the holder is gone (its lock dies with it), the directory is free again.
    from llm_pretrain.checkpoint.checkpointer import OutputDirLock

    OutputDirLock(str(out)).acquire().release()


def _start_launch(nproc: int, script: Path, args: list, log_dir: Path,
                  launcher: str = "paddle.distributed.launch") -> subprocess.Popen:
    env = {**_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)])}
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", str(nproc),
           "--log_dir", str(log_dir), str(script), *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for_log(log_dir: Path, rank: int, marker: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = log_dir / f"workerlog.{rank}"
    while time.monotonic() < deadline:
        if path.exists() and marker in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{marker!r} not in {path}:\n{path.read_text(errors='replace')[-3000:] if path.exists() else ''}")


def test_two_process_sigterm_and_launcher_sigkill(reference, tmp_path):
    """SIGTERM to a launch: both ranks agree, save, exit 0 (and so does llm_pretrain.launch); SIGKILL of
    Paddle's launcher: its workers die with it; the resumed dp2 run matches one process within the
    parity tolerance."""
    args_file, _ = reference
    no_dropout = {"hidden_dropout_prob": 0.0}  # dropout streams differ per rank: parity needs none
    out, single = tmp_path / "dp2", tmp_path / "single"
    single_run = start_cli(*argv(args_file, single, **no_dropout))
    dp2 = {**no_dropout, "gradient_accumulation_steps": 2}  # the same global batch of 8 as the single process

    logs = tmp_path / "launch_term"  # llm_pretrain.launch: Paddle's launcher waiting for a graceful stop
    launcher = _start_launch(2, RUN_PRETRAIN, argv(args_file, out, **dp2), logs, launcher="llm_pretrain.launch")
    try:
        _wait_for_log(logs, 0, "step 2/40", launcher)
        launcher.send_signal(signal.SIGTERM)
        launcher_output = launcher.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        _kill_session(launcher.pid)
    log0, log1 = ((logs / f"workerlog.{r}").read_text(errors="replace") for r in (0, 1))
    stop_lines = [line for line in log0.splitlines() if line.startswith("stopped at step")]
    assert len(stop_lines) == 1, log0[-3000:] + launcher_output[-2000:]
    step = int(stop_lines[0].split()[3])
    assert f"checkpoint-{step} saved; run the same command to resume" in stop_lines[0]
    assert "received SIGTERM" in log0 and "Traceback" not in log0 + log1, log1[-3000:]
    # Rank 1 stopped at the same step boundary (the launcher signals the workers one after the
    # other, 0.6 s apart: rank 1 may be done before its own signal arrives) and wrote its part.
    assert checkpoints(out) == [f"checkpoint-{step}"]
    manifest = json.loads((out / f"checkpoint-{step}" / "manifest.json").read_text())
    assert {entry["rank"] for entry in manifest["files"].values()} == {0, 1}
    # The job's exit code is the workers' (Paddle's own launcher would exit with the signal's number).
    assert launcher.returncode == 0, launcher_output[-2000:]

    # SIGKILL of the launcher mid-run: the workers get SIGKILL from the kernel (PR_SET_PDEATHSIG).
    logs = tmp_path / "launch_kill"
    launcher = _start_launch(2, RUN_PRETRAIN, argv(args_file, out, **dp2), logs)
    try:
        _wait_for_log(logs, 0, f"step {step + 2}/40", launcher)
        workers = _descendants(launcher.pid)
        assert len(workers) >= 2, workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived their launcher"
    finally:
        _kill_session(launcher.pid)
        for pid in _descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    assert checkpoints(out) == [f"checkpoint-{step}"]  # nothing written by the killed run

    # Rerun to the end (resumes from the SIGTERM checkpoint) and compare with one process.
    run_launch(2, [argv(args_file, out, **dp2)], tmp_path, "resume")
    assert single_run.wait(timeout=300) == 0, single_run.stdout.read()[-3000:]
    ref, got = train_records(single), train_records(out)
    # the killed run logged some steps again; the last record of each step is the one that counts
    last = {r["step"]: r for r in got}
    assert sorted(last) == list(range(1, 41))
    assert max(abs(last[r["step"]]["loss"] - r["loss"]) for r in ref) <= 1e-5


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- damaged checkpoints
def test_damaged_newest_checkpoint_falls_back_with_identical_losses(reference, tmp_path):
    from llm_pretrain.checkpoint import checkpointer as ckpt

    args_file, straight = reference
    damaged = tmp_path / "damaged"
    first = run_cli(args_file, "--output_dir", damaged, "--exit_interval", "6", "--save_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoints(damaged) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    # The verification itself: every kind of damage is found and named (checked on copies).
    # The layout-free format (llm_pretrain/checkpoint/dist_checkpoint.py): the tensor index and rank 0's slices.
    for name, damage in (("truncated", lambda p: _truncate(p / "tensors.index.json")),
                         ("flipped", lambda p: _flip_byte(p / "tensors.rank00000.safetensors")),
                         ("bad_json", lambda p: (p / "trainer_state.json").write_text("{not json")),
                         ("missing", lambda p: (p / "rng_state.rank00000.json").unlink())):
        copy = tmp_path / name
        shutil.copytree(damaged / "checkpoint-6", copy)
        damage(copy)
        problem = ckpt.verify_checkpoint(str(copy))
        assert problem is not None and str(copy) in problem, (name, problem)
    assert ckpt.verify_checkpoint(str(damaged / "checkpoint-6")) is None

    model_file = damaged / "checkpoint-6" / "tensors.rank00000.safetensors"
    _truncate(model_file)
    result = run_cli(args_file, "--output_dir", damaged, "--save_steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(warnings) == 1 and str(model_file) in warnings[0] and "checkpoint-4" in warnings[0], result.stderr
    runs = [r for r in log_lines(damaged) if r["event"] == "run"]
    assert runs[-1]["start_step"] == 4 and runs[-1]["resumed_from"].endswith("checkpoint-4")
    ref = {r["step"]: r["loss"] for r in train_records(straight)}
    got = [r for r in train_records(damaged)][6:]  # steps 5-40 of the resumed run
    assert [r["step"] for r in got] == list(range(5, 41))
    assert [r["loss"] for r in got] == [ref[s] for s in range(5, 41)]

    # No usable checkpoint at all: one line (the trainer's check before fleet.init).
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.run.preflight import find_resume

    for path in damaged.glob("checkpoint-*/trainer_state.json"):
        path.write_text("{}")
    args, _ = parse_arguments([str(args_file), "--output_dir", str(damaged)])
    with pytest.raises(UsageError, match="output_dir: no usable checkpoint in"):
        find_resume(args, 1)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- full disk
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(embedded_corpus, tmp_path):
    mount = tmp_path / "small_disk"
    mount.mkdir()
    # A checkpoint of this model takes ~1.9 MB: the first fits in 3 MB, the second does not.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill: {mounted.stderr.strip() or mounted.returncode}")
    try:
        args_file = small_run(embedded_corpus, tmp_path, max_steps=4, save_steps=1)
        out = mount / "out"
        result = run_cli(args_file, "--output_dir", out)
        one_error_line(result, 1, "cannot write checkpoint-2", "no space left on device",
                       "the previous checkpoint checkpoint-1 is intact")
        assert checkpoints(out) == ["checkpoint-1"]  # the .partial is gone
        from llm_pretrain.checkpoint import checkpointer as ckpt

        assert ckpt.verify_checkpoint(str(out / "checkpoint-1")) is None
        log_lines(out)  # whole lines only
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# ----------------------------------------------------------------------------- data integrity
def _copy_prefix(corpus: dict, directory: Path) -> Path:
    directory.mkdir(parents=True)
    source = Path(corpus["input_dir"])
    for path in source.iterdir():
        if path.suffix in (".bin", ".idx"):
            shutil.copy(path, directory / path.name)
    return next(directory.glob("*.idx")).with_suffix("")


def test_damaged_data_is_one_line_naming_the_file(embedded_corpus, tmp_path):
    from llm_pretrain.data import write_documents
    from llm_pretrain.data.indexed import _HEADER
    from llm_pretrain.data.integrity import check_data_integrity
    from llm_pretrain.errors import UsageError

    def error_of(input_dir, vocab_size=100000):
        with pytest.raises(UsageError) as raised:
            check_data_integrity(str(input_dir), vocab_size, str(tmp_path / "cache"))
        return str(raised.value)

    # A wrong dtype byte (int32 for uint16 data).
    prefix = _copy_prefix(embedded_corpus, tmp_path / "dtype")
    data = bytearray(prefix.with_suffix(".idx").read_bytes())
    data[17] = 4  # the dtype code follows the 9-byte magic and the 8-byte version
    prefix.with_suffix(".idx").write_bytes(bytes(data))
    message = error_of(prefix.parent)
    assert str(prefix) + ".idx" in message and "int32" in message, message

    # A smaller dataset's .idx beside the .bin.
    prefix = _copy_prefix(embedded_corpus, tmp_path / "swapped")
    write_documents(str(tmp_path / "small"), [[1, 2, 3], [4, 5]], np.uint16)
    shutil.copy(tmp_path / "small.idx", prefix.with_suffix(".idx"))
    message = error_of(prefix.parent)
    assert str(prefix) + ".bin" in message and "do not belong together" in message, message

    # Scrambled pointers.
    prefix = _copy_prefix(embedded_corpus, tmp_path / "pointers")
    data = bytearray(prefix.with_suffix(".idx").read_bytes())
    n_items = int(np.frombuffer(bytes(data[18:26]), np.uint64)[0])
    start = _HEADER.size + 4 * n_items
    pointers = np.frombuffer(bytes(data[start:start + 8 * n_items]), np.int64).copy()
    pointers[1:] = np.random.RandomState(0).permutation(pointers[1:])
    data[start:start + 8 * n_items] = pointers.tobytes()
    prefix.with_suffix(".idx").write_bytes(bytes(data))
    assert "pointer" in error_of(prefix.parent)

    # A token id beyond the vocabulary, found before training (and cached beside the sample index).
    message = error_of(embedded_corpus["input_dir"], vocab_size=100)
    assert "vocab_size 100" in message and ".bin" in message
    assert list((tmp_path / "cache").glob("tokens_*.json"))

    # Through the command line: one line, exit 2.
    args_file = small_run(embedded_corpus, tmp_path, input_dir=str(tmp_path / "dtype"))
    one_error_line(run_cli(args_file, "--output_dir", tmp_path / "out"), 2, "input_dir:", "dtype")


def test_damaged_sample_index_cache_is_rebuilt(embedded_corpus, tmp_path, capsys):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import Layout
    from llm_pretrain.run.trainer import _build_datasets_rank0_first

    args_file = small_run(embedded_corpus, tmp_path)
    args, _ = parse_arguments([str(args_file), "--output_dir", str(tmp_path / "out")])
    train, _, _ = _build_datasets_rank0_first(args, (40, 0, 0), Layout())
    samples = [train[i].copy() for i in range(40)]
    sample_file = next(f for f in train.cache_files if f.endswith("sample_idx.npy"))
    scrambled = np.load(sample_file)
    scrambled[:, 0] = np.random.RandomState(0).randint(10**6, 10**7, size=len(scrambled))
    np.save(sample_file, scrambled)
    capsys.readouterr()
    train, _, _ = _build_datasets_rank0_first(args, (40, 0, 0), Layout())
    assert f"the cached sample index {sample_file} is damaged" in capsys.readouterr().err
    assert all(np.array_equal(train[i], samples[i]) for i in range(40))


# ----------------------------------------------------------------------------- startup checks
@pytest.mark.parametrize("overrides, fragments", [
    ({"max_seq_length": 100000000}, ["max_seq_length: 100000000"]),
    ({"tokenizer_name_or_path": "./no/such/tokenizer.model"}, ["tokenizer_name_or_path: ./no/such/tokenizer.model",
                                                               "does not exist"]),
    ({"seed": -5}, ["seed: -5"]),
    ({"split": "0,1,0"}, ["split: '0,1,0'", "training"]),
    ({"output_dir": "FILE/sub"}, ["output_dir: cannot create", "FILE/sub"]),
    ({"max_seq_length": 65536, "per_device_train_batch_size": 64}, ["max_seq_length: 65536 cannot fit"]),
])
def test_startup_errors_before_any_work(embedded_corpus, tmp_path, overrides, fragments):
    """In-process (the checks run before fleet.init and before any model is built)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the loop (as the command)

    (tmp_path / "FILE").write_text("a file, not a directory")
    overrides = {k: (str(tmp_path / v) if k == "output_dir" else v) for k, v in overrides.items()}
    args_file = small_run(embedded_corpus, tmp_path, **{k: v for k, v in overrides.items() if k != "output_dir"})
    output_dir = overrides.get("output_dir", str(tmp_path / "out"))
    with pytest.raises(UsageError) as raised:
        args, warnings = parse_arguments([str(args_file), "--output_dir", output_dir])
        train(args, warnings)
    message = " ".join(str(raised.value).split())
    for fragment in fragments:
        assert fragment.replace("FILE", str(tmp_path / "FILE")) in message, message
    assert not (tmp_path / "out").exists()


def test_skip_nan_inf_steps_is_refused_under_the_pipeline(embedded_corpus, tmp_path):
    """fleet's train_batch steps the optimizer before the loss can be checked: one line, not a silent no-op.
    check_startup on a 2-stage layout (a launch is not needed: it runs before fleet.init)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import Layout
    from llm_pretrain.errors import UsageError
    from llm_pretrain.parallel.layout import build_model_config
    from llm_pretrain.run.preflight import check_startup

    args, _ = parse_arguments([str(small_run(embedded_corpus, tmp_path)), "--output_dir", str(tmp_path / "out"),
                               "--skip_nan_inf_steps", "1", "--pipeline_parallel_degree", "2"])
    layout = Layout(world_size=2, pipeline_parallel_degree=2)
    config, _, _ = build_model_config(args, layout, "cpu")
    with pytest.raises(UsageError, match=r"^skip_nan_inf_steps: not available with pipeline_parallel_degree > 1"):
        check_startup(args, config, layout, "cpu")
    check_startup(args, config, Layout(world_size=2, data_parallel_degree=2), "cpu")  # other layouts: allowed


# ----------------------------------------------------------------------------- dead ranks
def test_heartbeats_name_the_rank_that_stopped_first(tmp_path):
    """A failed collective's message names the peer whose process is gone, with its last step."""
    from llm_pretrain.run.run_control import Heartbeat

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    Heartbeat(0, str(tmp_path)).beat(7)
    Heartbeat(2, str(tmp_path)).beat(7)
    Heartbeat(1, str(tmp_path)).beat(5)
    beat = json.loads((tmp_path / "heartbeat.1.json").read_text())
    (tmp_path / "heartbeat.1.json").write_text(json.dumps({**beat, "pid": gone.pid}))  # rank 1's process died
    message = Heartbeat(0, str(tmp_path)).describe_failure(3, 7, RuntimeError("Connection reset by peer\nmore"))
    assert message.startswith("rank 0 failed in a collective during step 8 (Connection reset by peer)"), message
    assert "rank 1 stopped first (exited; its last step was 5" in message
    # Without a dead process the rank that fell behind is named.
    (tmp_path / "heartbeat.1.json").write_text(json.dumps(beat))
    message = Heartbeat(0, str(tmp_path)).describe_failure(3, 7, RuntimeError("timeout"))
    assert "rank 1 stopped first (still running, not answering; its last step was 5" in message
    # The launcher's line: among the workers that had failed when it noticed, the lowest step goes first.
    from llm_pretrain.run.run_control import describe_first_stopped
    line = describe_first_stopped(str(tmp_path), {0: -6, 1: -9}, since=0, noticed=time.time())
    assert line.startswith("error: rank 1 stopped first (killed by SIGKILL); its last step was 5 (host "), line
    assert describe_first_stopped(str(tmp_path), {2: 1}, since=time.time() + 1, noticed=0).startswith(
        "error: rank 2 stopped first (exit code 1); it had not finished a step")  # heartbeats of an earlier launch


def test_launcher_names_the_rank_that_was_killed(embedded_corpus, tmp_path):
    """SIGKILL of rank 1 mid-run in a dp2 launch through llm_pretrain.launch: the launcher's output
    names rank 1 as the rank that stopped first (Paddle's own summary shows rank 0's container) and
    the job fails."""
    args_file = small_run(embedded_corpus, tmp_path, max_steps=1000, save_steps=0)
    logs = tmp_path / "log"
    launcher = _start_launch(2, RUN_PRETRAIN, argv(args_file, tmp_path / "out"), logs, launcher="llm_pretrain.launch")
    try:
        deadline = time.monotonic() + 180
        while launcher.poll() is None and time.monotonic() < deadline:
            try:
                beat = json.loads((logs / "heartbeat.1.json").read_text())
            except (OSError, ValueError):
                beat = {"step": 0}
            if beat["step"] >= 2:
                break
            time.sleep(0.1)
        assert beat["step"] >= 2, (launcher.poll(), beat)
        os.kill(beat["pid"], signal.SIGKILL)
        output = launcher.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        _kill_session(launcher.pid)
    lines = [line for line in output.splitlines() if "stopped first" in line]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("error: rank 1 stopped first (killed by SIGKILL); its last step was "), lines[0]
    assert f"pid {beat['pid']}" in lines[0], lines[0]
    assert launcher.returncode != 0, output[-3000:]


# ----------------------------------------------------------------------------- rotation, overwrite, resume checks
def test_rotation_keeps_the_newest_checkpoint_with_finite_weights(tmp_path):
    from llm_pretrain.checkpoint.checkpointer import Checkpointer
    from llm_pretrain.parallel.distributed import Layout

    for step, finite in ((1, True), (2, True), (3, False), (4, False)):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        (path / "trainer_state.json").write_text("{}")
        (path / "manifest.json").write_text(json.dumps({"step": step, "weights_finite": finite, "files": {}}))
        (path / "COMPLETE").write_text(f"{step}\n")
    (tmp_path / "checkpoint-5.partial").mkdir()
    Checkpointer(str(tmp_path), Layout(), save_steps=1, save_total_limit=1).rotate()
    assert checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-4", "checkpoint-5.partial"]


def test_overwrite_output_dir_starts_afresh_and_resume_checks_the_model(embedded_corpus, tmp_path, capsys):
    """In-process runs: overwrite_output_dir removes an older run's checkpoints and log before its first
    save; resuming with another architecture or sequence length is refused, other changes are listed."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import Layout
    from llm_pretrain.errors import UsageError
    from llm_pretrain.parallel.layout import build_model_config
    from llm_pretrain.run.preflight import check_checkpoint_matches
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the loop (as the command)

    out = tmp_path / "out"
    args_file = small_run(embedded_corpus, tmp_path, max_steps=4, save_steps=2)
    args, warnings = parse_arguments([str(args_file), "--output_dir", str(out)])
    train(args, warnings)
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]

    args, warnings = parse_arguments([str(args_file), "--output_dir", str(out), "--overwrite_output_dir", "true",
                                      "--max_steps", "1", "--save_steps", "1"])
    capsys.readouterr()
    train(args, warnings)
    assert checkpoints(out) == ["checkpoint-1"]
    assert "overwrite_output_dir: removed" in capsys.readouterr().err
    assert [r["event"] for r in log_lines(out)] == ["run", "train", "summary"]

    checkpoint = str(out / "checkpoint-1")
    for key, value in (("num_hidden_layers", 3), ("max_seq_length", 16)):
        other, _ = parse_arguments([str(args_file), "--output_dir", str(out), f"--{key}", str(value)])
        config, _, _ = build_model_config(other, Layout(), "cpu")
        with pytest.raises(UsageError, match=key if key == "max_seq_length" else "num_hidden_layers 2 in the checkpoint, 3 now"):
            check_checkpoint_matches(checkpoint, Layout(), config, other)
    other, _ = parse_arguments([str(args_file), "--output_dir", str(out), "--learning_rate", "0.001"])
    config, _, _ = build_model_config(other, Layout(), "cpu")
    notes = check_checkpoint_matches(checkpoint, Layout(), config, other)
    assert len(notes) == 1 and "learning_rate 0.003 -> 0.001" in notes[0] and "max_steps 1 -> 4" in notes[0], notes


def test_collective_timeout_reaches_paddles_process_group_settings(monkeypatch):
    """distributed_timeout_minutes sets the timeout Paddle creates NCCL process groups with (GPU only)."""
    import paddle.distributed as dist

    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.run.preflight import set_collective_timeout

    monkeypatch.delenv("PADDLE_PG_TIMEOUT", raising=False)
    args, _ = parse_arguments(["--max_steps", "1", "--input_dir", "x", "--distributed_timeout_minutes", "2.5"])
    set_collective_timeout(args, "cpu")
    assert "PADDLE_PG_TIMEOUT" not in os.environ
    set_collective_timeout(args, "gpu")
    assert os.environ["PADDLE_PG_TIMEOUT"] == "150000"
    assert dist.ParallelEnv().pg_timeout == 150000  # what collective.py:176 hands to ProcessGroupNCCL
