"""DeepSeek-V3 (models/families/deepseek_v3.py): published sizes, latent attention, its router and balancing, MTP.

Each piece is checked against a numpy implementation written here from the DeepSeek-V3 report (arXiv
2412.19437) and PaddleFormers 0.4.1's deepseek_v2/modeling.py, on the tiny preset (every switch on).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from llm_pretrain.planner.params import parameter_list
from models.decoder import CausalLM, mtp_labels
from models.errors import UsageError
from models.registry import ARCHITECTURES, config_from_dict, parameter_count
from models.weights import init_weights

TINY = ARCHITECTURES["deepseek-v3-tiny"]

# deepseek-ai/DeepSeek-V3's config.json (the values that make the model; models/families/deepseek_v3.py)
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0,
}


def tiny_model(seed=3, **changes):
    config = TINY.replace(**changes)
    paddle.seed(seed)
    model = CausalLM(config)
    init_weights(model, config, seed)
    with paddle.no_grad():  # norms away from 1 so that each one matters
        rng = np.random.default_rng(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.set_value((1 + 0.1 * rng.standard_normal(p.shape)).astype("float32"))
    return model


# ----------------------------------------------------------------------------- sizes
def test_published_count_without_mtp_is_671b():
    config = ARCHITECTURES["deepseek-ai/DeepSeek-V3"]
    params = parameter_list(config, 1)
    assert sum(p.full_numel for p in params if p.part != "mtp") == 671_026_419_200
    assert parameter_count(config.replace(num_nextn_predict_layers=0)) == 671_026_419_200
    assert sum(p.full_numel for p in params) == parameter_count(config)
    assert ARCHITECTURES["deepseek-ai/DeepSeek-V3-Base"] == config


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v3-real"])
def test_presets_hold_the_counted_parameters(name):
    config = ARCHITECTURES[name]
    with paddle.LazyGuard():
        model = CausalLM(config)
    built = [(n, int(np.prod(p.shape))) for n, p in model.named_parameters()]
    assert built == [(p.name, p.numel) for p in parameter_list(config, 1)]
    assert sum(n for _, n in built) == parameter_count(config)
    if name.endswith("real"):
        assert max(n for _, n in built) > 2 ** 23
    # every switch on
    assert config.uses_mla and config.first_k_dense_replace and config.n_group > config.topk_group > 1
    assert config.num_nextn_predict_layers == 1 and config.rope_scaling["rope_type"] == "yarn"
    assert config.shared_expert_intermediate_size and not config.shared_expert_gate


def test_published_config_json_is_the_built_in_architecture():
    config = config_from_dict(PUBLISHED, "config.json")
    assert config == ARCHITECTURES["deepseek-ai/DeepSeek-V3"]


@pytest.mark.parametrize("change, key", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"max_position_embeddings": 8192}, "rope_scaling.factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
])
def test_switches_it_cannot_compute_are_refused_in_one_line(change, key):
    with pytest.raises(UsageError) as raised:
        config_from_dict({**PUBLISHED, **change}, "config.json")
    message = str(raised.value)
    assert "\n" not in message and key in message


# ----------------------------------------------------------------------------- latent attention
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _yarn_inv_freq(dim, base, s):
    """YaRN's frequencies (Peng et al. 2023) as DeepSeek's inference code computes them."""
    def corr(rot):
        return dim * math.log(s["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(s["beta_fast"])), 0), min(math.ceil(corr(s["beta_slow"])), dim - 1)
    freqs = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    smooth = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return freqs / s["factor"] * (1 - smooth) + freqs * smooth


def _rotate_pairs(x, positions, inv_freq):
    """Rotation of each interleaved pair (x[2j], x[2j+1]) by angle position x inv_freq[j] (in place)."""
    angle = positions[:, None] * inv_freq[None]  # [seq, d/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # broadcast over heads
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def numpy_mla(attn, config, x):
    """The report's eq. 1-11 (one sequence, x [seq, hidden]) with YaRN's softmax scale."""
    w = {n: p.numpy().astype("float64") for n, p in attn.named_parameters()}
    c, heads = config, config.num_attention_heads
    nope, rope, vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    seq = x.shape[0]
    q = (_rms(x @ w["q_a_proj.weight"], w["q_a_layernorm.weight"], c.norm_eps) @ w["q_b_proj.weight"]).reshape(seq, heads, -1)
    ckv = x @ w["kv_a_proj_with_mqa.weight"]
    kv = (_rms(ckv[:, :c.kv_lora_rank], w["kv_a_layernorm.weight"], c.norm_eps) @ w["kv_b_proj.weight"]).reshape(seq, heads, -1)
    inv_freq = _yarn_inv_freq(rope, c.rope_theta, c.rope_scaling)
    positions = np.arange(seq, dtype="float64")
    q_pe = _rotate_pairs(q[..., nope:], positions, inv_freq)
    k_pe = _rotate_pairs(ckv[:, None, c.kv_lora_rank:], positions, inv_freq)
    qh = np.concatenate([q[..., :nope], q_pe], -1)
    kh = np.concatenate([kv[..., :nope], np.repeat(k_pe, heads, axis=1)], -1)
    mscale = 0.1 * c.rope_scaling["mscale_all_dim"] * math.log(c.rope_scaling["factor"]) + 1
    scale = (nope + rope) ** -0.5 * mscale ** 2
    scores = np.einsum("qhd,khd->hqk", qh, kh) * scale + np.triu(np.full((seq, seq), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, kv[..., nope:]).reshape(seq, heads * vd)
    return out @ w["o_proj.weight"]


def test_latent_attention_is_the_reports_with_yarn_mscale():
    model = tiny_model()
    attn = model.layers[0].self_attn
    assert TINY.rope_scaling["factor"] == 4 and TINY.rope_scaling["mscale_all_dim"] == 1.0  # mscale 1.139
    x = np.random.default_rng(0).standard_normal([2, 12, TINY.hidden_size]).astype("float32")
    got = attn(paddle.to_tensor(x)).numpy()
    for b in range(2):
        np.testing.assert_allclose(got[b], numpy_mla(attn, TINY, x[b].astype("float64")), atol=2e-5, rtol=1e-4)


def _loss_logits_grads(model, ids, labels, document_ids):
    model.clear_gradients()
    logits = model(ids, document_ids=document_ids).numpy()
    loss = model(ids, labels, document_ids=document_ids)
    loss.backward()
    return float(loss), logits, {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def kernel_standins():
    from llm_pretrain.cpu import kernel_standins as ks

    ks.install_kernel_standins()
    ks.CALLS.clear()
    yield ks
    ks.uninstall_kernel_standins()


def _packed_ids(packed):
    rng = np.random.default_rng(5)
    ids, labels = (paddle.to_tensor(rng.integers(0, 256, [2, 16])) for _ in range(2))
    documents = np.stack([np.repeat([0, 1, 2], [5, 7, 4]), np.repeat([0, 1], [11, 5])])
    return ids, labels, paddle.to_tensor(documents) if packed else None


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name, grad in got[2].items():
        np.testing.assert_allclose(grad, want[2][name], rtol=1e-5, atol=1e-5, err_msg=name)


QUIET = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ATTENTIONS = TINY.num_hidden_layers + TINY.num_nextn_predict_layers  # the MTP block's too


@pytest.mark.parametrize("packed, granularity", [(False, None), (True, "core_attn")])  # (suite time: 2 of the 4)
def test_flash_attention_gives_the_plain_paths_logits_loss_and_gradients(packed, granularity, kernel_standins):
    """use_flash_attention on the kernels' CPU stand-ins (llm_pretrain/cpu/kernel_standins.py: the GPU kernels'
    signatures and checks, k and v of one shape among them): q pre-scaled by YaRN's softmax scale, v padded to
    nope + rope and the output sliced back (models/mla.py flash_attention) give the plain path's logits, loss
    (main + MTP + router losses) and every gradient within 1e-5; packed documents go to FlashMask as row bounds.
    Every latent attention (2 layers + the MTP block) took the kernel (the mechanism: counted calls), under core_attn
    recompute once more in backward."""
    plain = tiny_model(**QUIET)
    flash = tiny_model(use_flash_attention=True, recompute=granularity is not None,
                       recompute_granularity=granularity or "full", **QUIET)
    flash.set_state_dict(plain.state_dict())
    ids, labels, document_ids = _packed_ids(packed)
    want = _loss_logits_grads(plain, ids, labels, document_ids)
    assert sum(kernel_standins.CALLS.values()) == 0  # the plain path calls no kernel
    got = _loss_logits_grads(flash, ids, labels, document_ids)
    kernel = "flashmask_attention" if packed else "flash_attn"
    # the logits' forward (no MTP without labels), the loss's; the backward's grad kernel once per attention
    calls = {kernel: TINY.num_hidden_layers + ATTENTIONS * (2 if granularity else 1), kernel + "_grad": ATTENTIONS}
    assert dict(kernel_standins.CALLS) == calls
    _assert_same(got, want)


def test_core_attention_recompute_gives_the_same_loss_and_gradients(monkeypatch):
    """recompute_granularity core_attn (models/mla.py: fleet's recompute around the attention, as the decoder's
    Attention): the same logits, loss and gradients with packed documents, and each attention ran once more in
    backward (counted)."""
    from models.mla import LatentAttention

    calls = []
    original = LatentAttention.plain_attention
    monkeypatch.setattr(LatentAttention, "plain_attention", lambda *a: calls.append(1) or original(*a))
    plain = tiny_model(**QUIET)
    recomputed = tiny_model(recompute=True, recompute_granularity="core_attn", **QUIET)
    recomputed.set_state_dict(plain.state_dict())
    ids, labels, document_ids = _packed_ids(True)
    want = _loss_logits_grads(plain, ids, labels, document_ids)
    calls.clear()
    got = _loss_logits_grads(recomputed, ids, labels, document_ids)
    assert len(calls) == TINY.num_hidden_layers + 2 * ATTENTIONS
    _assert_same(got, want)


# ----------------------------------------------------------------------------- router
def numpy_route(scores, bias, config):
    """Group-limited top-k of scores + bias (report eq. 12-16, PaddleFormers' get_topk_indices), weights from the
    scores without the bias."""
    tokens, experts = scores.shape
    choice = scores + bias
    groups = choice.reshape(tokens, config.n_group, -1)
    group_score = np.sort(groups, -1)[..., -2:].sum(-1)
    selected, weights = [], []
    for t in range(tokens):
        keep = np.argsort(-group_score[t], kind="stable")[:config.topk_group]
        masked = np.zeros(experts)
        for g in keep:
            span = slice(g * experts // config.n_group, (g + 1) * experts // config.n_group)
            masked[span] = choice[t, span]
        top = np.argsort(-masked, kind="stable")[:config.num_experts_per_tok]
        w = scores[t, top] / scores[t, top].sum() * config.routed_scaling_factor
        selected.append(top)
        weights.append(w)
    return np.array(selected), np.array(weights)


def test_router_bias_chooses_and_weights_come_from_the_scores():
    model = tiny_model()
    moe = model.layers[1].mlp
    bias = np.array([0.5, -0.5, 0.0, 0.3, -0.2, 0.4, -0.1, 0.2], dtype="float32")
    moe.e_score_correction_bias.set_value(bias)
    x = np.random.default_rng(1).standard_normal([40, TINY.hidden_size]).astype("float32")
    selected, weights, stats = moe.route(paddle.to_tensor(x))
    scores = 1 / (1 + np.exp(-(x.astype("float64") @ moe.gate.weight.numpy())))
    want_sel, want_w = numpy_route(scores, bias, TINY)
    np.testing.assert_array_equal(np.sort(selected.numpy(), -1), np.sort(want_sel, -1))
    order = np.argsort(selected.numpy(), -1), np.argsort(want_sel, -1)
    np.testing.assert_allclose(np.take_along_axis(weights.numpy(), order[0], -1),
                               np.take_along_axis(want_w, order[1], -1), rtol=1e-5)
    # the bias changed the choice somewhere (otherwise this test would not see it used for weights)
    assert (np.sort(numpy_route(scores, 0 * bias, TINY)[0], -1) != np.sort(want_sel, -1)).any()
    # only topk_group groups are used by each token
    groups = selected.numpy() // (TINY.num_experts // TINY.n_group)
    assert max(len(set(row)) for row in groups) <= TINY.topk_group


def test_sequence_wise_balance_loss_is_the_reports_and_enters_the_loss():
    model = tiny_model()
    moe = model.layers[1].mlp
    x = np.random.default_rng(2).standard_normal([2, 10, TINY.hidden_size]).astype("float32")
    moe(paddle.to_tensor(x))
    stats = moe.last_stats
    scores = 1 / (1 + np.exp(-(x.reshape(-1, TINY.hidden_size).astype("float64") @ moe.gate.weight.numpy())))
    picked, _ = numpy_route(scores, 0 * scores[0], TINY)
    E, k, T = TINY.num_experts, TINY.num_experts_per_tok, 10
    losses = []
    for b in range(2):
        f = np.bincount(picked[b * T:(b + 1) * T].ravel(), minlength=E) * E / (k * T)
        s = scores[b * T:(b + 1) * T]
        p = (s / s.sum(-1, keepdims=True)).mean(0)
        losses.append((f * p).sum())
    np.testing.assert_allclose(float(stats.seq_balance), np.mean(losses), rtol=1e-5)
    # its coefficient scales it into the loss
    ids = paddle.to_tensor(np.random.default_rng(3).integers(0, 256, [2, 10]))
    labels = paddle.to_tensor(np.random.default_rng(4).integers(0, 256, [2, 10]))
    with paddle.no_grad():
        on = float(model(ids, labels))
        model.config.seq_aux_loss_coef = 0.0
        off = float(model(ids, labels))
    seq_terms = sum(float(layer.mlp.last_stats.seq_balance) for layer in model.layers[1:]) \
        + float(model.mtp.block.mlp.last_stats.seq_balance)
    np.testing.assert_allclose(on - off, TINY.seq_aux_loss_coef * seq_terms, rtol=1e-3)


# ----------------------------------------------------------------------------- auxiliary-loss-free balancing
def test_bias_moves_by_rate_times_sign_of_mean_minus_load_and_only_when_on():
    model = tiny_model(moe_bias_update_rate=0.01)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(5).integers(0, 256, [2, 16]))
    model(ids, ids)
    model(ids, ids)  # two micro-batches: the load of the step is their sum
    layer = model.layers[1].mlp
    load = layer.step_load.numpy()
    assert load.sum() == 2 * 2 * 16 * TINY.num_experts_per_tok and len(set(load)) > 1
    before = layer.e_score_correction_bias.numpy().copy()
    model.update_router_biases()
    np.testing.assert_allclose(layer.e_score_correction_bias.numpy(), before + 0.01 * np.sign(load.mean() - load))
    assert not layer.step_load.numpy().any()  # counted again from the next step
    # carried by checkpoints: a parameter that takes no gradient
    names = dict(model.named_parameters())
    assert names["layers.1.mlp.e_score_correction_bias"].stop_gradient
    off = tiny_model(moe_bias_update_rate=0.0)
    off.train()
    off(ids, ids)
    off.update_router_biases()
    assert not off.layers[1].mlp.e_score_correction_bias.numpy().any()


def test_bias_update_counts_the_load_of_every_data_replica(monkeypatch):
    """Two data-parallel ranks, each forwarding its half of the step's batch (rank 1's tokens all one id, so the
    loads differ): the load summed over the replicas before the update (pl.sum_over_data_replicas, the all-reduce,
    here given the other rank's load) -> every rank's bias is the one process's over the whole batch. Launched for
    real in tests/test_parallel_parity.py test_dp2 (deepseek-v3-short-dp2)."""
    import models.parallel_layers as pl

    rng = np.random.default_rng(8)
    halves = [paddle.to_tensor(rng.integers(0, 256, [2, 16])), paddle.full([2, 16], 7, dtype="int64")]
    single = tiny_model(moe_bias_update_rate=0.01)
    single.train()
    for ids in halves:  # one process: both halves are micro-batches of its step
        single(ids, ids)
    single.update_router_biases()
    loads, ranks = [], [tiny_model(moe_bias_update_rate=0.01) for _ in halves]
    for model, ids in zip(ranks, halves):
        model.train()
        model(ids, ids)
        loads.append([layer.step_load for layer in (model.layers[1].mlp, model.mtp.block.mlp)])
    own = [np.sign(load[0].numpy().mean() - load[0].numpy()) * 0.01 for load in loads]  # each rank's own step
    for rank, model in enumerate(ranks):
        other = iter(loads[1 - rank])
        monkeypatch.setattr(pl, "sum_over_data_replicas", lambda load: (load + next(other), 2))
        model.update_router_biases()
    for name in ("layers.1.mlp.e_score_correction_bias", "mtp.block.mlp.e_score_correction_bias"):
        expected = dict(single.named_parameters())[name].numpy()
        assert np.abs(expected).max() > 0
        for model in ranks:
            np.testing.assert_array_equal(dict(model.named_parameters())[name].numpy(), expected, err_msg=name)
    # a rank counting its own half alone would have moved the main layer's bias otherwise
    main = dict(single.named_parameters())["layers.1.mlp.e_score_correction_bias"].numpy()
    assert any((bias != main).any() for bias in own), (own, main)


# ----------------------------------------------------------------------------- multi-token prediction
def test_mtp_predicts_the_token_after_next_with_shared_embedding_and_head():
    model = tiny_model()
    model.eval()
    rng = np.random.default_rng(6)
    ids = paddle.to_tensor(rng.integers(0, 256, [2, 12]))
    labels = paddle.to_tensor(rng.integers(0, 256, [2, 12]))
    with paddle.no_grad():
        total = float(model(ids, labels))
        hidden = model.embeddings(ids)
        for layer in model.layers:
            hidden = layer(hidden)
        logits = model.lm_head(model.norm(hidden))
        # by hand: [enorm(Emb(labels)); hnorm(h)] -> eh_proj -> block -> own norm -> the shared head
        emb = model.embeddings.word_embeddings(labels)
        mtp = model.mtp
        h2 = mtp.norm(mtp.block(mtp.eh_proj(paddle.concat([mtp.enorm(emb), mtp.hnorm(hidden)], axis=-1))))
        mtp_logits = paddle.matmul(h2, model.lm_head.weight)

    def ce(lg, lb):
        lg, lb = lg.numpy().astype("float64"), lb.numpy()
        keep = lb != -100
        logp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        return -np.take_along_axis(logp, np.where(keep, lb, 0)[..., None], -1)[..., 0][keep].mean()

    main, extra = ce(logits, labels), ce(mtp_logits, mtp_labels(labels))
    assert mtp_labels(labels).numpy()[0, 0] == labels.numpy()[0, 1] and (mtp_labels(labels).numpy()[:, -1] == -100).all()
    router = total - main - TINY.mtp_loss_weight * extra
    assert 0 <= router < 0.01  # only the (small) sequence-wise balance terms remain
    with paddle.no_grad():
        model.config.seq_aux_loss_coef = 0.0
        np.testing.assert_allclose(float(model(ids, labels)), main + TINY.mtp_loss_weight * extra, rtol=1e-5)


def test_pipeline_stages_chained_give_the_one_process_loss_and_gradients_with_mtp_on_the_last_stage():
    """models/pipeline.py's layers chained in one process as fleet's stages run them (each gets what the one before
    returned, the tuple sent between stages): the first embeds the labels too and [hidden; next embeddings] ride
    through the decoder layers to PipelineMTP after the last one, the head gives both logits, the loss adds the
    MTP loss and every router's losses (the MTP block's row in the carry). Loss and gradients (the embedding's from
    the MTP module, the MTP block's router's) are one process's."""
    from models.moe import RouterMetrics
    from models.pipeline import CausalLMLoss, FinalNorm, MoEDecoderLayer, PipelineEmbeddings, PipelineLMHead, PipelineMTP

    model = tiny_model()
    config = model.config
    rng = np.random.default_rng(8)
    ids = paddle.to_tensor(rng.integers(0, 256, [2, 12]))
    labels = paddle.to_tensor(rng.integers(0, 256, [2, 12]))
    expected = model(ids, labels)
    expected.backward()
    layers = ([PipelineEmbeddings(config)] + [MoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
              + [PipelineMTP(config), FinalNorm(config), PipelineLMHead(config)])
    prefixes = ["embeddings."] + [f"layers.{i}." for i in range(config.num_hidden_layers)] + ["mtp.", "", "lm_head."]
    state = model.state_dict()
    for layer, prefix in zip(layers, prefixes):
        layer.set_state_dict({key: state[prefix + key] for key in layer.state_dict()})
    carried = (ids, labels)
    for layer in layers:
        carried = layer(carried)
    loss = CausalLMLoss(config, RouterMetrics(config))(carried, labels)
    loss.backward()
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
    mine = {prefix + name: p for layer, prefix in zip(layers, prefixes) for name, p in layer.named_parameters()}
    for name in ("embeddings.word_embeddings.weight", "mtp.eh_proj.weight", "mtp.block.mlp.gate.weight",
                 "layers.1.mlp.gate.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        want = dict(model.named_parameters())[name].grad.numpy()
        assert np.abs(want).max() > 0, name
        np.testing.assert_allclose(mine[name].grad.numpy(), want, rtol=1e-4, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------- layouts, arguments, training
def _arguments(corpus, tmp_path, **overrides):
    from llm_pretrain.arguments import parse_arguments
    from parity_utils import base_arguments
    from llm_pretrain.selfcheck.parity import write_json

    data = base_arguments(corpus, tmp_path, **{"model_name_or_path": "deepseek-v3-tiny", "num_hidden_layers": 2,
                                               "output_dir": str(tmp_path / "out"), **overrides})
    args, _ = parse_arguments([str(write_json(tmp_path / "args.json", data))])
    return args


@pytest.mark.parametrize("key", ["sep_parallel_degree", "context_parallel_degree"])
def test_segment_and_context_parallelism_are_accepted(key, embedded_corpus, tmp_path):
    """sep2 and cp2 are proven: tests/test_long_context.py test_sep2_every_family_and_resume trains deepseek-sep2 and
    deepseek-cp2."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    layout, _, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, **{key: 2}), 2, "cpu")
    assert getattr(layout, key) == 2 and layout.data_parallel_degree == 1


@pytest.mark.parametrize("split", ["sep_parallel_degree", "context_parallel_degree"])
def test_sep_or_cp_with_tp_documents_or_sharding_are_accepted_and_the_rest_refused_in_one_line(split, embedded_corpus,
                                                                                                tmp_path):
    """Proven (tests/test_long_context.py DEEPSEEK_PAIRS, DEEPSEEK_SHARDING): sep2 / cp2 x tp2 + SP with packed
    documents (deepseek-docs-sep2tp2-sp, -cp2tp2-sp) and sep2 / cp2 x sharding 2 at stage 2 (deepseek-sep2sd2-stage2,
    -cp2sd2-stage2). Refused in one line: sep / cp with sharding's other stages (not trained for DeepSeek-V3) or with
    dp."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    accepted = [({"tensor_parallel_degree": 2, "sequence_parallel": True}, 4),
                ({"tensor_parallel_degree": 2, "sequence_parallel": True, "reset_attention_mask": True}, 4),
                ({"reset_attention_mask": True}, 2), ({"sharding_parallel_degree": 2, "sharding": "stage2"}, 4)]
    for overrides, world in accepted:
        layout, _, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, **{split: 2}, **overrides),
                                                 world, "cpu")
        assert getattr(layout, split) == 2 and layout.data_parallel_degree == 1, overrides
    refused = [({"sharding_parallel_degree": 2, "sharding": f"stage{stage}"}, 4,
                f"sharding: stage{stage} is not proven for deepseek_v3 yet (no test trains it against one process); "
                "allowed: stage2") for stage in (1, 3)]
    refused += [({}, 4, f"data_parallel_degree 2 with {split} 2 together is not proven for deepseek_v3")]
    for overrides, world, start in refused:
        with pytest.raises(UsageError) as raised:
            check_layout_and_model(_arguments(embedded_corpus, tmp_path, **{split: 2}, **overrides), world, "cpu")
        message = str(raised.value)
        assert "\n" not in message and message.startswith(start), message


