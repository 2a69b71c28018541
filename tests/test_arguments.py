"""Argument files: PaddleNLP's keys parse with their meaning; mistakes are one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from llm_pretrain.arguments import INERT_KEYS, Arguments, parse_arguments
from llm_pretrain.errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PRETRAIN = os.path.join(REPO_ROOT, "llm_pretrain", "run_pretrain.py")

# PaddleNLP's llm/llama/pretrain-llama_7b-tp2sd4_stage2.json, text as published (note the
# integer booleans and the trailing spaces after "sequence_parallel": 0,).
PADDLENLP_LLAMA_7B = """{
    "model_name_or_path": "facebook/llama-7b",
    "tokenizer_name_or_path": "facebook/llama-7b",
    "input_dir": "./data",
    "output_dir": "./checkpoints/llama_pretrain_ckpts",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 2,
    "tensor_parallel_degree": 2,
    "pipeline_parallel_degree": 1,
    "sharding": "stage2",
    "virtual_pp_degree": 1,
    "sequence_parallel": 0,   
    "use_flash_attention": true,
    "use_fused_rms_norm": true,
    "use_fused_rope": true,
    "max_seq_length": 2048,
    "learning_rate": 3e-05,
    "min_learning_rate": 3e-06,
    "warmup_steps": 30,
    "logging_steps": 1,
    "max_steps": 10000,
    "save_steps": 5000,
    "eval_steps": 1000,
    "weight_decay": 0.01,
    "bf16": true,
    "fp16_opt_level": "O2",
    "warmup_ratio": 0.01,
    "max_grad_norm": 1.0,
    "dataloader_num_workers": 1,
    "continue_training": 1,
    "do_train": true,
    "do_eval": true,
    "do_predict": true,
    "disable_tqdm": true,
    "recompute": false,
    "distributed_dataloader": 1,
    "recompute_granularity": "full",
    "save_total_limit": 2
  }
