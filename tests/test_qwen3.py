"""Qwen3 (models/families/qwen3.py), in one process: the published sizes and their parameter counts,
config.json reading (and what is refused), the q/k norms and the head width apart from hidden / heads.

The same function as PaddleFormers 0.4.1's Qwen3ForCausalLM (logits and loss, same weights) is judged in
its own environment by scripts/verify_paddleformers.py (benchmarks/paddleformers_parity.md, checked by
tests/test_paddleformers_parity.py); its layouts: tp2 (+ SP), dp2, pp2 and sharding stages 1-3 in tests/test_parallel_parity.py, sep2
and cp2, alone and with tp2 (+ SP) or sharding stage 2, in tests/test_long_context.py; Qwen3-MoE's: tp2 (+ SP), dp2, pp2 and sharding
stages 1-3 in tests/test_parallel_parity.py, sep2 and cp2 in tests/test_long_context.py, ep2 over dp2 and over sd2 (stages 1, 2) with global-batch balancing in
tests/test_expert_parallel.py; the others are refused
(tests/test_ernie4_5.py::test_layouts_not_proven_are_refused_in_one_line).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from llm_pretrain.planner.params import parameter_list
from models.decoder import CausalLM
from models.errors import UsageError
from models.families.qwen3 import hf_qwen3_config
from models.families.qwen3_moe import hf_qwen3_moe_config
from models.registry import ARCHITECTURES, activated_parameter_count, config_from_dict, parameter_count
from models.weights import init_weights

# The model cards' "Number of Parameters" and "(Non-Embedding)" (Qwen/<name> on the Hugging Face hub), in
# billions as printed there; non-embedding leaves out the embedding and an untied head.
MODEL_CARDS = {
    "Qwen/Qwen3-0.6B": (0.6, 0.44), "Qwen/Qwen3-1.7B": (1.7, 1.4), "Qwen/Qwen3-4B": (4.0, 3.6),
    "Qwen/Qwen3-8B": (8.2, 6.95), "Qwen/Qwen3-14B": (14.8, 13.2), "Qwen/Qwen3-32B": (32.8, 31.2),
}

# Qwen/Qwen3-0.6B's config.json as published (the architecture keys; the token ids and dtype left out).
QWEN3_06B_CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def _decimals(printed) -> int:
    return len(repr(printed).split(".")[1]) if isinstance(printed, float) else 0


def _round_to(value: float, printed) -> float:
    """`value` rounded to the digits the model card prints (235 -> units, 30.5 -> tenths)."""
    return round(value, _decimals(printed))


@pytest.mark.parametrize("name", sorted(MODEL_CARDS))
def test_parameter_counts_are_the_model_cards(name):
    config = ARCHITECTURES[name]
    total = parameter_count(config)
    embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    card_total, card_non_embedding = MODEL_CARDS[name]
    assert _round_to(total / 1e9, card_total) == card_total
    assert _round_to((total - embedding) / 1e9, card_non_embedding) == card_non_embedding
    assert config.head_dim == 128 and config.qk_norm and not config.qkv_bias
    assert sum(p.numel for p in parameter_list(config, 1)) == total  # the planner counts the same parameters


def test_qwen3_8b_is_8_19_billion():
    assert parameter_count(ARCHITECTURES["Qwen/Qwen3-8B"]) == 8_190_735_360


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-real"])
def test_presets_hold_the_counted_parameters(name):
    config = ARCHITECTURES[name]
    model = CausalLM(config)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    assert sum(int(np.prod(s)) for s in shapes.values()) == parameter_count(config)
    assert [(p.name, p.numel) for p in parameter_list(config, 1)] == [(n, int(np.prod(s))) for n, s in shapes.items()]
    # the query columns are heads x head_dim, not the hidden width; one [head_dim] norm each for q and k
    q_columns = config.num_attention_heads * config.head_dim
    assert shapes["layers.0.self_attn.q_proj.weight"] == [config.hidden_size, q_columns]
    assert shapes["layers.0.self_attn.o_proj.weight"] == [q_columns, config.hidden_size]
    assert shapes["layers.0.self_attn.q_norm.weight"] == shapes["layers.0.self_attn.k_norm.weight"] == [config.head_dim]
    assert "layers.0.self_attn.q_proj.bias" not in shapes
    if name == "qwen3-tiny":
        assert q_columns != config.hidden_size
    else:  # above Paddle's thresholds: stage 3 slices > 2**20 elements, stage 2 keeps > 2**23 out of its buffer
        assert int(np.prod(shapes["layers.0.mlp.gate_proj.weight"])) > 2**20
        assert int(np.prod(shapes["embeddings.word_embeddings.weight"])) > 2**23


def test_published_config_json_is_the_built_in_architecture():
    config = config_from_dict(dict(QWEN3_06B_CONFIG_JSON), source="Qwen3-0.6B/config.json")
    assert config == ARCHITECTURES["Qwen/Qwen3-0.6B"]
    for name in MODEL_CARDS:  # and our export's config.json reads back as the same architecture
        assert config_from_dict(hf_qwen3_config(ARCHITECTURES[name]), source=name) == ARCHITECTURES[name]


@pytest.mark.parametrize("change, key", [
    ({"attention_bias": True}, "attention_bias true"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window true"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling"),
])
def test_switches_it_cannot_compute_are_refused_in_one_line(change, key):
    with pytest.raises(UsageError) as error:
        config_from_dict({**QWEN3_06B_CONFIG_JSON, **change}, source="Qwen3-0.6B/config.json")
    message = str(error.value)
    assert "\n" not in message and key in message and "Qwen3-0.6B/config.json" in message


def _random_model(config, seed=3):
    """qwen3-tiny with every weight drawn, the norms' too (a norm weight of 1 would hide a missing norm)."""
    model = CausalLM(config)
    init_weights(model, config, seed)
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.set_value(rng.uniform(0.5, 1.5, param.shape).astype("float32"))
    model.eval()
    return model