def test_data_parallelism_is_accepted(embedded_corpus, tmp_path):
    """dp2 (the world size alone) is proven: tests/test_parallel_parity.py test_dp2 trains deepseek-v3-short."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    layout, config, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, moe_bias_update_rate=0.01),
                                                  2, "cpu")
    assert layout.data_parallel_degree == 2 and config.moe_bias_update_rate == 0.01


def test_tensor_and_pipeline_parallelism_and_sharding_stages_alone_are_accepted(embedded_corpus, tmp_path):
    """tp2, tp2 + SP, pp2 (1F1B) and sharding stages 1-3 are proven: tests/test_parallel_parity.py test_tensor_parallel,
    test_pipeline_parallel and test_sharding_stages train deepseek-v3-short."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    for sp in (False, True):
        args = _arguments(embedded_corpus, tmp_path, tensor_parallel_degree=2, sequence_parallel=sp)
        layout, config, _, _ = check_layout_and_model(args, 2, "cpu")
        assert layout.tensor_parallel_degree == 2 and config.sequence_parallel == sp
    layout, _, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, pipeline_parallel_degree=2), 2, "cpu")
    assert layout.pipeline_parallel_degree == 2
    for stage in (1, 2, 3):
        layout, _, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, sharding=f"stage{stage}"), 2, "cpu")
        assert layout.sharding_degree == 2 and layout.sharding_stage == stage


