"""Errors that point to the fix: an unknown model name says the closest built-in names and `llm-plan models`,
an unsupported model_type in a config.json says the supported ones and the closest, and `llm-plan models`
lists every built-in name with its family, its parameter count and whether it needs a weights file.

Each refusal is run as a user runs it (the trainer with an argument file or a --model_name_or_path override,
llm-plan estimate and search): one line `error: ...`, exit code 2, nothing on stdout, no traceback, and --
for the trainer, under `python -X importtime` -- Paddle never imported. Nothing here trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.errors import closest_matches
from models.registry import ARCHITECTURES, known_model_names, parameter_count

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_PRETRAIN = REPO_ROOT / "llm_pretrain" / "run_pretrain.py"
PLAN = REPO_ROOT / "scripts" / "plan.py"
TINY_ARGS = REPO_ROOT / "configs" / "llama" / "pretrain-llama_tiny-dp.json"
SEVEN_B_ARGS = REPO_ROOT / "configs" / "qwen2" / "pretrain-qwen2_7b-sd8_stage2.json"
SUPPORTED_TYPES = ("supported: baichuan, bloom, deepseek_v3, ernie4_5, ernie4_5_moe, gpt, gpt2, llama, mixtral, qwen, "
                   "qwen2, qwen2_moe")
TYPO = "Qwen/Qwen2.5-7b"
TYPO_CLOSEST = ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-3B", "Qwen/Qwen1.5-7B", "Qwen/Qwen2-7B"]


def run(script: Path, *argv, python_options=()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_options, str(script), *map(str, argv)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=300)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The refusal's message (after 'error: '), once it is checked to be the only output, with exit code 2."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout == "" and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr[len("error: "):].rstrip("\n")


def args_file(tmp_path: Path, **overrides) -> Path:
    values = json.loads(TINY_ARGS.read_text(encoding="utf-8"))
    values.update(output_dir=str(tmp_path / "out"), **overrides)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(values), encoding="utf-8")
    return path


def imported_modules(importtime_stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def model_dir(tmp_path: Path, raw: dict) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return directory


# ----------------------------------------------------------------------------- the one "did you mean"
def test_closest_matches_puts_the_case_insensitive_equal_first():
    assert closest_matches(TYPO, known_model_names(), n=5)[0] == "Qwen/Qwen2.5-7B"
    assert closest_matches("learning_rte", ["learning_rate", "min_learning_rate"]) == ["learning_rate"]
    assert closest_matches("zzz", ["learning_rate"]) == []
    # several spellings of one choice: the choice once
    assert closest_matches("Llama-3.1-8B", {"Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
                                            "meta-llama/Llama-3.1-8B": "meta-llama/Llama-3.1-8B"}, n=5) == [
        "meta-llama/Llama-3.1-8B"]


def test_unknown_keys_use_the_same_helper(tmp_path):
    message = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--Learning_Rate", "0.1"))
    assert message.startswith("unknown key 'Learning_Rate'") and "did you mean 'learning_rate'?" in message


# ----------------------------------------------------------------------------- an unknown model name
def assert_names_the_closest(message: str, value: str = TYPO, closest=TYPO_CLOSEST) -> None:
    assert f"{value!r} is neither a built-in architecture nor a local directory" in message, message
    assert f"closest built-in names: {', '.join(closest)};" in message, message
    assert f"`llm-plan models` lists all {len(known_model_names())}" in message, message
    assert len(message) < 400, message  # not every name (it was 2,027 characters)


def test_unknown_model_name_in_the_argument_file_before_paddle(tmp_path):
    argv = [args_file(tmp_path, model_name_or_path=TYPO)]
    assert_names_the_closest(one_line_error(run(RUN_PRETRAIN, *argv)))
    traced = run(RUN_PRETRAIN, *argv, python_options=("-X", "importtime"))
    modules = imported_modules(traced.stderr)
    assert "llm_pretrain.arguments" in modules and "paddle" not in modules
    assert traced.returncode == 2
    assert [line for line in traced.stderr.splitlines() if not line.startswith("import time:")] == [
        "error: " + one_line_error(run(RUN_PRETRAIN, *argv))]
    assert not (tmp_path / "out").exists()


def test_unknown_model_name_on_the_command_line(tmp_path):
    message = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--model_name_or_path", TYPO))
    assert_names_the_closest(message)
    # a hub name without its organisation finds the full name first
    message = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--model_name_or_path", "Llama-3.1-8B"))
    assert "closest built-in names: meta-llama/Llama-3.1-8B," in message, message
    # nothing close: no list, still the command that lists them all
    message = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--model_name_or_path", "no-such-model"))
    assert "closest" not in message and "`llm-plan models` lists all" in message, message


def test_unknown_model_name_in_llm_plan():
    estimate = run(PLAN, "estimate", SEVEN_B_ARGS, "--nproc", 8, "--device", "A100-80G", "--model_name_or_path", TYPO)
    assert_names_the_closest(one_line_error(estimate))
    search = run(PLAN, "search", "--model", TYPO, "--device", "A100-80G", "--gpus", 8, "--seq", 4096,
                 "--global_batch_size", 64)
    assert_names_the_closest(one_line_error(search))


# ----------------------------------------------------------------------------- an unsupported model_type
@pytest.mark.parametrize("model_type,closest", [("mistral", "mixtral"), ("Qwen2-MoE", "qwen2_moe"), ("t5", None)])
def test_unsupported_model_type_names_the_supported_and_the_closest(tmp_path, model_type, closest):
    directory = model_dir(tmp_path, {"model_type": model_type, "hidden_size": 64})
    trainer = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--model_name_or_path", directory))
    planner = one_line_error(run(PLAN, "search", "--model", directory, "--device", "A100-80G", "--gpus", 8, "--seq",
                                 4096, "--global_batch_size", 64))
    for message in (trainer, planner):
        assert f"has model_type {model_type!r}; {SUPPORTED_TYPES}" in message, message
        if closest:
            assert message.endswith(f"(closest: {closest!r})"), message
        else:
            assert "closest" not in message, message


def test_unknown_family_in_our_own_config_names_the_closest(tmp_path):
    directory = model_dir(tmp_path, {"family": "lama", "hidden_size": 64})
    message = one_line_error(run(RUN_PRETRAIN, args_file(tmp_path), "--model_name_or_path", directory))
    assert "has family 'lama'; supported: llama, " in message and message.endswith("(closest: 'llama')"), message


# ----------------------------------------------------------------------------- llm-plan models
def test_llm_plan_models_lists_every_name_with_family_size_and_weights():
    result = run(PLAN, "models")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "name":
            rows[cells[0]] = cells[1:]
    assert set(rows) == set(known_model_names())
    assert rows["meta-llama/Llama-3.1-8B"] == ["llama", "8.03B", "no (random init)"]
    assert rows["facebook/llama-7b"] == ["llama", "6.74B", "no (random init)"]
    assert rows["mistralai/Mixtral-8x7B-v0.1"][:2] == ["mixtral", "46.7B"]
    assert rows["Qwen/Qwen2.5-7B"][0] == "qwen2"
    assert "random initialization" in result.stdout and "continue_training" in result.stdout

    listed = json.loads(run(PLAN, "models", "--json").stdout)
    by_name = {row["name"]: row for row in listed}
    assert len(listed) == len(by_name) == len(ARCHITECTURES)
    assert by_name["meta-llama/Llama-3.1-8B"] == {
        "name": "meta-llama/Llama-3.1-8B", "family": "llama", "weights_needed": False,
        "parameters": parameter_count(ARCHITECTURES["meta-llama/Llama-3.1-8B"])}


def test_llm_plan_unknown_command_and_option_are_one_line():
    assert one_line_error(run(PLAN, "modls")).startswith("unknown command 'modls'; did you mean 'models'?")
    assert one_line_error(run(PLAN, "models", "--bogus")).startswith("unrecognized arguments: --bogus")