def test_q_and_k_norms_are_applied_per_head():
    """The q/k norms act: the logits are those of RMSNorm over each head of q and k (computed here from the
    q/k projections with numpy), and differ from the same weights without the norms."""
    config = ARCHITECTURES["qwen3-tiny"].replace(seq_length=16)
    model = _random_model(config)
    tokens = paddle.to_tensor(np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)), dtype="int64")
    logits = model(tokens).numpy()

    attention = model.layers[0].self_attn
    hidden = model.layers[0].input_layernorm(model.embeddings(tokens))
    d = config.head_dim
    q = attention.q_proj(hidden).numpy().reshape(2, 16, config.num_attention_heads, d)
    w = attention.q_norm.weight.numpy()
    expected = q / np.sqrt((q ** 2).mean(-1, keepdims=True) + config.norm_eps) * w
    np.testing.assert_allclose(attention.q_norm(paddle.to_tensor(q)).numpy(), expected, rtol=1e-5, atol=1e-6)

    plain = CausalLM(config.replace(qk_norm=False))
    plain.set_state_dict({k: v for k, v in model.state_dict().items() if "q_norm" not in k and "k_norm" not in k})
    plain.eval()
    assert np.abs(plain(tokens).numpy() - logits).max() > 1e-2
    # and both norms matter: scaling k_norm's weight alone changes the attention scores, hence the logits
    with paddle.no_grad():
        attention.k_norm.weight.set_value(attention.k_norm.weight * 2.0)
    assert np.abs(model(tokens).numpy() - logits).max() > 1e-3


# ----------------------------------------------------------------------------- Qwen3-MoE
# The model cards: total and activated parameters, in billions as printed there.
MOE_MODEL_CARDS = {"Qwen/Qwen3-30B-A3B": (30.5, 3.3), "Qwen/Qwen3-235B-A22B": (235, 22)}