def test_expert_parallelism_over_data_parallel_ranks_is_accepted(embedded_corpus, tmp_path):
    """ep2 over dp2 is proven: tests/test_expert_parallel.py trains deepseek-v3-tiny so, with the bias rule on."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    layout, config, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, expert_parallel_degree=2,
                                                             moe_bias_update_rate=0.01), 2, "cpu")
    assert layout.data_parallel_degree == 2 and config.expert_parallel_degree == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallelism_over_sharding_ranks_is_accepted(stage, embedded_corpus, tmp_path):
    """ep2 over sd2 (stages 1 and 2) is proven: tests/test_expert_parallel.py deepseek-ep2sd2s1/s2."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    layout, config, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, expert_parallel_degree=2,
                                                             sharding=f"stage{stage}", moe_bias_update_rate=0.01),
                                                  2, "cpu")
    assert (layout.data_parallel_degree, layout.sharding_degree, layout.sharding_stage) == (1, 2, stage)
    assert config.expert_parallel_degree == 2


def test_pipeline_with_expert_parallelism_over_data_parallel_ranks_is_accepted(embedded_corpus, tmp_path):
    """pp2 x dp2 with ep2 over dp (PaddleFormers trains DeepSeek-V3 in PP x EP) is proven: tests/test_expert_parallel.py
    pp2dp2ep2-deepseek; the planner (llm-plan's validated_setup) takes it too."""
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.planner.estimate import validated_setup

    args = _arguments(embedded_corpus, tmp_path, pipeline_parallel_degree=2, expert_parallel_degree=2,
                      gradient_accumulation_steps=2, moe_bias_update_rate=0.01)
    layout, config, _, _ = check_layout_and_model(args, 4, "cpu")
    assert (layout.pipeline_parallel_degree, layout.data_parallel_degree, config.expert_parallel_degree) == (2, 2, 2)
    _, planned, _ = validated_setup(args, 4, "cpu")
    assert planned == layout


