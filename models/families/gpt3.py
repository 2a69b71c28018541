"""GPT-3 (and PaddleNLP's GPT-2 medium): LayerNorm, learned positions, 4h GELU MLP, biases, tied head.

PaddleNLP's GPTForCausalLM (model_type "gpt") is the reference; Hugging Face's GPT-2 config.json and
weights (model_type "gpt2", the same architecture) are read too.

Sizes from the GPT-3 paper (Brown et al. 2020, table 2.1) except where PaddleNLP's own gpt3-*-en
configs differ (16 heads for 1.3B, hidden 5120 for 13B), with PaddleNLP's vocabulary (50304;
51200 for 175B) and context (1024). GELU is the tanh approximation, as GPT-2/3 and PaddleNLP's
GPT (F.gelu(..., approximate=True)); PaddleNLP's GPT fixes LayerNorm epsilon at 1e-5.

Checked: gpt3-1.3B/6.7B/13B/175B-en against PaddleNLP 2.8.1's own GPT_PRETRAINED_INIT_CONFIGURATION
(paddlenlp/transformers/gpt/configuration.py: sizes, vocab 50304 / 51200, 1024 positions). The 125M/350M/
760M/2.7B sizes are the paper's table 2.1 (PaddleNLP 2.8.1 has no config for them). gpt2-medium-en: 24
layers, 1024 hidden, 16 heads as openai-community/gpt2-medium's config.json (mlc-ai/mlc-llm model_preset.py
"gpt2_medium", vocabulary there 50257; 50304 here is PaddleNLP's padded vocabulary; PaddleNLP 2.8.1 lists
only the weights URL of gpt2-medium-en, no config).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, no_grouped_query, \
    reference_sizes, tiny_sizes, unsupported
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_BIASES, QKV_WEIGHTS, R, _attn, _mlp, \
    weight_and_bias

SWITCHES = dict(norm_type="layernorm", position_embedding="learned", hidden_act="gelu_tanh", linear_bias=True,
                tie_word_embeddings=True, norm_eps=1e-5)


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="gpt3", **{**SWITCHES, **sizes})


def _gpt3(hidden, layers, heads, vocab=50304):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=1024)


ARCHITECTURES = {
    "gpt3-125M-en": _gpt3(768, 12, 12),
    "gpt3-350M-en": _gpt3(1024, 24, 16),
    "gpt3-760M-en": _gpt3(1536, 24, 16),
    "gpt3-1.3B-en": _gpt3(2048, 24, 16),
    "gpt3-2.7B-en": _gpt3(2560, 32, 32),
    "gpt3-6.7B-en": _gpt3(4096, 32, 32),
    "gpt3-13B-en": _gpt3(5120, 40, 40),
    "gpt3-175B-en": _gpt3(12288, 96, 96, vocab=51200),
    "gpt2-medium-en": _gpt3(1024, 24, 16),
    # Published industrial shapes as GPT-3-family models (configs/industrial/, benchmarks/industrial_plans.md).
    # MT-NLG 530B (Smith et al. 2022): 105 layers, hidden 20480, 128 heads; GPT-2 vocabulary padded to 51200.
    "mt-nlg-530B-gpt3": _gpt3(20480, 105, 128, vocab=51200),
    # GPT-NeoX-20B (Black et al. 2022): 44 layers, hidden 6144, 64 heads, vocabulary 50432. Differs: NeoX has
    # rotary positions on 25 % of each head, attention and MLP in parallel, untied head; here learned
    # positions, sequential blocks, tied head (about 0.3B parameters fewer).
    "gpt-neox-20B-gpt3": _gpt3(6144, 44, 64, vocab=50432),
    # OPT-175B (Zhang et al. 2022): 96 layers, hidden 12288, 96 heads, vocabulary 50272. Differs: ReLU MLP
    # (here GELU), learned positions offset by 2 (same count of parameters otherwise).
    "opt-175B-gpt3": _gpt3(12288, 96, 96, vocab=50272),
    "gpt3-tiny": _config(**tiny_sizes(intermediate_size=256)),
}


# Hugging Face GPT-2's config.json keys (model_type "gpt2") in our names.
HF_GPT2_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
                "layer_norm_epsilon": "norm_eps", "resid_pdrop": "hidden_dropout_prob",
                "attn_pdrop": "attention_probs_dropout_prob"}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if str(raw.get("model_type")).lower() == "gpt2":  # Hugging Face GPT-2: the same architecture, other keys
        sizes.update({ours: raw[key] for key, ours in HF_GPT2_KEYS.items() if raw.get(key) is not None})
        sizes.setdefault("intermediate_size", 4 * sizes.get("hidden_size", 0))  # n_inner null: 4 x n_embd
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            unsupported(source, f"activation_function {activation!r}")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
            unsupported(source, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
        sizes["hidden_act"] = "gelu_tanh"
        return sizes
    sizes["norm_eps"] = 1e-5  # PaddleNLP's GPT ignores the epsilon in its config
    activation = raw.get("hidden_activation", raw.get("hidden_act", "gelu"))
    if activation not in ("gelu", "gelu_new"):
        unsupported(source, f"hidden_activation {activation!r}")
    sizes["hidden_act"] = "gelu_tanh"
    if not raw.get("normalize_before", True):
        unsupported(source, "normalize_before false (post-norm)")
    if raw.get("scale_qk_coeff", 1.0) != 1.0:
        unsupported(source, f"scale_qk_coeff {raw['scale_qk_coeff']}")
    return sizes


def gpt_table(fuse_qkv: bool = False) -> list:
    """PaddleNLP GPTForCausalLM: pre-norm, biases everywhere, head tied to the word embedding."""
    p = "gpt.decoder.layers.{i}."
    return [
        R("gpt.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
        R("gpt.embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
        *weight_and_bias(p + "norm1", INPUT_NORM),
        *([R(p + "self_attn.qkv_proj.weight", QKV_WEIGHTS, "per_head"),
           R(p + "self_attn.qkv_proj.bias", QKV_BIASES, "per_head")] if fuse_qkv else
          [r for n in "qkv" for r in weight_and_bias(p + f"self_attn.{n}_proj", _attn(f"{n}_proj"))]),
        *weight_and_bias(p + "self_attn.out_proj", _attn("o_proj")),
        *weight_and_bias(p + "norm2", POST_ATTENTION_NORM),
        *weight_and_bias(p + "linear1", _mlp("up_proj")),
        *weight_and_bias(p + "linear2", _mlp("down_proj")),
        *weight_and_bias("gpt.decoder.norm", "norm"),
        R("lm_head.weight", "embeddings.word_embeddings.weight", export_only=True),
    ]


def hf_gpt2_table(prefix: str = "transformer.") -> list:
    """Hugging Face GPT2LMHeadModel (import only). Its Conv1D layers store [in, out] as Paddle does; c_attn
    is [q | k | v] along the output axis; the head is tied to wte. (The original gpt2 checkpoints were
    saved from GPT2Model: the same names without "transformer.".)"""
    p = prefix + "h.{i}."
    return [
        R(prefix + "wte.weight", "embeddings.word_embeddings.weight"),
        R(prefix + "wpe.weight", "embeddings.position_embeddings.weight"),
        *weight_and_bias(p + "ln_1", INPUT_NORM),
        R(p + "attn.c_attn.weight", QKV_WEIGHTS, "concat"),
        R(p + "attn.c_attn.bias", QKV_BIASES, "concat"),
        *weight_and_bias(p + "attn.c_proj", _attn("o_proj")),
        *weight_and_bias(p + "ln_2", POST_ATTENTION_NORM),
        *weight_and_bias(p + "mlp.c_fc", _mlp("up_proj")),
        *weight_and_bias(p + "mlp.c_proj", _mlp("down_proj")),
        *weight_and_bias(prefix + "ln_f", "norm"),
    ]


def import_table(raw: dict, config, names=()) -> list:
    if str(raw.get("model_type")).lower() == "gpt2":
        return hf_gpt2_table("transformer." if any(n.startswith("transformer.") for n in names) else "")
    return gpt_table(bool(raw.get("fuse_attention_qkv")))


def config_json(c) -> dict:
    # "ignore_index": -100: PaddleNLP's GPT default 0 would drop token id 0 from its loss (ours ignores -100).
    return dict(
        architectures=["GPTForCausalLM"], model_type="gpt", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        initializer_range=c.initializer_range, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, seq_length=c.max_position_embeddings,
        hidden_activation="gelu", layer_norm_eps=c.norm_eps, hidden_dropout_prob=c.hidden_dropout_prob,
        attention_probs_dropout_prob=c.attention_probs_dropout_prob, ignore_index=-100, normalize_before=True,
        fuse_attention_qkv=False, tie_word_embeddings=True,
    )


def hf_gpt2_config(c) -> dict:
    """config.json of transformers' GPT2LMHeadModel (GPT2Config.to_dict's keys): GPT-3 is GPT-2's layout."""
    return dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size, n_positions=c.max_position_embeddings,
        n_ctx=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads, n_inner=c.intermediate_size, activation_function="gelu_new",
        resid_pdrop=c.hidden_dropout_prob, embd_pdrop=c.hidden_dropout_prob,
        attn_pdrop=c.attention_probs_dropout_prob, layer_norm_epsilon=c.norm_eps,
        initializer_range=c.initializer_range, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False, use_cache=True, tie_word_embeddings=True,
    )