@pytest.mark.parametrize("name", sorted(MOE_MODEL_CARDS))
def test_moe_parameter_counts_are_the_model_cards(name):
    config = ARCHITECTURES[name]
    total, activated = MOE_MODEL_CARDS[name]
    assert _round_to(parameter_count(config) / 1e9, total) == total
    # The cards cut the activated count to their digits rather than rounding it: 3.353B is "3.3B", 22.19B "22B".
    assert math.floor(activated_parameter_count(config) / 1e9 * 10 ** _decimals(activated)) / 10 ** _decimals(
        activated) == activated
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (128, 8, True)
    assert config.shared_expert_intermediate_size == 0 and config.qk_norm and config.head_dim == 128
    assert config.router_aux_loss_coef == 0.001 and not config.tie_word_embeddings
    assert sum(p.numel for p in parameter_list(config, 1)) == parameter_count(config)
    assert config_from_dict(hf_qwen3_moe_config(config), source=name) == config


def test_qwen3_30b_a3b_exact_counts():
    config = ARCHITECTURES["Qwen/Qwen3-30B-A3B"]
    assert (parameter_count(config), activated_parameter_count(config)) == (30_532_122_624, 3_353_032_704)


def test_moe_tiny_trains_a_step_with_every_parameter_counted():
    config = ARCHITECTURES["qwen3-moe-tiny"].replace(seq_length=16)
    model = CausalLM(config)
    init_weights(model, config, 0)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    assert sum(int(np.prod(s)) for s in shapes.values()) == parameter_count(config)
    assert [(p.name, p.numel) for p in parameter_list(config, 1)] == [(n, int(np.prod(s))) for n, s in shapes.items()]
    assert not any("shared_expert" in n for n in shapes) and "layers.1.self_attn.k_norm.weight" in shapes
    tokens = paddle.to_tensor(np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)), dtype="int64")
    loss = model(tokens, tokens)
    loss.backward()
    assert np.isfinite(float(loss)) and float(paddle.abs(model.layers[0].mlp.gate.weight.grad).sum()) > 0