def test_pipeline_with_expert_parallelism_over_sharding_ranks_is_accepted(embedded_corpus, tmp_path):
    """pp2 x sharding stage 1 with ep2 over the sharding ranks (PaddleFormers' PP x EP x sharding), with full recompute
    under the pipeline (the MTP block's segment among them), is proven: tests/test_expert_parallel.py
    pp2sd2ep2-deepseek; the planner takes it too."""
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.planner.estimate import validated_setup

    args = _arguments(embedded_corpus, tmp_path, pipeline_parallel_degree=2, expert_parallel_degree=2, sharding="stage1",
                      gradient_accumulation_steps=2, moe_bias_update_rate=0.01, recompute=True)
    layout, config, _, _ = check_layout_and_model(args, 4, "cpu")
    assert (layout.pipeline_parallel_degree, layout.sharding_degree, layout.sharding_stage,
            layout.data_parallel_degree, config.expert_parallel_degree) == (2, 2, 1, 1, 2)
    assert config.recompute and config.recompute_granularity == "full"
    _, planned, _ = validated_setup(args, 4, "cpu")
    assert planned == layout


@pytest.mark.parametrize("overrides", [
    {"virtual_pp_degree": 2, "num_hidden_layers": 6}, {"pipeline_layers_per_stage": [1, 3, 2], "num_hidden_layers": 6}])
