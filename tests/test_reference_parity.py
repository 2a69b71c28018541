"""Reference parity: our one decoder against PaddleNLP 2.8's own model classes.

For each family a tiny PaddleNLP model (fp32, CPU, dropout 0) gets random weights --
every parameter, norms and biases included, large enough that attention is far from
uniform -- which are converted to our names by models/paddlenlp_interop.py and loaded
into our CausalLM. Logits and loss must agree within 1e-5 on the same input ids and
(unshifted) labels, some of them -100.

Loss conventions: PaddleNLP's LLaMA/Qwen/Bloom criteria, like ours, take labels aligned
with the logits (no shift inside the model) and skip -100; PaddleNLP's GPT skips its
config.ignore_index, 0 by default, so the GPT cases set ignore_index=-100.

PaddleNLP 2.8.1 has no class with Baichuan2's NormHead (its Baichuan checkpoints run as
LlamaForCausalLM, without head normalization), so `norm_head` is checked against
PaddleNLP's LLaMA(alibi) body with a head we L2-normalize in numpy.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from models.config import make_config
from models.decoder import CausalLM
from models.paddlenlp_interop import from_paddlenlp_state
from models.weights import init_weights, load_full_weights

paddlenlp_transformers = pytest.importorskip("paddlenlp.transformers")

TOLERANCE = 1e-5
BATCH, SEQ, VOCAB = 2, 16, 256


def _llama_sizes(hidden=64, heads=4, kv_heads=2):
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)


def _our_sizes(hidden=64, heads=4, kv_heads=None, inner=176):
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)


# name -> (PaddleNLP class name, its config class name, its config kwargs, our ModelConfig)
CASES = {
    "llama_gqa": ("LlamaForCausalLM", "LlamaConfig", dict(**_llama_sizes(), rms_norm_eps=1e-6),
                  make_config("llama", **_our_sizes(kv_heads=2), norm_eps=1e-6)),
    # PaddleNLP's fused layouts (qkv per kv-head group, gate|up) into our fused ones (q|k|v, gate|up)
    "llama_fused": ("LlamaForCausalLM", "LlamaConfig",
                    dict(**_llama_sizes(), rms_norm_eps=1e-5, fuse_attention_qkv=True, fuse_attention_ffn=True),
                    make_config("llama", **_our_sizes(kv_heads=2), norm_eps=1e-5, fuse_attention_qkv=True,
                                fuse_attention_ffn=True)),
    # Baichuan-13B: PaddleNLP's LLaMA with alibi=True; 6 heads exercise the non-power-of-2 slopes (13B has 40)
    "baichuan13b_alibi": ("LlamaForCausalLM", "LlamaConfig", dict(**_llama_sizes(96, 6, 6), alibi=True),
                          make_config("baichuan", **_our_sizes(96, 6), position_embedding="alibi")),
    "qwen": ("QWenForCausalLM", "QWenConfig",
             dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=2 * 176, num_hidden_layers=2,
                  num_attention_heads=4, kv_channels=16, max_position_embeddings=64, seq_length=64,
                  layer_norm_epsilon=1e-6),
             make_config("qwen", **_our_sizes())),
    "gpt3": ("GPTForCausalLM", "GPTConfig",
             dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  ignore_index=-100),
             make_config("gpt3", **_our_sizes(inner=256))),
    "gpt3_fused_qkv": ("GPTForCausalLM", "GPTConfig",
                       dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, ignore_index=-100, fuse_attention_qkv=True),
                       make_config("gpt3", **_our_sizes(inner=256), fuse_attention_qkv=True)),
    "bloom": ("BloomForCausalLM", "BloomConfig",
              dict(vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6, layer_norm_epsilon=1e-5),
              # Bloom's config has no max_position_embeddings (ALiBi); read as its training length 2048
              make_config("bloom", **{**_our_sizes(96, 6, inner=384), "max_position_embeddings": 2048})),
}


def build_paddlenlp_model(case: str, seed: int = 0):
    """(PaddleNLP model in eval mode with random weights, its config as a dict, our ModelConfig)."""
    class_name, config_name, kwargs, ours = CASES[case]
    config = getattr(paddlenlp_transformers, config_name)(**kwargs)
    paddle.seed(seed)
    model = getattr(paddlenlp_transformers, class_name)(config)
    randomize(model, seed)
    model.eval()
    return model, config.to_dict(), ours


def randomize(model, seed: int) -> None:
    """Every parameter random: matrices ~ N(0, 1/fan_in) so that attention is peaked, embeddings
    ~ N(0, 0.25), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, param in model.named_parameters():
            shape = list(param.shape)
            if len(shape) == 1:
                base = 1.0 if "norm" in name or name.split(".")[-2].startswith("ln") else 0.0
                value = base + 0.1 * rng.standard_normal(shape)
            elif any(key in name for key in ("embed", "wte", "wpe")):
                value = 0.25 * rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[0])
            param.set_value(value.astype("float32"))


def build_ours(config, state: dict):
    paddle.seed(0)
    model = CausalLM(config)
    load_full_weights(model, config, state, "converted PaddleNLP weights")
    model.eval()
    return model


def inputs(seed: int = 1):
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    labels = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return paddle.to_tensor(input_ids, dtype="int64"), paddle.to_tensor(labels, dtype="int64")


