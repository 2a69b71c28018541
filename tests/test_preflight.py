"""The preflight (llm_pretrain/run/preflight.py): a bad input is exactly one line `error: ...`, exit code 2,
found before Paddle is imported; a good run records the CPU defaults instead of printing them early.

Every command runs as a new user would: `python llm_pretrain/run_pretrain.py <file> [--key value]`
with none of the CPU variables set (so the toolkit sets them, and Paddle would warn about them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parity_utils import RUN_PRETRAIN, base_arguments, write_json
from launch_utils import REPO_ROOT

CPU_VARIABLES = ("OMP_NUM_THREADS", "FLAGS_use_stride_kernel", "MKL_DEBUG_CPU_TYPE")


def fresh_env(**extra) -> dict:
    """The environment of a user who set nothing: no CPU variables, no launcher."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_VARIABLES and not k.startswith("PADDLE_")}
    return {**env, **extra}


def run_cli(*argv, python_options=(), env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_options, str(RUN_PRETRAIN), *map(str, argv)], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env or fresh_env(), timeout=600)


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` ("import time: self | cumulative |   name")."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


# (overrides, what the one line must say, whether the check needs Paddle)
BAD_INPUTS = {
    "unknown key": ({"bogus_key": 1}, ["unknown key 'bogus_key'"]),
    "impossible degrees": ({"tensor_parallel_degree": 2}, ["tensor_parallel_degree 2", "world size 1"]),
    "missing input_dir": ({"input_dir": "/no/such/input_dir"}, ["input_dir", "/no/such/input_dir"]),
    "missing tokenizer": ({"tokenizer_name_or_path": "./no/such/tokenizer.model"},
                          ["tokenizer_name_or_path: ./no/such/tokenizer.model does not exist"]),
    "bad seed": ({"seed": -5}, ["seed: -5"]),
    "gpu on a CPU build": ({"device": "gpu"}, ["device: 'gpu' was requested but this Paddle build has no CUDA"]),
    "activations beyond memory": ({"max_seq_length": 65536, "per_device_train_batch_size": 64},
                                  ["max_seq_length: 65536 cannot fit"]),
}


def test_bad_inputs_are_one_line_before_paddle_is_imported(embedded_corpus, tmp_path):
    for name, (overrides, fragments) in BAD_INPUTS.items():
        argv = [write_json(tmp_path / name / "args.json", base_arguments(embedded_corpus, tmp_path / name)),
                "--output_dir", tmp_path / name / "out"]
        for key, value in overrides.items():
            argv += [f"--{key}", value]
        result = run_cli(*argv)
        output = result.stdout + result.stderr
        assert result.returncode == 2, (name, result.returncode, output[-3000:])
        assert result.stdout == "" and output.count("\n") == 1 and output.startswith("error: "), (name, output)
        assert all(fragment in output for fragment in fragments), (name, output)
        assert not (tmp_path / name / "out").exists(), name
        # The same command under `python -X importtime`: Paddle never loaded; the error is still the one line.
        traced = run_cli(*argv, python_options=("-X", "importtime"))
        modules = imported_modules(traced.stderr)
        assert "llm_pretrain.arguments" in modules, name  # the trace works
        assert "paddle" not in modules, (name, sorted(m for m in modules if m.startswith("paddle"))[:5])
        assert [line for line in traced.stderr.splitlines() if not line.startswith("import time:")] == [
            output.rstrip("\n")], name


def test_checks_that_need_paddle_are_one_line_too(embedded_corpus, tmp_path):
    """The checkpoint to resume is read after Paddle loads (with the thread count the toolkit set): still
    one line, without Paddle's OMP_NUM_THREADS warning."""
    args_file = write_json(tmp_path / "args.json", base_arguments(embedded_corpus, tmp_path))
    result = run_cli(args_file, "--output_dir", tmp_path / "out", "--resume_from_checkpoint", tmp_path / "nothing")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and result.stdout == "" and output.count("\n") == 1, output[-3000:]
    assert output.startswith(f"error: resume_from_checkpoint: {tmp_path / 'nothing'} cannot be used"), output


def test_run_record_holds_the_cpu_defaults_printed_when_training_starts(embedded_corpus, tmp_path):
    args_file = write_json(tmp_path / "args.json", base_arguments(embedded_corpus, tmp_path, max_steps=1,
                                                                  num_hidden_layers=2, device="cpu"))
    result = run_cli(args_file, "--output_dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "out" / "train_log.jsonl", encoding="utf-8") as f:
        run = next(record for record in map(json.loads, f) if record["event"] == "run")
    note = run["cpu_defaults"]
    assert note.startswith("cpu defaults: OMP_NUM_THREADS=") and "FLAGS_use_stride_kernel=0" in note, run
    lines = result.stdout.splitlines()
    assert lines.count(note) == 1, result.stdout
    assert lines[lines.index(note) + 1].startswith("training llama-tiny"), result.stdout  # when training starts
    assert "OMP_NUM_THREADS WISELY" not in result.stderr, result.stderr  # the toolkit's own value: no warning
    # A user's own values: nothing set, nothing to record.
    result = run_cli(args_file, "--output_dir", tmp_path / "user", env=fresh_env(
        OMP_NUM_THREADS="1", FLAGS_use_stride_kernel="0", MKL_DEBUG_CPU_TYPE="5"))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "user" / "train_log.jsonl", encoding="utf-8") as f:
        assert next(r for r in map(json.loads, f) if r["event"] == "run")["cpu_defaults"] is None
    assert "cpu defaults" not in result.stdout + result.stderr


@pytest.mark.parametrize("module", ["llm_pretrain.run.preflight", "llm_pretrain.planner.estimate",
                                    "llm_pretrain.planner.search"])
def test_preflight_and_planner_load_neither_paddle_nor_the_trainer(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m in ('paddle', 'llm_pretrain.run.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=fresh_env(PYTHONPATH=str(REPO_ROOT)),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