def test_interleaved_and_uneven_pipeline_stages_are_accepted(overrides, embedded_corpus, tmp_path):
    """pp3 x 2 virtual stages and uneven 1F1B stages, the MTP block in the last chunk, are proven:
    tests/test_uneven_pipeline.py deepseek-pp3vpp2 and deepseek-pp3-1-3-2; the planner takes them too."""
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.planner.estimate import validated_setup

    args = _arguments(embedded_corpus, tmp_path, pipeline_parallel_degree=3, gradient_accumulation_steps=3,
                      moe_bias_update_rate=0.01, **overrides)
    layout, _, _, _ = check_layout_and_model(args, 3, "cpu")
    assert (layout.pipeline_parallel_degree, layout.virtual_pp_degree) == (3, overrides.get("virtual_pp_degree", 1))
    _, planned, _ = validated_setup(args, 3, "cpu")
    assert planned == layout


@pytest.mark.parametrize("overrides, world, message", [
    ({"tensor_parallel_degree": 2}, 4, "tensor_parallel_degree 2 with data_parallel_degree 2 together is not proven"),
    # the pipeline with data parallelism or sharding is proven only with the experts split over those ranks (ep2;
    # sharding stage 1), and not with tensor parallelism
    ({"pipeline_parallel_degree": 2}, 4,
     "pipeline_parallel_degree 2 with data_parallel_degree 2 together is not proven"),
    ({"pipeline_parallel_degree": 2, "expert_parallel_degree": 2, "tensor_parallel_degree": 2}, 8,
     "tensor_parallel_degree 2 with pipeline_parallel_degree 2 with data_parallel_degree 2 together is not proven"),
    ({"pipeline_parallel_degree": 2, "sharding": "stage1"}, 4,
     "pipeline_parallel_degree 2 with sharding_parallel_degree 2 together is not proven"),
    ({"pipeline_parallel_degree": 2, "expert_parallel_degree": 2, "sharding": "stage2"}, 4,
     "sharding: stage2 is not proven for deepseek_v3"),
    ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}, 4,
     "tensor_parallel_degree 2 with pipeline_parallel_degree 2 together is not proven"),
    # virtual stages and uneven ones are proven with the pipeline alone (tests/test_uneven_pipeline.py deepseek-pp3vpp2,
    # deepseek-pp3-1-3-2), not beside ep over dp, and not both together
    ({"pipeline_parallel_degree": 3, "virtual_pp_degree": 2, "num_hidden_layers": 6, "expert_parallel_degree": 2,
      "gradient_accumulation_steps": 3}, 6, "virtual_pp_degree: 2 is not proven for deepseek_v3 in this layout"),
    ({"pipeline_parallel_degree": 2, "pipeline_layers_per_stage": [1, 3], "num_hidden_layers": 4,
      "expert_parallel_degree": 2, "gradient_accumulation_steps": 2}, 4,
     "pipeline_layers_per_stage: [1, 3] gives uneven stages [1, 3], which with data_parallel_degree 2 are not supported"),
    ({"pipeline_parallel_degree": 3, "virtual_pp_degree": 2, "pipeline_layers_per_stage": [1, 1, 1, 1, 1, 2],
      "num_hidden_layers": 7, "gradient_accumulation_steps": 3}, 3, "which with virtual_pp_degree 2 are not supported"),
    ({"sharding": "stage1", "sharding_parallel_degree": 2}, 4,
     "sharding_parallel_degree 2 with data_parallel_degree 2 together is not proven"),
    ({"sharding": "stage3", "pipeline_parallel_degree": 2}, 4,
     "pipeline_parallel_degree 2 with sharding_parallel_degree 2 together is not proven")])