"""

# PaddleNLP's llm/llama/pretrain-llama_13b-pp4tp2sd2_stage1.json (fp16, pipeline, an inert key).
PADDLENLP_LLAMA_13B = {
    "model_name_or_path": "facebook/llama-13b", "tokenizer_name_or_path": "facebook/llama-13b",
    "input_dir": "./data", "output_dir": "./checkpoints/llama_benchmark_ckpts",
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 64, "per_device_eval_batch_size": 64,
    "tensor_parallel_degree": 2, "pipeline_parallel_degree": 4,
    "pipeline_parallel_config": "disable_partial_send_recv", "sharding_parallel_degree": 4,
    "virtual_pp_degree": 1, "sharding": "stage1", "sequence_parallel": 1, "adam_beta1": 0.9, "adam_beta2": 0.95,
    "use_flash_attention": True, "use_fused_rms_norm": True, "use_fused_rope": True, "max_seq_length": 2048,
    "learning_rate": 1e-04, "initializer_range": 0.002, "min_learning_rate": 1e-05, "warmup_steps": 2000,
    "logging_steps": 1, "max_steps": 200000, "save_steps": 1000, "eval_steps": 2000, "weight_decay": 0.1,
    "max_grad_norm": 1.0, "amp_master_grad": 1, "fp16": True, "fp16_opt_level": "O2",
    "dataloader_num_workers": 1, "continue_training": 1, "do_train": True, "do_eval": True, "do_predict": True,
    "disable_tqdm": True, "recompute": False, "distributed_dataloader": 0, "recompute_granularity": "full",
    "save_total_limit": 2, "eval_accumulation_steps": 16, "seed": 0,
}


def write_json(tmp_path, values, name="args.json"):
    path = tmp_path / name
    path.write_text(values if isinstance(values, str) else json.dumps(values))
    return str(path)


def test_paddlenlp_file_parses_unchanged_with_paddlenlp_meaning(tmp_path):
    args, warnings = parse_arguments([write_json(tmp_path, PADDLENLP_LLAMA_7B)])
    assert args.model_name_or_path == "facebook/llama-7b"
    assert args.tensor_parallel_degree == 2 and args.sharding == "stage2"
    assert args.sequence_parallel is False and args.continue_training is True
    assert args.bf16 and args.fp16_opt_level == "O2" and args.use_flash_attention
    assert args.max_seq_length == 2048 and args.gradient_accumulation_steps == 8
    assert args.learning_rate == 3e-05 and args.min_learning_rate == 3e-06
    assert args.effective_warmup_steps == 30  # warmup_steps wins over warmup_ratio, as in PaddleNLP
    assert warnings == []


def test_paddlenlp_13b_keys_parse_and_inert_keys_warn(tmp_path):
    args, warnings = parse_arguments([write_json(tmp_path, PADDLENLP_LLAMA_13B)])
    assert args.pipeline_parallel_degree == 4 and args.sequence_parallel and args.fp16 and args.amp_master_grad
    assert args.sharding_parallel_degree == 4 and args.adam_beta2 == 0.95 and args.initializer_range == 0.002
    assert args.pipeline_parallel_config == "disable_partial_send_recv"
    assert len(warnings) == 1 and "eval_accumulation_steps" in warnings[0] and "no effect" in warnings[0]


def test_command_line_overrides_file(tmp_path):
    path = write_json(tmp_path, {"input_dir": "d", "max_steps": 10, "bf16": True})
    args, _ = parse_arguments([path, "--max_steps", "3", "--bf16", "false", "--learning_rate=1e-3", "--do_eval"])
    assert (args.max_steps, args.bf16, args.learning_rate, args.do_eval) == (3, False, 1e-3, True)


def test_no_recompute_layers_list(tmp_path):
    args, _ = parse_arguments(["--input_dir", "d", "--max_steps", "1", "--no_recompute_layers", "0,2"])
    assert args.no_recompute_layers == [0, 2]


@pytest.mark.parametrize("values, expected", [
    ({"lerning_rate": 1e-3}, "unknown key 'lerning_rate' (in "),
    ({"lerning_rate": 1e-3}, "did you mean 'learning_rate'?"),
    ({"max_steps": "ten"}, 'max_steps: expected an integer, got "ten"'),
    ({"learning_rate": "fast"}, "learning_rate: expected a number"),
    ({"bf16": 2}, "bf16: expected true/false (or 0/1), got 2"),
    ({"sharding": "stage4"}, 'sharding: "stage4" is not allowed; allowed: "", "stage1", "stage2", "stage3"'),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size: 0 is too small; the minimum is 1"),
    ({"max_steps": 0}, "max_steps: set a positive number"),
    ({"recompute_granularity": "some"}, "recompute_granularity:"),
    ({"warmup_ratio": 2.0}, "warmup_ratio: 2.0 is not allowed"),
    ({"tensor_parallel_degree": 0}, "tensor_parallel_degree: 0 is not allowed"),
    ({"min_learning_rate": 1.0, "learning_rate": 0.1}, "min_learning_rate: 1.0 is larger than learning_rate"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16"),
    ({"sep_parallel_degree": 0}, "sep_parallel_degree: 0 is not allowed; use a positive degree"),
])
def test_bad_values_name_the_key(tmp_path, values, expected):
    values = {"input_dir": "d", "max_steps": 5, **values}
    with pytest.raises(UsageError) as error:
        parse_arguments([write_json(tmp_path, values)])
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_input_dir_is_an_error(tmp_path):
    with pytest.raises(UsageError, match="input_dir: required"):
        parse_arguments([write_json(tmp_path, {"max_steps": 5})])


def test_every_inert_key_is_accepted_at_its_default(tmp_path):
    values = {"input_dir": "d", "max_steps": 1, **INERT_KEYS}
    _, warnings = parse_arguments([write_json(tmp_path, values)])
    assert warnings == []
    assert not set(INERT_KEYS) & set(Arguments.__dataclass_fields__)


def run_cli(*argv, cwd=None):
    return subprocess.run([sys.executable, RUN_PRETRAIN, *argv], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("content, expected", [
    ('{"max_steps": 5,, }', "is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ('{"input_dir": "d", "max_steps": 5, "lerning_rate": 1}', "did you mean 'learning_rate'?"),
    ('{"input_dir": "d", "max_steps": "5x"}', "max_steps: expected an integer"),
    ('[1, 2]', "must hold a JSON object"),
])
def test_cli_reports_one_line_and_exit_code_2(tmp_path, content, expected):
    result = run_cli(write_json(tmp_path, content))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_cli_missing_file_and_missing_input_dir(tmp_path):
    result = run_cli(str(tmp_path / "nope.json"))
    assert result.returncode == 2 and "nope.json does not exist" in result.stderr
    result = run_cli(write_json(tmp_path, {"max_steps": 5, "input_dir": str(tmp_path / "no_such_dir")}))
    assert result.returncode == 2 and "input_dir" in result.stderr and "no_such_dir" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