# GPT-2's layout holds a GPT-3 of this family exactly: pre-norm LayerNorm, learned positions, tanh GELU
# ("gelu_new"), biases everywhere, a tied head, any n_inner. It cannot hold grouped-query attention, an
# untied head, or rotary / ALiBi positions (GPT-NeoX-style models): those are refused.
HF_GPT2_CLASS = HuggingFaceClass(
    class_name="GPT2LMHeadModel", model_type="gpt2",
    requires=dict(norm_type="layernorm", hidden_act="gelu_tanh", position_embedding="learned", linear_bias=True,
                  tie_word_embeddings=True, embedding_layernorm=False, norm_head=False),
    table=lambda c: hf_gpt2_table("transformer."), config_json=hf_gpt2_config, check=no_grouped_query,
)


def _reference_kwargs(**extra):
    return dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                ignore_index=-100, **extra)


FAMILY = Family(
    name="gpt3", switches=SWITCHES, scaled_output_init=True,  # out_proj, linear2 (GPTPretrainedModel, as GPT-2)
    architectures=ARCHITECTURES, tiny="gpt3-tiny", model_types=("gpt", "gpt2"), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="GPTForCausalLM", model_type="gpt",
        requires=dict(norm_type="layernorm", hidden_act="gelu_tanh", position_embedding="learned", linear_bias=True,
                      tie_word_embeddings=True, embedding_layernorm=False, norm_eps=1e-5),
        export_table=lambda config: gpt_table(),
        import_table=import_table,
        config_json=config_json, check=no_grouped_query,
    ),
    hugging_face=HF_GPT2_CLASS,
    reference_cases={
        "gpt3": ReferenceCase("GPTForCausalLM", "GPTConfig", _reference_kwargs(),
                              _config(**reference_sizes(inner=256))),
        "gpt3_fused_qkv": ReferenceCase("GPTForCausalLM", "GPTConfig", _reference_kwargs(fuse_attention_qkv=True),
                                        _config(**reference_sizes(inner=256), fuse_attention_qkv=True)),
    },
    export_case=("gpt3", {}),
)