def test_combined_degrees_other_sharding_stages_and_pipeline_schedules_are_refused_in_one_line(overrides, world, message,
                                                                               embedded_corpus, tmp_path):
    from llm_pretrain.parallel.layout import check_layout_and_model

    with pytest.raises(UsageError) as raised:
        check_layout_and_model(_arguments(embedded_corpus, tmp_path, **overrides), world, "cpu")
    assert "\n" not in str(raised.value) and message in str(raised.value) and "deepseek_v3" in str(raised.value)


def test_flash_attention_and_core_attn_recompute_are_accepted_and_flash_refused_under_cp(embedded_corpus, tmp_path,
                                                                                         monkeypatch):
    """Where the flash branch runs (here: the kernels' stand-ins switched on), flash attention alone, under the pipeline,
    with core_attn recompute and core_attn recompute without flash are accepted; flash or core_attn recompute under cp
    refused in one line (the ring over latent attention: plain blocks, not recomputed)."""
    from llm_pretrain.parallel.layout import check_layout_and_model

    monkeypatch.setenv("LLM_PRETRAIN_KERNEL_STANDINS", "1")
    core_attn = {"recompute": True, "recompute_granularity": "core_attn"}
    for accepted, n in (({"use_flash_attention": True}, 1), ({"use_flash_attention": True, **core_attn}, 1),
                        ({"use_flash_attention": True, "pipeline_parallel_degree": 2}, 2),
                        ({"use_flash_attention": False, "pipeline_parallel_degree": 2, **core_attn}, 2)):
        _, config, _, _ = check_layout_and_model(_arguments(embedded_corpus, tmp_path, **accepted), n, "cpu")
        assert config.use_flash_attention == accepted["use_flash_attention"]
    with pytest.raises(UsageError) as raised:
        check_layout_and_model(_arguments(embedded_corpus, tmp_path, use_flash_attention=True, context_parallel_degree=2),
                               2, "cpu")
    message = "use_flash_attention: true with context_parallel_degree 2 is not supported for deepseek_v3"
    assert "\n" not in str(raised.value) and message in str(raised.value)
    with pytest.raises(UsageError) as raised:
        check_layout_and_model(_arguments(embedded_corpus, tmp_path, context_parallel_degree=2, **core_attn), 2, "cpu")
    message = "recompute_granularity: core_attn with context_parallel_degree 2 is not supported for deepseek_v3"
    assert "\n" not in str(raised.value) and message in str(raised.value)


