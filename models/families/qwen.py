"""Qwen (v1): Qwen-7B and Qwen-14B.

LLaMA's blocks with biases on the q/k/v projection (no GQA). PaddleNLP's QWenForCausalLM.
Qwen's own config.json counts both SwiGLU branches in `intermediate_size` (22016 for qwen-7b);
ours is the real width of each branch (11008).

Checked against the published config.json of Qwen-7B-Chat-Int4 and Qwen-14B-Chat-Int4 (same architecture as
the base models), smalltong02/keras-llm-robot models/llm/Qwen-{7,14}B-Chat-Int4/config.json: hidden 4096 /
5120, layers 32 / 40, heads 32 / 40, intermediate_size 22016 / 27392 (2 x 11008 / 13696), layer_norm_epsilon
1e-06, vocab 151936 / 152064, rotary_emb_base 10000. Their context keys are "seq_length" 8192 / 2048 and
"max_position_embeddings" 32768 / 8192. The presets' max_position_embeddings, 8192 for both, is Qwen-7B's
seq_length but Qwen-14B's max_position_embeddings; left as it was (the base models' files were not found).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, PaddleNLPClass, ReferenceCase, no_grouped_query, reference_sizes, \
    tiny_sizes, unsupported
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_BIASES, QKV_WEIGHTS, R, _attn, _mlp

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", qkv_bias=True)


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="qwen", **{**SWITCHES, **sizes})


def _qwen(hidden, layers, heads, intermediate, vocab):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=8192, norm_eps=1e-6)


ARCHITECTURES = {
    # config.json intermediate_size 22016 / 27392 = 2 x the widths below; Qwen-14B's vocabulary is 152064
    "qwen/qwen-7b": _qwen(4096, 32, 32, 11008, vocab=151936),
    "qwen/qwen-7b-chat": _qwen(4096, 32, 32, 11008, vocab=151936),
    "qwen/qwen-14b": _qwen(5120, 40, 40, 13696, vocab=152064),
    "qwen/qwen-14b-chat": _qwen(5120, 40, 40, 13696, vocab=152064),
    "qwen-tiny": _config(**tiny_sizes()),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    # Qwen's intermediate_size counts both SwiGLU branches (QWenMLP uses intermediate_size // 2).
    if "intermediate_size" in raw:
        sizes["intermediate_size"] = raw["intermediate_size"] // 2
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    if heads and hidden and raw.get("kv_channels", hidden // heads) * heads != hidden:
        unsupported(source, f"kv_channels {raw['kv_channels']} x num_attention_heads {heads} != hidden_size {hidden}")
    if raw.get("rotary_pct", 1.0) != 1.0:
        unsupported(source, f"rotary_pct {raw['rotary_pct']}")
    sizes["linear_bias"] = not raw.get("no_bias", True)  # c_proj / MLP biases when no_bias is false
    sizes.setdefault("max_position_embeddings", raw.get("seq_length", 8192))
    return sizes


def qwen_table(linear_bias: bool = False) -> list:
    """PaddleNLP QWenForCausalLM. Its MLP computes w1(x) * silu(w2(x)): w2 is the gate, w1 the up branch."""
    p = "qwen.h.{i}."
    biases = [
        R(p + "attn.c_proj.bias", _attn("o_proj.bias")),
        R(p + "mlp.w1.bias", _mlp("up_proj.bias")),
        R(p + "mlp.w2.bias", _mlp("gate_proj.bias")),
        R(p + "mlp.c_proj.bias", _mlp("down_proj.bias")),
    ]  # only with config no_bias false
    return [
        R("qwen.wte.weight", "embeddings.word_embeddings.weight"),
        R(p + "ln_1.weight", INPUT_NORM + ".weight"),
        R(p + "attn.c_attn.weight", QKV_WEIGHTS, "concat"),
        R(p + "attn.c_attn.bias", QKV_BIASES, "concat"),
        R(p + "attn.c_proj.weight", _attn("o_proj.weight")),
        R(p + "ln_2.weight", POST_ATTENTION_NORM + ".weight"),
        R(p + "mlp.w1.weight", _mlp("up_proj.weight")),
        R(p + "mlp.w2.weight", _mlp("gate_proj.weight")),
        R(p + "mlp.c_proj.weight", _mlp("down_proj.weight")),
        *(biases if linear_bias else []),
        R("qwen.ln_f.weight", "norm.weight"),
        R("lm_head.weight", "lm_head.weight"),
    ]


def config_json(c) -> dict:
    # Qwen's dynamic-NTK and log-n attention only act beyond "seq_length" at inference: seq_length is
    # the model's max_position_embeddings so that within it PaddleNLP computes what we train.
    return dict(
        architectures=["QWenForCausalLM"], model_type="qwen", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        initializer_range=c.initializer_range,
        intermediate_size=2 * c.intermediate_size,  # Qwen's convention: both SwiGLU branches
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads, kv_channels=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, seq_length=c.max_position_embeddings,
        layer_norm_epsilon=c.norm_eps, rotary_emb_base=c.rope_theta, rotary_pct=1.0, no_bias=not c.linear_bias,
        emb_dropout_prob=c.hidden_dropout_prob, attn_dropout_prob=c.attention_probs_dropout_prob,
        tie_word_embeddings=False,
    )


def check(c):
    if reason := no_grouped_query(c):
        return reason
    if c.rope_scaling:
        return "rope_scaling"
    return None


FAMILY = Family(
    name="qwen", switches=SWITCHES, scaled_output_init=True,  # QWenPretrainedModel._init_weights (c_proj)
    architectures=ARCHITECTURES, tiny="qwen-tiny", model_types=("qwen",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="QWenForCausalLM", model_type="qwen",
        requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding="rope", embedding_layernorm=False),
        export_table=lambda config: qwen_table(config.linear_bias),
        import_table=lambda raw, config, names=(): qwen_table(config.linear_bias),
        config_json=config_json, check=check, explicit_head=True,
    ),
    reference_cases={"qwen": ReferenceCase(
        "QWenForCausalLM", "QWenConfig",
        dict(vocab_size=256, hidden_size=64, intermediate_size=2 * 176, num_hidden_layers=2, num_attention_heads=4,
             kv_channels=16, max_position_embeddings=64, seq_length=64, layer_norm_epsilon=1e-6),
        _config(**reference_sizes()))},
    export_case=("qwen", {}),
)
