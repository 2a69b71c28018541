"""BLOOM: LayerNorm (also right after the word embedding), ALiBi, 4h GELU MLP, biases, tied head.

Checked: bigscience/bloom (hidden 14336, n_layer 70, n_head 112, vocab 250880) against a copy of its
config.json in test fixtures [stored GitHub index id 60716429655]; bloom-7b1 sizes only through the
published parameter count (tests/test_registry.py KNOWN_COUNTS). layer_norm_epsilon 1e-5: PaddleNLP 2.8.1's
BloomConfig default and bloom-560m's config.json; seq_length 2048: bloomz-560m's config.json (a public copy).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, no_grouped_query, \
    reference_sizes, tiny_sizes, unsupported
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_BIASES, QKV_WEIGHTS, R, _attn, _mlp, \
    weight_and_bias

SWITCHES = dict(norm_type="layernorm", position_embedding="alibi", hidden_act="gelu_tanh", linear_bias=True,
                tie_word_embeddings=True, embedding_layernorm=True, norm_eps=1e-5)


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="bloom", **{**SWITCHES, **sizes})


def _bloom(hidden, layers, heads):
    # ALiBi has no position table; max_position_embeddings is Bloom's training length.
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=4 * hidden, vocab_size=250880, max_position_embeddings=2048)


ARCHITECTURES = {
    "bigscience/bloom-7b1": _bloom(4096, 30, 32),
    "bigscience/bloomz-7b1": _bloom(4096, 30, 32),
    "bigscience/bloomz-7b1-mt": _bloom(4096, 30, 32),
    "bigscience/bloom": _bloom(14336, 70, 112),
    "bloom-tiny": _config(**tiny_sizes(intermediate_size=256)),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if raw.get("apply_residual_connection_post_layernorm"):
        unsupported(source, "apply_residual_connection_post_layernorm")
    sizes["intermediate_size"] = 4 * sizes.get("hidden_size", 64)
    sizes.setdefault("max_position_embeddings", raw.get("seq_length", 2048))
    return sizes


def bloom_table() -> list:
    """PaddleNLP BloomForCausalLM: LayerNorm after the embedding, ALiBi, per-head fused q/k/v, tied head."""
    p = "bloom.h.{i}."
    return [
        R("bloom.word_embeddings.weight", "embeddings.word_embeddings.weight"),
        *weight_and_bias("bloom.word_embeddings_layernorm", "embeddings.word_embeddings_layernorm"),
        *weight_and_bias(p + "input_layernorm", INPUT_NORM),
        R(p + "self_attention.query_key_value.weight", QKV_WEIGHTS, "per_head"),
        R(p + "self_attention.query_key_value.bias", QKV_BIASES, "per_head"),
        *weight_and_bias(p + "self_attention.dense", _attn("o_proj")),
        *weight_and_bias(p + "post_attention_layernorm", POST_ATTENTION_NORM),
        *weight_and_bias(p + "mlp.dense_h_to_4h", _mlp("up_proj")),
        *weight_and_bias(p + "mlp.dense_4h_to_h", _mlp("down_proj")),
        *weight_and_bias("bloom.ln_f", "norm"),
    ]


def hf_bloom_table(prefix: str = "transformer.") -> list:
    """Hugging Face BloomForCausalLM: PaddleNLP's names under "transformer.", PyTorch's [out, in] matrices
    (query_key_value per head [heads, 3, head_dim] along the output axis, as PaddleNLP's), tied head.
    (bigscience's published files were saved from BloomModel: the same names without "transformer.".)"""
    p = prefix + "h.{i}."

    def linear(theirs: str, ours: str) -> list:
        return [R(f"{theirs}.weight", f"{ours}.weight", "transpose"), R(f"{theirs}.bias", f"{ours}.bias")]

    return [
        R(prefix + "word_embeddings.weight", "embeddings.word_embeddings.weight"),
        *weight_and_bias(prefix + "word_embeddings_layernorm", "embeddings.word_embeddings_layernorm"),
        *weight_and_bias(p + "input_layernorm", INPUT_NORM),
        R(p + "self_attention.query_key_value.weight", QKV_WEIGHTS, "per_head_transpose"),
        R(p + "self_attention.query_key_value.bias", QKV_BIASES, "per_head"),
        *linear(p + "self_attention.dense", _attn("o_proj")),
        *weight_and_bias(p + "post_attention_layernorm", POST_ATTENTION_NORM),
        *linear(p + "mlp.dense_h_to_4h", _mlp("up_proj")),
        *linear(p + "mlp.dense_4h_to_h", _mlp("down_proj")),
        *weight_and_bias(prefix + "ln_f", "norm"),
    ]


def import_table(raw: dict, config, names=()) -> list:
    if any(n.startswith("transformer.") for n in names):  # Hugging Face's BloomForCausalLM
        return hf_bloom_table()
    if "word_embeddings.weight" in names:  # Hugging Face's, saved from BloomModel (bigscience/bloom*)
        return hf_bloom_table("")
    return bloom_table()


def hf_config_json(c) -> dict:
    """config.json of transformers' BloomForCausalLM (BloomConfig.to_dict's keys)."""
    return dict(
        architectures=["BloomForCausalLM"], model_type="bloom", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        n_layer=c.num_hidden_layers, n_head=c.num_attention_heads, layer_norm_epsilon=c.norm_eps,
        initializer_range=c.initializer_range, use_cache=True, apply_residual_connection_post_layernorm=False,
        hidden_dropout=c.hidden_dropout_prob, attention_dropout=c.attention_probs_dropout_prob, pretraining_tp=1,
        slow_but_exact=False, tie_word_embeddings=True,
        seq_length=c.max_position_embeddings,  # not read by transformers (ALiBi); bloomz's key, kept for the way back
    )


def config_json(c) -> dict:
    return dict(
        architectures=["BloomForCausalLM"], model_type="bloom", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        initializer_range=c.initializer_range, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        layer_norm_epsilon=c.norm_eps, hidden_dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob, apply_residual_connection_post_layernorm=False,
        pretraining_tp=1, slow_but_exact=False, tie_word_embeddings=True,
        max_position_embeddings=c.max_position_embeddings,  # not Bloom's; kept for the way back
    )


def check(c):
    if reason := no_grouped_query(c):
        return reason
    if c.intermediate_size != 4 * c.hidden_size:
        return f"an MLP of intermediate_size {c.intermediate_size} (it has 4 x hidden_size = {4 * c.hidden_size})"
    return None


FAMILY = Family(
    name="bloom", switches=SWITCHES, scaled_output_init=False,  # Bloom draws every weight alike
    architectures=ARCHITECTURES, tiny="bloom-tiny", model_types=("bloom",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="BloomForCausalLM", model_type="bloom",
        requires=dict(norm_type="layernorm", hidden_act="gelu_tanh", position_embedding="alibi", linear_bias=True,
                      tie_word_embeddings=True, embedding_layernorm=True),
        export_table=lambda config: bloom_table(), import_table=import_table, config_json=config_json, check=check,
    ),
    hugging_face=HuggingFaceClass(
        class_name="BloomForCausalLM", model_type="bloom",
        requires=dict(norm_type="layernorm", hidden_act="gelu_tanh", position_embedding="alibi", linear_bias=True,
                      tie_word_embeddings=True, embedding_layernorm=True, norm_head=False),
        table=lambda config: hf_bloom_table(), config_json=hf_config_json, check=check,
    ),
    reference_cases={"bloom": ReferenceCase(
        "BloomForCausalLM", "BloomConfig",
        dict(vocab_size=256, hidden_size=96, n_layer=2, n_head=6, layer_norm_epsilon=1e-5),
        # Bloom's config has no max_position_embeddings (ALiBi); read as its training length 2048
        _config(**{**reference_sizes(96, 6, inner=384), "max_position_embeddings": 2048}))},
    export_case=("bloom", {}),
    required_keys=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"),
)