def test_bias_rate_needs_a_router_bias(embedded_corpus, tmp_path):
    from llm_pretrain.parallel.layout import check_layout_and_model

    args = _arguments(embedded_corpus, tmp_path, model_name_or_path="qwen3-moe-tiny", moe_bias_update_rate=0.001)
    with pytest.raises(UsageError, match="moe_bias_update_rate: 0.001 needs a router with a correction bias"):
        check_layout_and_model(args, 1, "cpu")


def test_tiny_preset_trains_with_the_bias_rule_and_mtp_logged(embedded_corpus, tmp_path):
    """run_pretrain in this process: the loss goes down, mtp_loss is logged, the biases moved and the checkpoint
    carries them."""
    from llm_pretrain.run_pretrain import run as train
    from parity_utils import train_records
    from llm_pretrain.selfcheck.parity import final_weights

    args = _arguments(embedded_corpus, tmp_path, max_steps=12, save_steps=12, gradient_accumulation_steps=1,
                      per_device_train_batch_size=4, logging_steps=1, learning_rate=0.01, moe_bias_update_rate=0.001)
    train(args, [])
    records = train_records(tmp_path / "out")
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    assert all(r["mtp_loss"] > 0 for r in records)
    bias = final_weights(tmp_path / "out", step=12)["layers.1.mlp.e_score_correction_bias"]
    # whole steps of 0.001, at most one per optimizer step (neither the optimizer nor weight decay touched it)
    assert 0 < np.abs(bias).max() <= 0.012 + 1e-6 and np.allclose(bias * 1000, np.round(bias * 1000), atol=1e-3)
    # the run record's FLOPs per token (its TFLOPs and MFU) are the hand count of latent attention, MTP and experts
    import json

    run = json.loads((tmp_path / "out" / "train_log.jsonl").read_text().splitlines()[0])
    assert run["event"] == "run"
    assert run["flops_per_token"] == _hand_counted_flops(config_from_dict(run["model_config"], "run record"),
                                                        run["seq_length"])


def _hand_counted_flops(c, seq: int) -> int:
    """Model FLOPs per trained token written from the weights' shapes (models/mla.py, models/decoder.py MTPLayer),
    apart from llm_pretrain/observe/flops.py: 6 x the weights of the matrix products a token passes (2 per
    multiply-add, x 3 for forward and backward) + 3 x the attention products over the whole sequence: q.k over
    nope + rope per head, p.v over v_head_dim. The MTP block: eh_proj [2h, h], one MoE layer, the shared head."""
    h, a = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attention = (h * c.q_lora_rank + c.q_lora_rank * a * qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
                 + c.kv_lora_rank * a * (c.qk_nope_head_dim + c.v_head_dim) + a * c.v_head_dim * h)
    moe = 3 * h * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    dense = 3 * h * c.intermediate_size
    core = 2 * seq * a * qk + 2 * seq * a * c.v_head_dim
    k = c.first_k_dense_replace
    main = k * (attention + dense) + (c.num_hidden_layers - k) * (attention + moe) + h * c.vocab_size
    mtp = 2 * h * h + attention + moe + h * c.vocab_size
    return 6 * (main + mtp) + 3 * (c.num_hidden_layers + 1) * core


def test_model_flops_count_latent_attention_mtp_and_the_activated_experts():
    """Issue 35 item 5: DeepSeek-V3's model FLOPs per token at 4,096 tokens (MFU's, llm_pretrain/observe/flops.py) are
    6 x its activated weights + 3 x attention over 192 (q.k) and 128 (p.v) per head + the MTP block. The activated
    weights come from the published total: 671,026,419,200 less the embedding, the norms, the routers and their
    biases, and the 248 experts of 256 a token does not reach in the 58 MoE layers; with the embedding that is the
    model card's "37B activated". The hand count of the shapes agrees, and so does the count of the hardware FLOPs
    with core-attention recompute (the 61 layers and the MTP block's)."""
    from llm_pretrain.observe.flops import model_flops_per_token, training_flops_per_token

    c = ARCHITECTURES["deepseek-ai/DeepSeek-V3"]
    h, vocab, seq, moe_layers = 7168, 129280, 4096, 61 - 3
    norms = 61 * (2 * h + 1536 + 512) + h  # input/post-attention, q_a and kv_a norms per layer; the final norm
    activated = (671_026_419_200 - vocab * h - norms - moe_layers * 256 * (h + 1)  # routers and their biases
                 - moe_layers * (256 - 8) * 3 * h * 2048)
    assert 37.0e9 < activated + vocab * h < 37.5e9
    core = 2 * seq * 128 * (128 + 64) + 2 * seq * 128 * 128  # not 4 x seq x 128 x 56 (hidden / heads)
    attention = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * h
    mtp = 6 * (2 * h * h + attention + 3 * h * 9 * 2048 + h * vocab) + 3 * core
    expected = 6 * activated + 3 * 61 * core + mtp
    assert model_flops_per_token(c, seq) == expected == _hand_counted_flops(c, seq) == 291_197_681_664
    assert training_flops_per_token(c, seq, "core_attn") == expected + (61 + 1) * core
    for name in ("deepseek-v3-tiny", "deepseek-v3-real"):  # a dense layer narrower than the activated experts
        config = ARCHITECTURES[name]
        assert model_flops_per_token(config, 256) == _hand_counted_flops(config, 256)


