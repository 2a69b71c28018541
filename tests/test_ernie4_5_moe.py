"""ERNIE 4.5 MoE (issue 34, model_type ernie4_5_moe): the published counts as the registry and the planner count
them, which layers are MoE (start, interval, end), the router (softmax, the correction bias only chooses) and the
ungated shared experts against transformers' formula, bad input, and 12 steps of run_pretrain on the tiny preset in
this process. Its layouts: tp2 (+ SP), dp2, pp2 and sharding stages 1-3 train against one process in
tests/test_parallel_parity.py (TP_ONLY, LAYOUT_SHORT), ep2 over dp2 and over sd2 (stages 1, 2) in
tests/test_expert_parallel.py; the others are refused
(tests/test_ernie4_5.py::test_layouts_not_proven_are_refused_in_one_line).

Same function as transformers' Ernie4_5_MoeForCausalLM (4.57.6 and 5.24.0): scripts/verify_hf_import.py, case
ernie4_5_moe (tests/test_hf_import_verification.py checks its report); and as PaddleFormers 0.4.1's, both ways, with
CPU stand-ins of its GPU-only MoE kernels: scripts/verify_paddleformers.py (tests/test_paddleformers_parity.py)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from llm_pretrain.planner.params import parameter_list
from models.decoder import CausalLM
from models.deepseek_moe import DeepSeekMoE
from models.errors import UsageError
from models.families.ernie4_5_moe import PUBLISHED, config_json, moe_layers, paddleformers_config_json, parameter_counts
from models.registry import ARCHITECTURES, activated_parameter_count, config_from_dict, parameter_count

TINY = ARCHITECTURES["ernie4_5_moe-tiny"]
NAMES = ("baidu/ERNIE-4.5-21B-A3B-Base-PT", "baidu/ERNIE-4.5-300B-A47B-Base-PT")


@pytest.mark.parametrize("name", NAMES)
def test_published_counts_are_the_registrys_and_the_planners(name):
    config = ARCHITECTURES[name]
    assert (parameter_count(config), activated_parameter_count(config)) == parameter_counts(PUBLISHED[name])
    assert sum(p.numel for p in parameter_list(config, 1)) == parameter_count(config)
    # the published config.json reads as the built-in architecture, also as transformers 5 writes the end index
    assert config_from_dict(dict(PUBLISHED[name]), name) == config
    last = PUBLISHED[name]["num_hidden_layers"] - 1
    assert config_from_dict({**PUBLISHED[name], "moe_layer_end_index": last}, name) == config


@pytest.mark.parametrize("name", ["ernie4_5_moe-tiny", "ernie4_5_moe-real", *NAMES])
def test_exported_config_json_reads_back_the_same(name):
    assert config_from_dict(config_json(ARCHITECTURES[name]), name) == ARCHITECTURES[name]
    # PaddleFormers' file says "no MTP" (its Ernie4_5_MoeConfig defaults to 1: an MTP block, the last label dropped)
    theirs = paddleformers_config_json(ARCHITECTURES[name])
    assert theirs["num_nextn_predict_layers"] == 0 and config_from_dict(theirs, name) == ARCHITECTURES[name]


@pytest.mark.parametrize("raw", [
    PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"], PUBLISHED["baidu/ERNIE-4.5-300B-A47B-Base-PT"],
    # scripts/verify_hf_import.py's case: MoE layers 1 and 3 of 5 (start, interval and end each decide one)
    {**PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"], "num_hidden_layers": 5, "moe_layer_interval": 2,
     "moe_layer_end_index": 3},
    {**PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"], "num_hidden_layers": 10, "moe_layer_start_index": 0,
     "moe_layer_interval": 3},
])
def test_moe_layers_are_where_transformers_puts_them(raw):
    config = config_from_dict(dict(raw), "config.json")
    assert [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)] == moe_layers(raw)
    assert config.moe_layer_count == len(moe_layers(raw))


def test_tiny_model_has_a_moe_block_in_layer_1_with_a_checkpointed_untrained_bias():
    model = CausalLM(TINY)
    assert [isinstance(layer.mlp, DeepSeekMoE) for layer in model.layers] == [False, True]
    block = model.layers[1].mlp
    assert block.e_score_correction_bias.stop_gradient and "layers.1.mlp.e_score_correction_bias" in model.state_dict()
    assert block.shared_expert.gate_proj.weight.shape == [64, 64] and not hasattr(block, "shared_expert_gate")


def _swiglu(mlp, x):
    gate, up, down = (getattr(mlp, n).weight.numpy().astype("float64") for n in ("gate_proj", "up_proj", "down_proj"))
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down


def test_block_is_transformers_router_experts_and_shared_experts():
    """Ernie4_5_MoeTopKRouter / Ernie4_5_MoeSparseMoeBlock (transformers 5.24.0) in NumPy on the block's weights:
    softmax probabilities, top-k of probs + bias, weights = the chosen probs / their sum, plus the shared expert."""
    paddle.seed(5)
    model = CausalLM(TINY)
    block = model.layers[1].mlp
    rng = np.random.default_rng(2)
    # every matrix drawn at unit scale (the init's std 0.02 leaves outputs of 1e-4, under any tolerance), the
    # router's so that it prefers some experts
    for param in block.parameters():
        if len(param.shape) == 2:
            scale = 0.3 if param is block.gate.weight else 1 / np.sqrt(param.shape[0])
            param.set_value(rng.normal(0, scale, param.shape).astype("float32"))
    bias = rng.uniform(-0.2, 0.2, TINY.num_experts).astype("float32")  # as large as the probabilities (1/8)
    block.e_score_correction_bias.set_value(bias)
    x = rng.standard_normal([1, 40, TINY.hidden_size]).astype("float32")
    with paddle.no_grad():
        ours = block(paddle.to_tensor(x)).numpy()[0]
    h = x[0].astype("float64")
    logits = h @ block.gate.weight.numpy().astype("float64")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = TINY.num_experts_per_tok
    chosen = np.argsort(-(probs + bias), axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-12)
    want = _swiglu(block.shared_expert, h)
    for t in range(h.shape[0]):
        for j in range(k):
            want[t] += weights[t, j] * _swiglu(block.experts[str(chosen[t, j])], h[t:t + 1])[0]
    assert np.abs(want).mean() > 0.1
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)
    # the bias changed the choice of some tokens (so the test sees where it is used), and the probabilities are
    # not uniform (so the weights show how they are made)
    unbiased = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    assert (np.sort(unbiased, -1) != np.sort(chosen, -1)).any() and (np.sort(unbiased, -1) == np.sort(chosen, -1)).any()
    assert np.abs(weights - 1 / k).max() > 0.05


@pytest.mark.parametrize("change, key", [
    ({"use_bias": True}, "use_bias true"),
    ({"moe_num_experts": [64, 64]}, "moe_num_experts [64, 64]"),
    ({"moe_layer_interval": 0}, "moe_layer_interval 0"),
    ({"moe_layer_end_index": -2}, "moe_layer_end_index -2"),
    ({"moe_norm_min": 0.001}, "moe_norm_min 0.001"),
    ({"model_type": "ernie4_5_moe_vl"}, "model_type 'ernie4_5_moe_vl'"),
    ({"num_experts": 32}, "num_experts 32 and moe_num_experts 64 disagree"),
    # PaddleFormers' default (its save_pretrained writes it, with the MTP block's weights)
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers 1"),
])
def test_what_it_cannot_compute_is_refused_in_one_line(change, key):
    with pytest.raises(UsageError) as error:
        config_from_dict({**PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"], **change}, source="ERNIE/config.json")
    message = str(error.value)
    assert "\n" not in message and key in message and "ERNIE/config.json" in message


def test_tiny_trains_through_run_pretrain_with_the_bias_rule(embedded_corpus, tmp_path):
    """run_pretrain in this process, 12 steps: the loss goes down and the correction biases moved by whole steps
    of the rate (moe_bias_update_rate: DeepSeek-V3's rule, models/deepseek_moe.py), untouched by the optimizer."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.run_pretrain import run as train
    from llm_pretrain.selfcheck.parity import final_weights, write_json
    from parity_utils import base_arguments, train_records

    data = base_arguments(embedded_corpus, tmp_path, model_name_or_path="ernie4_5_moe-tiny", num_hidden_layers=2,
                          max_seq_length=32,
                          per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=12, warmup_steps=2,
                          logging_steps=4, save_steps=12, learning_rate=0.005, moe_bias_update_rate=0.001,
                          output_dir=str(tmp_path / "out"))
    args, _ = parse_arguments([str(write_json(tmp_path / "args.json", data))])
    train(args, [])
    losses = [r["loss"] for r in train_records(tmp_path / "out")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
    weights = final_weights(tmp_path / "out", step=12)
    bias = weights["layers.1.mlp.e_score_correction_bias"]
    assert 0 < np.abs(bias).max() <= 0.012 + 1e-6 and np.allclose(bias * 1000, np.round(bias * 1000), atol=1e-3)
    assert "layers.0.mlp.e_score_correction_bias" not in weights and "layers.0.mlp.gate_proj.weight" in weights


@pytest.mark.parametrize("model, extra", [("ernie4_5_moe-tiny", {"moe_bias_update_rate": 0.01}),
                                          ("qwen3-moe-tiny", {"moe_global_batch_balance": True})])
def test_pipeline_with_expert_parallelism_over_data_parallel_ranks_is_accepted(model, extra, embedded_corpus, tmp_path):
    """pp2 x dp2 with ep2 over dp (tests/test_expert_parallel.py pp2dp2ep2-ernie, pp2dp2ep2-qwen3-global): the trainer's
    check and the planner (llm-plan's validated_setup) give the same layout; without ep it stays refused."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.planner.estimate import validated_setup
    from llm_pretrain.selfcheck.parity import write_json
    from parity_utils import base_arguments

    def arguments(**overrides):
        data = base_arguments(embedded_corpus, tmp_path, model_name_or_path=model, num_hidden_layers=2,
                              pipeline_parallel_degree=2, gradient_accumulation_steps=2,
                              output_dir=str(tmp_path / "out"), **extra, **overrides)
        return parse_arguments([str(write_json(tmp_path / "args.json", data))])[0]

    args = arguments(expert_parallel_degree=2)
    layout, config, _, _ = check_layout_and_model(args, 4, "cpu")
    assert (layout.pipeline_parallel_degree, layout.data_parallel_degree, config.expert_parallel_degree) == (2, 2, 2)
    assert validated_setup(args, 4, "cpu")[1] == layout
    with pytest.raises(UsageError, match="^pipeline_parallel_degree 2 with data_parallel_degree 2 together is not "
                                         "proven"):
        check_layout_and_model(arguments(expert_parallel_degree=1), 4, "cpu")
