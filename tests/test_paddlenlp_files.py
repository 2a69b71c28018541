"""PaddleNLP argument files that 2.8.1 runs are accepted here with PaddleNLP's meaning (issue 16, item 4).

* RoPE (and ALiBi) models with continue_training and max_seq_length above the checkpoint's
  max_position_embeddings: accepted, the rotary tables extend (PaddleNLP's run_pretrain.py keeps
  max_position_embeddings under continue_training); learned positions stay an error.
* A pipeline's per_device_eval_batch_size may differ from the training micro-batch: evaluation
  runs it as several training-sized pipeline micro-batches (parity: test_parallel_parity's pp2 and
  pp4vpp2 runs evaluate with batch 4 against micro-batch 2 and match one process).
* The validation and test splits are built with the sample counts of PaddleNLP's llm/run_pretrain.py
  (create_pretrained_dataset), and the k-th evaluation reads the k-th run of eval_iters batches.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from llm_pretrain.arguments import parse_arguments
from llm_pretrain.parallel.distributed import Layout, plan_layout
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.layout import check_strategy, pipeline_eval_micro_batches, predict_iterations
from llm_pretrain.parallel.layout import build_model_config
from llm_pretrain.run.trainer import BatchPlan, first_eval_sample, valid_samples
from models.decoder import CausalLM
from models.weights import init_weights


def _args(*argv):
    return parse_arguments(["--input_dir", "/nonexistent", "--max_steps", "10", *map(str, argv)])[0]


@pytest.mark.parametrize("model", ["llama-tiny", "llama3-tiny", "qwen2-tiny", "baichuan-tiny"])
def test_rope_and_alibi_continue_training_beyond_max_positions(model):
    args = _args("--model_name_or_path", model, "--continue_training", "1", "--max_seq_length", "2048")
    config, weights_file, notes = build_model_config(args, Layout(), "cpu")
    assert config.max_position_embeddings == 1024 and config.seq_length == 2048  # the checkpoint's, unchanged
    assert any("2048 exceeds the model's max_position_embeddings 1024" in note for note in notes)
    # without continue_training the model is enlarged instead, as PaddleNLP does
    args = _args("--model_name_or_path", model, "--max_seq_length", "2048")
    assert build_model_config(args, Layout(), "cpu")[0].max_position_embeddings == 2048


def test_learned_positions_beyond_max_positions_stay_an_error():
    args = _args("--model_name_or_path", "gpt3-tiny", "--continue_training", "1", "--max_seq_length", "2048")
    with pytest.raises(UsageError, match=r"max_seq_length: 2048 .*\(learned positions"):
        build_model_config(args, Layout(), "cpu")


def test_rotary_tables_extend_beyond_max_positions():
    """A model with max_position_embeddings 8 runs 16 tokens; its first 8 positions compute as before (causal)."""
    args = _args("--model_name_or_path", "llama3-tiny", "--continue_training", "1", "--max_seq_length", "16")
    config, _, _ = build_model_config(args, Layout(), "cpu")
    config = config.replace(max_position_embeddings=8)
    paddle.seed(0)
    model = CausalLM(config)
    init_weights(model, config, seed=3)
    model.eval()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (1, 16)), dtype="int64")
    with paddle.no_grad():
        long, short = model(ids).numpy(), model(ids[:, :8]).numpy()
    assert long.shape == (1, 16, config.vocab_size)
    np.testing.assert_allclose(long[:, :8], short, atol=1e-5)


def test_eval_and_test_sample_counts_are_paddlenlp_run_pretrains():
    args = _args("--per_device_eval_batch_size", "3", "--eval_iters", "4", "--eval_steps", "3", "--max_steps", "10")
    plan = BatchPlan(args.per_device_eval_batch_size, 1, data_replicas=2, data_replica_rank=1)
    # llm/run_pretrain.py: per_device_eval_batch_size * dataset_world_size * eval_iters * (max_steps // eval_steps + 1)
    assert valid_samples(args, plan) == 3 * 2 * 4 * (10 // 3 + 1)
    assert predict_iterations(args) == 10 * 4  # test_iters = eval_iters * 10
    # PaddleNLP's PretrainingTrainer keeps one eval iterator: evaluation k reads the k-th run of batches
    assert [first_eval_sample(args, "valid", step, plan) for step in (3, 6, 9)] == [0, 24, 48]
    assert first_eval_sample(args, "test", 10, plan) == 0
    assert first_eval_sample(args, "valid", 9, plan) + args.eval_iters * plan.global_batch_size \
        <= valid_samples(args, plan)


@pytest.mark.parametrize("eval_batch, micro, accumulation, iterations, vpp, expected", [
    (4, 2, 4, 2, 1, (1, 4)),      # 2 batches of 4 = 4 micro-batches of 2: one pipeline call
    (16, 1, 16, 10, 1, (10, 16)),  # PaddleNLP's qwen pp4 file: 160 micro-batches in calls of 16
    (6, 2, 4, 1, 1, (1, 3)),      # 3 micro-batches: one call of 3 (1F1B runs any count forward)
    (2, 2, 4, 1, 1, (1, 1)),
])
def test_pipeline_eval_micro_batches(eval_batch, micro, accumulation, iterations, vpp, expected):
    args = _args("--per_device_eval_batch_size", eval_batch, "--per_device_train_batch_size", micro,
                 "--gradient_accumulation_steps", accumulation)
    assert pipeline_eval_micro_batches(args, iterations, vpp) == expected


@pytest.mark.parametrize("overrides, message", [
    (dict(per_device_eval_batch_size=3, per_device_train_batch_size=2), "multiple of per_device_train_batch_size 2"),
    (dict(per_device_eval_batch_size=2, per_device_train_batch_size=1, gradient_accumulation_steps=8,
          virtual_pp_degree=2, eval_iters=3), "interleaved"),
])
def test_pipeline_eval_that_cannot_run_is_a_usage_error(overrides, message):
    argv = ["--model_name_or_path", "llama-tiny", "--num_hidden_layers", "8", "--pipeline_parallel_degree", "4",
            "--do_eval", "true", "--gradient_accumulation_steps", "4"]
    for key, value in overrides.items():
        argv += [f"--{key}", value]
    args = _args(*argv)
    layout = plan_layout(args, 4)
    config, _, _ = build_model_config(args, layout, "cpu")
    with pytest.raises(UsageError, match=message):
        check_strategy(args, config, layout)


def test_pipeline_eval_batch_other_than_micro_batch_is_accepted():
    args = _args("--model_name_or_path", "llama-tiny", "--num_hidden_layers", "8", "--pipeline_parallel_degree", "2",
                 "--do_eval", "true", "--do_predict", "true", "--gradient_accumulation_steps", "4",
                 "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "2")
    layout = plan_layout(args, 2)
    check_strategy(args, build_model_config(args, layout, "cpu")[0], layout)


def test_sep_parallel_degree_keeps_paddlenlp_meaning():
    """PaddleNLP's sep_parallel_degree: the ranks of a sep group share samples (data replicas are
    world / (tp x pp x sep)), and the strategy name carries it."""
    args = _args("--model_name_or_path", "llama-tiny", "--sep_parallel_degree", "2", "--tensor_parallel_degree", "2",
                 "--max_seq_length", "64")
    layout = plan_layout(args, 8)
    assert (layout.sep_parallel_degree, layout.data_parallel_degree, layout.data_replicas) == (2, 2, 2)
    assert layout.strategy == "tp2sep2dp2"
    config, _, _ = build_model_config(args, layout, "cpu")
    check_strategy(args, config, layout)