MOE_CONFIG_JSON = {**QWEN3_06B_CONFIG_JSON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "tie_word_embeddings": False, "moe_intermediate_size": 768, "num_experts": 128,
                   "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "router_aux_loss_coef": 0.001}


@pytest.mark.parametrize("change, key", [
    ({"mlp_only_layers": [0, 5]}, "mlp_only_layers [0, 5]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ({"shared_expert_intermediate_size": 4096}, "shared_expert_intermediate_size 4096"),
    ({"attention_bias": True}, "attention_bias true"),
])
def test_moe_switches_it_cannot_compute_are_refused_in_one_line(change, key):
    assert config_from_dict(dict(MOE_CONFIG_JSON), source="c.json").num_experts == 128  # the published file reads
    with pytest.raises(UsageError) as error:
        config_from_dict({**MOE_CONFIG_JSON, **change}, source="Qwen3-30B-A3B/config.json")
    message = str(error.value)
    assert "\n" not in message and key in message and "allowed" in message


# ----------------------------------------------------------------------------- global-batch balancing
def _loss_and_grads(model, tokens):
    model.clear_gradients()
    loss = model(tokens, tokens)
    loss.backward()
    return float(loss), {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def test_global_batch_balancing_is_one_process_over_the_whole_batch(monkeypatch):
    """Two data-parallel ranks with different loads (rank 1's tokens all one id: its router sends them to the
    same few experts) under moe_global_batch_balance: each rank's picks summed with the other's before the loss
    (pl.sum_over_data_replicas, the all-reduce, here given the other rank's picks) -> the mean of the two ranks'
    losses and gradients (fleet's data-parallel mean) is one process's over both batches. Without the switch
    (each rank's own frequencies, the ordinary micro-batch loss) they are not."""
    import models.parallel_layers as pl

    config = ARCHITECTURES["qwen3-moe-tiny"].replace(seq_length=16, router_aux_loss_coef=0.5)
    model = CausalLM(config)
    init_weights(model, config, 0)
    rng = np.random.default_rng(0)
    batches = [paddle.to_tensor(rng.integers(0, config.vocab_size, (2, 16)), dtype="int64"),
               paddle.full([2, 16], 7, dtype="int64")]
    whole = paddle.concat(batches)

    def picks_of(tokens):
        with paddle.no_grad():
            model(tokens, tokens)
        return [layer.mlp.last_stats.picks for layer in model.layers]

    own_picks = [picks_of(b) for b in batches]
    assert np.abs(own_picks[0][0].numpy() - own_picks[1][0].numpy()).max() >= 8  # the loads differ

    def two_ranks(global_balance: bool):
        """Each rank's loss and gradients with the other rank's picks added by the (simulated) all-reduce."""
        ranked = model.__class__(config.replace(moe_global_batch_balance=global_balance))
        ranked.set_state_dict(model.state_dict())
        results = []
        for rank, tokens in enumerate(batches):
            other = iter(own_picks[1 - rank])
            monkeypatch.setattr(pl, "sum_over_data_replicas", lambda picks: (picks + next(other), 2))
            results.append(_loss_and_grads(ranked, tokens))
        loss = (results[0][0] + results[1][0]) / 2
        return loss, {n: (results[0][1][n] + results[1][1][n]) / 2 for n in results[0][1]}

    single_loss, single_grads = _loss_and_grads(model, whole)  # one process, the whole batch (no all-reduce)
    loss, grads = two_ranks(global_balance=True)
    assert abs(loss - single_loss) < 1e-5
    for name, grad in single_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)
    local_loss, local_grads = two_ranks(global_balance=False)
    assert abs(local_loss - single_loss) > 1e-3
    assert np.abs(local_grads["layers.0.mlp.gate.weight"] - single_grads["layers.0.mlp.gate.weight"]).max() > 1e-4


# sep: each rank holds one half of every sequence; cp: chunks i and 2cp-1-i of 4 (models/ring_attention.py)
SEQUENCE_SPLITS = {"sep": ("sep_parallel_degree", [[0, 1], [2, 3]]), "cp": ("context_parallel_degree", [[0, 3], [1, 2]])}


@pytest.mark.parametrize("split", SEQUENCE_SPLITS)
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "ernie4_5_moe-tiny"])
def test_router_statistics_under_sep_and_cp_cover_the_whole_sequence(monkeypatch, preset, split):
    """Qwen3-MoE (with global-batch balancing) and ERNIE 4.5 MoE (its correction bias's load) under sep2 / cp2:
    two ranks, each routing its part of every sequence, sum their router statistics over the sep group
    (pl.sum_over_segments; the all-reduce here given the other rank's) -> on both ranks the picks, the token
    counts, the balancing loss, ERNIE's bias load and the bias moved by it are one process's over the whole
    sequences, and the two ranks' router gradients sum (fleet's sep reduction) to one process's. Each rank's own
    picks are not (the test would not see a skipped sum otherwise). The launches: tests/test_long_context.py."""
    import paddle.distributed as dist

    import models.parallel_layers as pl
    from models.moe import MoE, router_losses

    key, chunks = SEQUENCE_SPLITS[split]
    config = ARCHITECTURES[preset].replace(seq_length=16, moe_global_batch_balance=preset.startswith("qwen3"))
    model = CausalLM(config)
    init_weights(model, config, 0)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 16, config.hidden_size)), dtype="float32")
    parts = [paddle.concat([x[:, 4 * c:4 * c + 4] for c in chunks[rank]], axis=1) for rank in (0, 1)]

    def route(layer_config, hidden):
        """The layer's statistics, balancing loss, router gradient and (ERNIE) bias load after one training forward."""
        moe.config = layer_config
        moe.clear_gradients()
        if hasattr(moe, "step_load"):
            moe.step_load = paddle.zeros_like(moe.step_load)
        moe(hidden)
        stats = moe.last_stats
        balance = router_losses(layer_config, [stats])[0]
        (balance + (stats.seq_balance if stats.seq_balance is not None else 0)).backward()
        return stats, float(balance), moe.gate.weight.grad.numpy().copy(), getattr(moe, "step_load", None)

    whole, whole_balance, whole_grad, whole_load = route(config, x)
    split_config = config.replace(**{key: 2})
    sent = {0: [], 1: []}  # what each rank gives the all-reduces of one forward
    monkeypatch.setattr(pl, "sequence_group", lambda: None)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, r=rank: sent[r].append(t.clone()))
        route(split_config, parts[rank])
    own = route(config, parts[0])[0].picks  # rank 0's own picks (its part routed as one process): not the whole's
    assert np.abs(own.numpy() - whole.picks.numpy()).max() >= 4
    grads = []
    for rank in (0, 1):
        other = iter(sent[1 - rank])
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: paddle.assign(t + next(other), output=t))
        stats, balance, grad, load = route(split_config, parts[rank])
        np.testing.assert_array_equal(stats.picks.numpy(), whole.picks.numpy())
        assert stats.tokens == whole.tokens == 32 and (stats.pick_tokens or stats.tokens) == 32
        assert abs(balance - whole_balance) < 1e-6, (rank, balance, whole_balance)
        if load is not None:  # ERNIE 4.5 MoE: the bias moves by the whole sequences' load, alike on both ranks
            np.testing.assert_array_equal(load.numpy(), whole_load.numpy())
            assert abs(float(stats.seq_balance) - float(whole.seq_balance)) < 1e-6
        grads.append(grad)
    np.testing.assert_allclose(grads[0] + grads[1], whole_grad, rtol=1e-4, atol=1e-7)