def test_planner_all_to_all_counts_the_moe_layers_and_the_rows_of_group_limited_routing():
    """Issue 35 item 5: the expert-parallel all-to-all of DeepSeek-V3 in the planner (llm_pretrain/planner/speed.py)
    runs in the MoE layers only (the 3 dense ones send nothing) and in the MTP block, which is on the last pipeline
    stage: 4 per layer and micro-batch, each k = 8 rows of h per token of which (ep - 1)/ep leave the rank, over
    InfiniBand when the 16 expert ranks span two nodes. Group-limited routing (4 of 8 groups) bounds where a token's
    rows go (at most 4 x 2 = 8 of the 16 ranks), not their number: this dispatch sends one row per pick
    (models/moe.py dispatch_and_combine), so the term is the same with one group."""
    from llm_pretrain.planner.memory import Precision, Setup
    from llm_pretrain.planner.speed import Cluster, moe_layers_on_stage, step_time

    config = ARCHITECTURES["deepseek-ai/DeepSeek-V3"].replace(seq_length=4096, expert_parallel_degree=16)
    precision = Precision(compute="bf16", level="O2", master_grad=True)
    staged = Setup(config, 1, 8, pp=4, dp=16, precision=precision)
    assert [sum(map(len, staged.stage_chunks(stage))) for stage in range(4)] == [15, 16, 16, 14]
    assert [moe_layers_on_stage(staged, stage) for stage in range(4)] == [12, 16, 16, 15]
    cluster = Cluster("H800-80G")
    terms = step_time(Setup(config, 1, 8, dp=16, precision=precision), cluster)["terms"]
    inter = cluster.links()[1]
    expected = 8 * (58 + 1) * 4 * (4096 * 8 * 7168 * 2 * 15 / 16) / (inter * 1e9)  # 58 MoE layers + MTP, not 61
    assert terms["expert-parallel all-to-all"] == pytest.approx(expected, rel=1e-12)
    ungrouped = config.replace(n_group=1, topk_group=1)
    assert step_time(Setup(ungrouped, 1, 8, dp=16, precision=precision), cluster)["terms"][
        "expert-parallel all-to-all"] == terms["expert-parallel all-to-all"]


def test_the_smallest_h800_cluster_at_4k_is_the_argument_files_256_in_pp16_sd16():
    """Issue 35 item 5, the claim of docs/parallel-layouts.md and the README: over the layouts the trainer accepts for
    DeepSeek-V3 that could fit (pp x sharding stage 1 with ep = the sharding degree, micro-batch 1, full recompute,
    global batch 512, flash attention for MLA), no count of H800-80G from 200 up to 255 fits at 4,096 tokens, whole
    nodes or not, and 256 in pp16 x sd16 x ep16 does: the layout of
    configs/deepseek_v3/pretrain-deepseek_v3_h800x256-pp16sd16_stage1.json. PaddleFormers' own layout for 256,
    pp8 x sd32 x ep32, misses by less than 1 GB here (PaddleFormers also offloads its optimizer states); on the plain
    attention path it misses by more than the 16 GB of attention transients. The planner's own checks and estimate."""
    import json
    from pathlib import Path

    from llm_pretrain.arguments import Arguments, validate_arguments
    from llm_pretrain.errors import UsageError as RunUsageError
    from llm_pretrain.planner import device_memory_mb, estimate_setup
    from llm_pretrain.planner.estimate import validated_setup
    from llm_pretrain.planner.search import _MemoSetup, base_arguments

    device, global_batch = "H800-80G", 512
    limit = device_memory_mb(device) * 0.9
    base = dict(base_arguments("deepseek-ai/DeepSeek-V3", 4096, device), use_flash_attention=True)
    memo = {}

    def reserved_mb(gpus, pp, sd, **overrides):
        values = dict(base, pipeline_parallel_degree=pp, sharding="stage1", sharding_parallel_degree=sd,
                      expert_parallel_degree=sd, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                      gradient_accumulation_steps=global_batch // sd, recompute=True, recompute_granularity="full",
                      **overrides)
        args = Arguments(**values)
        validate_arguments(args)
        setup, _, _ = validated_setup(args, gpus, device)
        return estimate_setup(_MemoSetup.of(setup, memo), device, {"gpus_per_node": 8})["peak_mem_reserved_mb"]

    peak = {}
    for gpus, pp, sd in sorted((pp * sd, pp, sd) for pp in range(2, 62) for sd in (2, 4, 8, 16, 32, 64, 128, 256)
                               if 200 <= pp * sd <= 256):
        try:
            peak[gpus, pp, sd] = reserved_mb(gpus, pp, sd)
        except RunUsageError:  # e.g. more stages than fleet's uniform split fills
            continue
    assert [layout for layout, mb in peak.items() if mb <= limit] == [(256, 16, 16)], peak
    assert limit < peak[256, 8, 32] < limit + 1_000, peak[256, 8, 32]  # PaddleFormers' layout
    plain = reserved_mb(256, 8, 32, use_flash_attention=False)
    assert plain > peak[256, 8, 32] + 16_000, plain
    file = Path(__file__).parent.parent / "configs" / "deepseek_v3" / "pretrain-deepseek_v3_h800x256-pp16sd16_stage1.json"
    values = json.loads(file.read_text())
    assert (values["pipeline_parallel_degree"], values["sharding_parallel_degree"], values["expert_parallel_degree"],
            values["sharding"], values["use_flash_attention"], values["per_device_train_batch_size"]
            * values["gradient_accumulation_steps"] * values["sharding_parallel_degree"]) == (
        16, 16, 16, "stage1", True, global_batch)