@paddle.no_grad()
def paddlenlp_outputs(model, input_ids, labels):
    logits = model(input_ids=input_ids, return_dict=True).logits
    loss = model(input_ids=input_ids, labels=labels, return_dict=True).loss
    return logits.numpy(), float(loss)


@paddle.no_grad()
def our_outputs(model, input_ids, labels):
    return model(input_ids).numpy(), float(model(input_ids, labels))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_paddlenlp(case):
    reference, raw_config, config = build_paddlenlp_model(case)
    ours = build_ours(config, from_paddlenlp_state(config, raw_config, reference.state_dict()))
    input_ids, labels = inputs()
    ref_logits, ref_loss = paddlenlp_outputs(reference, input_ids, labels)
    logits, loss = our_outputs(ours, input_ids, labels)
    assert logits.shape == ref_logits.shape == (BATCH, SEQ, VOCAB)
    logit_diff, loss_diff = float(np.abs(logits - ref_logits).max()), abs(loss - ref_loss)
    print(f"\n{case}: max |logits diff| {logit_diff:.2e}, |loss diff| {loss_diff:.2e} (loss {ref_loss:.4f})")
    # The weights are far from a no-op: a wrong mapping would move the logits by O(1).
    assert np.abs(ref_logits).std() > 0.5
    assert logit_diff < TOLERANCE and loss_diff < TOLERANCE


def test_loss_conventions_match_on_the_same_pairs():
    """Our loss is PaddleNLP's on (input, label) pairs as given: no shift, -100 skipped, mean over the rest."""
    reference, raw_config, config = build_paddlenlp_model("llama_gqa")
    ours = build_ours(config, from_paddlenlp_state(config, raw_config, reference.state_dict()))
    input_ids, labels = inputs()
    logits, loss = our_outputs(ours, input_ids, labels)
    lab = labels.numpy()
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    mask = lab != -100
    expected = -np.take_along_axis(log_probs, np.where(mask, lab, 0)[..., None], -1)[..., 0][mask].mean()
    assert abs(loss - expected) < TOLERANCE
    assert abs(loss - paddlenlp_outputs(reference, input_ids, labels)[1]) < TOLERANCE


def test_baichuan2_norm_head_against_normalized_head():
    """NormHead = PaddleNLP's LLaMA(alibi) (Baichuan2-13B) with each vocab column of the head L2-normalized."""
    reference, raw_config, config = build_paddlenlp_model("baichuan13b_alibi", seed=3)
    config = config.replace(norm_head=True)
    state = from_paddlenlp_state(config, raw_config, reference.state_dict())
    ours = build_ours(config, state)
    head = reference.lm_head.weight.numpy()  # [hidden, vocab]
    assert np.abs(np.linalg.norm(head, axis=0) - 1).max() > 0.1  # the raw head is far from normalized
    with paddle.no_grad():
        reference.lm_head.weight.set_value(head / np.linalg.norm(head, axis=0, keepdims=True))
    input_ids, labels = inputs(seed=4)
    ref_logits, ref_loss = paddlenlp_outputs(reference, input_ids, labels)
    logits, loss = our_outputs(ours, input_ids, labels)
    logit_diff, loss_diff = float(np.abs(logits - ref_logits).max()), abs(loss - ref_loss)
    print(f"\nbaichuan2_norm_head: max |logits diff| {logit_diff:.2e}, |loss diff| {loss_diff:.2e}")
    assert logit_diff < TOLERANCE and loss_diff < TOLERANCE
    # and the head really is normalized in our model: the same weights without norm_head differ
    plain = build_ours(config.replace(norm_head=False), state)
    assert np.abs(our_outputs(plain, input_ids, labels)[0] - logits).max() > 0.1


@pytest.mark.parametrize("case", ["llama_gqa", "baichuan13b_alibi", "qwen", "gpt3", "bloom"])
def test_initial_weights_are_drawn_like_paddlenlp(case):
    """Each of our initial weight matrices has the spread PaddleNLP's own initialization gives it:
    N(0, initializer_range), the residual output projections (o_proj, down_proj) scaled by
    1/sqrt(2 * layers) in every family but Bloom."""
    class_name, config_name, kwargs, config = CASES[case]
    paddle.seed(0)
    reference = getattr(paddlenlp_transformers, class_name)(getattr(paddlenlp_transformers, config_name)(**kwargs))
    theirs = from_paddlenlp_state(config, reference.config.to_dict(), reference.state_dict())
    model = CausalLM(config)
    init_weights(model, config, seed=0)
    ours = {name: param.numpy() for name, param in model.canonical_named_parameters()}
    scaled = []
    for name, value in theirs.items():
        value = value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)
        if value.ndim != 2:
            continue
        expected_std = value.std()
        if case == "bloom" and expected_std == 0:
            # PaddleNLP 2.8.1's BloomPretrainedModel._init_weights zeroes the *weight* of every Linear
            # that has a bias (bloom/modeling.py: `layer.weight.set_value(paddle.zeros(...))` under
            # `if bias is not None`); Hugging Face's Bloom zeroes the bias. We draw the weight.
            expected_std = config.initializer_range
        assert ours[name].std() == pytest.approx(expected_std, rel=0.1), name
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            scaled.append(ours[name].std() / config.initializer_range)
    expected = 1.0 if case == "bloom" else 0.5  # 2 layers: 1/sqrt(4)
    assert scaled and np.allclose(scaled, expected, rtol=0.1), scaled
