"""Impossible parallel layouts are one-line errors naming the keys, before fleet.init or any launch work."""

import subprocess
import sys

import pytest

from llm_pretrain.arguments import parse_arguments
from llm_pretrain.errors import UsageError
from parity_utils import RUN_PRETRAIN, base_arguments, write_json

CASES = [
    # (world size, overrides, words the message must contain)
    (3, {"tensor_parallel_degree": 2}, ["world size 3", "tensor_parallel_degree 2"]),
    (3, {"tensor_parallel_degree": 3}, ["tensor_parallel_degree", "num_attention_heads 4"]),
    (3, {"pipeline_parallel_degree": 3, "gradient_accumulation_steps": 3, "pipeline_layers_per_stage": [2, 2, 2]},
     ["pipeline_layers_per_stage", "num_hidden_layers 8"]),
    (4, {"pipeline_parallel_degree": 4, "virtual_pp_degree": 4}, ["virtual_pp_degree", "num_hidden_layers 8"]),
    (2, {"pipeline_parallel_degree": 2, "virtual_pp_degree": 2}, ["virtual_pp_degree", "pipeline_parallel_degree 2"]),
    (1, {"sequence_parallel": True}, ["sequence_parallel", "tensor_parallel_degree"]),
    (4, {"pipeline_parallel_degree": 2, "sharding": "stage2"}, ["stage2", "pipeline_parallel_degree 2"]),
    (4, {"tensor_parallel_degree": 2, "sharding": "stage3"}, ["stage3", "tensor_parallel_degree 2"]),
    (2, {"pipeline_parallel_degree": 2, "gradient_accumulation_steps": 1},
     ["gradient_accumulation_steps", "1", "pipeline_parallel_degree 2"]),
    (2, {"tensor_parallel_degree": 2, "sequence_parallel": True, "per_device_train_batch_size": 1,
         "max_seq_length": 33}, ["sequence_parallel", "33", "tensor_parallel_degree 2"]),
    (2, {"pipeline_parallel_degree": 2, "pipeline_parallel_config": "enable_delay_scale_loss fast_mode"},
     ["pipeline_parallel_config", "'fast_mode'", "disable_partial_send_recv"]),
    (2, {"sharding": "stage1", "sharding_parallel_config": "split_param"}, ["sharding_parallel_config", "split_param"]),
    # segment parallelism (sep_parallel_degree): sequence and heads must split, combinations not proven are refused
    (3, {"sep_parallel_degree": 2}, ["world size 3", "sep_parallel_degree 2"]),
    (2, {"sep_parallel_degree": 2, "max_seq_length": 33}, ["sep_parallel_degree: 2", "max_seq_length 33"]),
    (8, {"sep_parallel_degree": 4, "tensor_parallel_degree": 2}, ["sep_parallel_degree: 4", "num_attention_heads 4"]),
    (4, {"sep_parallel_degree": 2, "pipeline_parallel_degree": 2, "pipeline_parallel_config": "use_dualpipev"},
     ["sep_parallel_degree: 2", "use_dualpipev"]),
    (4, {"sep_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True,
         "per_device_train_batch_size": 1, "max_seq_length": 34}, ["sequence_parallel", "17", "tensor_parallel_degree 2"]),
    # context parallelism (ring attention)
    (3, {"context_parallel_degree": 3}, ["context_parallel_degree: 3 must be even"]),
    (2, {"context_parallel_degree": 2, "max_seq_length": 34}, ["context_parallel_degree", "34", "= 4"]),
    (4, {"context_parallel_degree": 2, "sep_parallel_degree": 2}, ["context_parallel_degree: 2", "sep_parallel_degree 2"]),
    (4, {"context_parallel_degree": 2, "pipeline_parallel_degree": 2, "pipeline_parallel_config": "use_dualpipev"},
     ["context_parallel_degree: 2", "use_dualpipev"]),
    (2, {"context_parallel_degree": 2, "attention_probs_dropout_prob": 0.1}, ["attention_probs_dropout_prob: 0.1"]),
    (8, {"context_parallel_degree": 2, "tensor_parallel_degree": 4, "sequence_parallel": True,
         "per_device_train_batch_size": 1, "max_seq_length": 12}, ["sequence_parallel", "context_parallel_degree = 6",
                                                                   "tensor_parallel_degree 4"]),
]


@pytest.mark.parametrize("world_size, overrides, expected", CASES)
def test_layout_errors_name_the_keys(embedded_corpus, tmp_path, monkeypatch, world_size, overrides, expected):
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the loop (as the command)

    args_file = write_json(tmp_path / "args.json", base_arguments(embedded_corpus, tmp_path, **overrides))
    args, warnings = parse_arguments([str(args_file), "--output_dir", str(tmp_path / "out")])
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(world_size))  # what the launcher tells each process
    with pytest.raises(UsageError) as error:
        train(args, warnings)
    message = str(error.value)
    assert all(word in message for word in expected), message
    assert "\n" not in message
    assert not (tmp_path / "out").exists()


def test_model_sizes_that_tensor_parallelism_cannot_split():
    from llm_pretrain.parallel.layout import Layout, check_model_fits_layout
    from models.registry import make_config

    layout = Layout(world_size=2, data_parallel_degree=1, tensor_parallel_degree=2, pipeline_parallel_degree=1,
                    sharding_degree=1, sharding_stage=0, virtual_pp_degree=1)
    config = make_config("llama", vocab_size=513, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=176)
    with pytest.raises(UsageError, match="tensor_parallel_degree: 2 does not divide the model's vocab_size 513"):
        check_model_fits_layout(config, layout)


def test_command_line_error_is_one_line_with_exit_code_2(embedded_corpus, tmp_path):
    import os

    args_file = write_json(tmp_path / "args.json", base_arguments(embedded_corpus, tmp_path,
                                                                  pipeline_parallel_degree=2, virtual_pp_degree=2))
    env = {**os.environ, "PADDLE_TRAINERS_NUM": "2"}
    result = subprocess.run([sys.executable, str(RUN_PRETRAIN), str(args_file)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: virtual_pp_degree: 2 needs pipeline_parallel_degree > 2")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