def test_global_batch_balancing_bad_input_is_one_line():
    from types import SimpleNamespace

    from llm_pretrain.parallel.layout import Layout, check_mixture_of_experts

    args = SimpleNamespace(expert_parallel_degree=1, moe_global_batch_balance=True)
    with pytest.raises(UsageError, match="^moe_global_batch_balance: true needs a mixture-of-experts model"):
        check_mixture_of_experts(args, ARCHITECTURES["qwen3-tiny"], Layout())
    check_mixture_of_experts(args, ARCHITECTURES["qwen3-moe-tiny"], Layout(data_parallel_degree=2))
    # under the pipeline too (tests/test_expert_parallel.py pp2dp2ep2-qwen3-global)
    check_mixture_of_experts(args, ARCHITECTURES["qwen3-moe-tiny"], Layout(pipeline_parallel_degree=2))


def test_the_pipelines_router_carry_keeps_the_global_batchs_token_count():
    """Under the pipeline a layer's statistics reach the last stage's loss through models/pipeline.py RouterCarry:
    with global-batch balancing the picks are the data replicas' sum, so the tokens they were counted over must
    ride along too (the loss's f_e = picks / pick_tokens; with the rank's own token count f_e doubles on 2 ranks)."""
    import paddle

    from models.moe import RouterStats
    from models.pipeline import RouterCarry

    config = ARCHITECTURES["qwen3-moe-tiny"]
    experts = config.num_experts
    stats = RouterStats(picks=paddle.arange(experts, dtype="float32"), prob_sum=paddle.ones([experts]),
                        z_sum=paddle.zeros([]), dropped=paddle.zeros([], dtype="int64"), tokens=32, pick_tokens=64)
    carry = RouterCarry.start(config)
    for layer in range(config.num_hidden_layers):
        carry = RouterCarry.add(*carry, layer, stats)
    back = RouterCarry.stats(config, *carry)
    assert [(s.tokens, s.pick_tokens) for s in back] == [(32, 64)] * config.num_hidden_layers
    np.testing.assert_array_equal(back[1].picks.numpy(), np.arange(experts))
