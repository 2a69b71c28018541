"""LLaMA, Llama 2, Llama 3 / 3.1 and the Chinese LLaMA derivatives.

RMSNorm, rotary positions, SwiGLU MLP, no biases, untied head; grouped-query attention from
Llama-2-70B on. Llama 3 changes sizes only (vocabulary 128256, rope_theta 500000, GQA with 8 kv
heads); Llama 3.1 adds its rotary frequency scaling (`rope_scaling`, rope_type "llama3": factor 8,
low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192; models/rope.py).

Sizes are the published config.json files' (meta-llama/* on the Hugging Face hub; PaddleNLP
serves the same files under the same names): Meta-Llama-3-8B/70B and Llama-3.1-8B/70B/405B.

Where each preset was checked (verbatim copies of the published files;
"a public copy": a verbatim copy found in a public repository not named here):
  LLaMA 7B/13B/65B  Meta's params.json as copied in tinygrad/tinygrad@00cc14b examples/llama.py
                    MODEL_PARAMS (norm_eps 1e-06 for 7B/13B/30B, 1e-05 for 65B; also the 65B HF config
                    (a public copy)); sizes: huggyllama/* via the table (a public copy)
  Llama-2-7b/13b/70b  the -hf config.json files as dicts Llama_2_*_hf (a public copy)
  Meta-Llama-3-8B/70B  huggingface/transformers@5e8e345 examples/pytorch/torchacc/llama3/*/config.json
  Llama-3.1-8B      citsjtu2020/LLM-Prof sglang/Model_Config.md (rope_scaling included)
  Llama-3.1-70B     mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py "llama3_1_70b" (the -Instruct file;
                    same architecture)
  Llama-3.1-405B    a benchmark's dummy FP8 copy of the 405B config.json (a public copy) (16384, 126 layers,
                    128 / 8 heads, 53248, 131072, eps 1e-05, theta 500000, rope_scaling llama3 factor 8);
                    no copy of the base model's own file found
  Chinese LLaMA derivatives (FlagAlpha, ziya, linly): not verified (no source found)
  TinyLlama_v1.1    TinyLlama/TinyLlama_v1.1's model card (same architecture as TinyLlama-1.1B); the values
                    checked against a verbatim copy of TinyLlama-1.1B-Chat-v1.0's config.json (a public copy):
                    hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 kv heads, vocab 32000, rope_theta
                    10000.0, rms_norm_eps 1e-05, max_position_embeddings 2048, tie_word_embeddings false
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, reference_sizes, tiny_sizes, \
    unsupported
from models.rope import read_rope_config
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_BIASES, QKV_WEIGHTS, R, _attn, _mlp

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu")
LLAMA3_VOCAB = 128256
# Llama 3.1's config.json "rope_scaling" (all three sizes).
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="llama", **{**SWITCHES, **sizes})


def _llama(hidden, layers, heads, intermediate, kv_heads=None, max_positions=2048, eps=1e-6, vocab=32000, **extra):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, intermediate_size=intermediate,
                   max_position_embeddings=max_positions, norm_eps=eps, vocab_size=vocab, **extra)


def _llama2(hidden, layers, heads, intermediate, vocab=32000, **extra):
    return _llama(hidden, layers, heads, intermediate, max_positions=4096, eps=1e-5, vocab=vocab, **extra)


def _llama3(hidden, layers, heads, intermediate, scaled=False):
    # config.json: num_key_value_heads 8, rms_norm_eps 1e-05, rope_theta 500000.0, vocab_size 128256,
    # max_position_embeddings 8192 (Llama 3) / 131072 with rope_scaling (Llama 3.1), tie_word_embeddings false.
    return _llama(hidden, layers, heads, intermediate, kv_heads=8, max_positions=131072 if scaled else 8192,
                  eps=1e-5, vocab=LLAMA3_VOCAB, rope_theta=500000.0,
                  rope_scaling=dict(LLAMA31_ROPE_SCALING) if scaled else None)


ARCHITECTURES = {
    # LLaMA (Touvron et al. 2023)
    "facebook/llama-7b": _llama(4096, 32, 32, 11008),
    "facebook/llama-13b": _llama(5120, 40, 40, 13824),
    "facebook/llama-65b": _llama(8192, 80, 64, 22016, eps=1e-5),  # 65B's params.json: norm_eps 1e-05
    # Llama 2
    "meta-llama/Llama-2-7b": _llama2(4096, 32, 32, 11008),
    "meta-llama/Llama-2-7b-chat": _llama2(4096, 32, 32, 11008),
    "meta-llama/Llama-2-13b": _llama2(5120, 40, 40, 13824),
    "meta-llama/Llama-2-13b-chat": _llama2(5120, 40, 40, 13824),
    "meta-llama/Llama-2-70b": _llama2(8192, 80, 64, 28672, kv_heads=8),
    # Llama 3 and 3.1 (hub names with and without "Meta-"; the -Instruct models have the same architecture)
    "meta-llama/Meta-Llama-3-8B": _llama3(4096, 32, 32, 14336),
    "meta-llama/Meta-Llama-3-8B-Instruct": _llama3(4096, 32, 32, 14336),
    "meta-llama/Meta-Llama-3-70B": _llama3(8192, 80, 64, 28672),
    "meta-llama/Meta-Llama-3-70B-Instruct": _llama3(8192, 80, 64, 28672),
    "meta-llama/Llama-3.1-8B": _llama3(4096, 32, 32, 14336, scaled=True),
    "meta-llama/Llama-3.1-8B-Instruct": _llama3(4096, 32, 32, 14336, scaled=True),
    "meta-llama/Meta-Llama-3.1-8B": _llama3(4096, 32, 32, 14336, scaled=True),
    "meta-llama/Llama-3.1-70B": _llama3(8192, 80, 64, 28672, scaled=True),
    "meta-llama/Llama-3.1-70B-Instruct": _llama3(8192, 80, 64, 28672, scaled=True),
    "meta-llama/Meta-Llama-3.1-70B": _llama3(8192, 80, 64, 28672, scaled=True),
    "meta-llama/Llama-3.1-405B": _llama3(16384, 126, 128, 53248, scaled=True),
    "meta-llama/Meta-Llama-3.1-405B": _llama3(16384, 126, 128, 53248, scaled=True),
    # Chinese LLaMA derivatives
    "FlagAlpha/Llama2-Chinese-7b-Chat": _llama2(4096, 32, 32, 11008),
    "FlagAlpha/Llama2-Chinese-13b-Chat": _llama2(5120, 40, 40, 13824),
    "idea-ccnl/ziya-llama-13b-v1": _llama(5120, 40, 40, 13824, vocab=39424),
    "linly-ai/chinese-llama-2-7b": _llama2(4096, 32, 32, 11008, vocab=40076),
    "linly-ai/chinese-llama-2-13b": _llama2(5120, 40, 40, 13824, vocab=40076),
    # TinyLlama (Zhang et al. 2024): Llama 2's architecture at 1.1B, the GPU self-check's one-GPU speed row
    "TinyLlama/TinyLlama_v1.1": _llama(2048, 22, 32, 5632, kv_heads=4, eps=1e-5),
    # Small presets for CPU runs and tests. Their vocabulary grows to the tokenizer's.
    "llama-tiny": _config(**tiny_sizes(num_key_value_heads=2)),
    # Llama 3.1's shape in small: GQA, rope_theta 500000 and its rotary scaling (original length 64,
    # so that the tiny sequence lengths reach the scaled frequency bands).
    "llama3-tiny": _config(**tiny_sizes(num_key_value_heads=2, rope_theta=500000.0, norm_eps=1e-5),
                           rope_scaling={**LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 64}),
    "llama-small": _config(vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, intermediate_size=688, max_position_embeddings=2048),
    # Real-size CPU preset: above Paddle's size thresholds (stage 3 slices parameters above 2**20
    # elements, stage 2 keeps parameters above 2**23 out of its gradient buffer): MLP matrices
    # 1024 x 2816 = 2.9M, embedding and head 8320 x 1024 = 8.5M elements.
    "llama-real": _config(vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=1024),
}


# ----------------------------------------------------------------------------- config.json
def read_rope(raw: dict, sizes: dict, source: str) -> dict:
    """The rotary base and scaling of a config.json in either transformers form (models/rope.py
    read_rope_config: 4.x top-level rope_theta / rope_scaling, 5.x rope_parameters) into `sizes`."""
    if raw.get("rope_scaling_type"):  # PaddleNLP 2.8's own switch: linear / ntk / dynamic_ntk
        unsupported(source, f"rope_scaling_type {raw['rope_scaling_type']!r}")
    theta, scaling = read_rope_config(raw, source, yarn=True)
    if theta is not None:
        sizes["rope_theta"] = theta
    sizes["rope_scaling"] = scaling
    return sizes


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if raw.get("alibi"):
        sizes["position_embedding"] = "alibi"
    read_rope(raw, sizes, source)
    # PaddleNLP runs Baichuan checkpoints as LlamaForCausalLM; ALiBi or a NormHead says it is one.
    if sizes.get("position_embedding") == "alibi" or raw.get("norm_head"):
        sizes["family"] = "baichuan"
    return sizes


# ----------------------------------------------------------------------------- PaddleNLP / HF tables
def llama_style_table(prefix: str = "llama.", qkv_bias: bool = False, fuse_qkv: bool = False,
                      fuse_ffn: bool = False, head: bool = True, transpose: bool = False) -> list:
    """LLaMA-shaped names: PaddleNLP's LlamaForCausalLM (prefix "llama."), Qwen2ForCausalLM ("qwen2.",
    q/k/v biases) and Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM ("model.", PyTorch's [out, in]
    matrices: transpose). head: the class holds its own lm_head (not tied)."""
    p = prefix + "layers.{i}."
    same = "transpose" if transpose else "same"
    return [
        R(prefix + "embed_tokens.weight", "embeddings.word_embeddings.weight"),
        R(p + "input_layernorm.weight", INPUT_NORM + ".weight"),
        *([R(p + "self_attn.qkv_proj.weight", QKV_WEIGHTS, "kv_groups")] if fuse_qkv else
          [R(p + f"self_attn.{n}_proj.weight", _attn(f"{n}_proj.weight"), same) for n in "qkv"]),
        *([R(p + f"self_attn.{n}_proj.bias", b) for n, b in zip("qkv", QKV_BIASES)] if qkv_bias else []),
        R(p + "self_attn.o_proj.weight", _attn("o_proj.weight"), same),
        R(p + "post_attention_layernorm.weight", POST_ATTENTION_NORM + ".weight"),
        *([R(p + "mlp.gate_up_fused_proj.weight", (_mlp("gate_proj.weight"), _mlp("up_proj.weight")), "concat")]
          if fuse_ffn else [R(p + f"mlp.{n}.weight", _mlp(f"{n}.weight"), same) for n in ("gate_proj", "up_proj")]),
        R(p + "mlp.down_proj.weight", _mlp("down_proj.weight"), same),
        R(prefix + "norm.weight", "norm.weight"),
        *([R("lm_head.weight", "lm_head.weight", same)] if head else []),
    ]


def is_hugging_face(names) -> bool:
    """Weights in Hugging Face's names (model.layers...) rather than PaddleNLP's (llama.layers...)."""
    return any(n.startswith("model.") for n in names)


def import_table(raw: dict, config, names=()) -> list:
    if is_hugging_face(names):  # e.g. Meta-Llama-3-8B's model.safetensors
        return llama_style_table("model.", head=not raw.get("tie_word_embeddings", False), transpose=True)
    return llama_style_table(fuse_qkv=bool(raw.get("fuse_attention_qkv")),
                             fuse_ffn=bool(raw.get("fuse_attention_ffn")))


def config_json(c) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        initializer_range=c.initializer_range, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        seq_length=c.max_position_embeddings, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        alibi=c.position_embedding == "alibi", tie_word_embeddings=False, fuse_attention_qkv=False,
        fuse_attention_ffn=False,
        **({"norm_head": True} if c.norm_head and not c.tie_word_embeddings else {}),  # see paddlenlp_interop
        **({"rope_scaling": dict(c.rope_scaling)} if c.rope_scaling else {}),  # Hugging Face's key (Llama 3.1)
    )


def check_llama_class(c):
    if c.rope_scaling:
        return ("rope_scaling (Llama 3.1's rotary scaling): PaddleNLP 2.8.1's LlamaForCausalLM has none and would "
                "compute other rotary frequencies")
    return None


LLAMA_CLASS = PaddleNLPClass(
    class_name="LlamaForCausalLM", model_type="llama",
    requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding=("rope", "alibi"), linear_bias=False,
                  qkv_bias=False, embedding_layernorm=False),
    export_table=lambda config: llama_style_table(), import_table=import_table, config_json=config_json,
    check=check_llama_class, explicit_head=True,
)


# ----------------------------------------------------------------------------- Hugging Face (export)
def hf_llama_config(c, architecture="LlamaForCausalLM", model_type="llama") -> dict:
    """config.json of transformers' LlamaForCausalLM (LlamaConfig.to_dict's keys, Llama 3.1's rope_scaling)."""
    return dict(
        architectures=[architecture], model_type=model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        hidden_act="silu", max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.norm_eps, pretraining_tp=1, use_cache=True, rope_theta=c.rope_theta,
        rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None, attention_bias=False,
        attention_dropout=c.attention_probs_dropout_prob, mlp_bias=False, tie_word_embeddings=c.tie_word_embeddings,
    )


HF_LLAMA_REQUIRES = dict(norm_type="rmsnorm", hidden_act="silu", position_embedding="rope", linear_bias=False,
                         qkv_bias=False, embedding_layernorm=False, norm_head=False)

HF_LLAMA_CLASS = HuggingFaceClass(
    class_name="LlamaForCausalLM", model_type="llama", requires=HF_LLAMA_REQUIRES,
    table=lambda c: llama_style_table("model.", head=not c.tie_word_embeddings, transpose=True),
    config_json=hf_llama_config,
)


def _reference_kwargs(hidden=64, heads=4, kv_heads=2, **extra):
    return dict(vocab_size=256, hidden_size=hidden, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64, **extra)


REFERENCE_CASES = {
    "llama_gqa": ReferenceCase("LlamaForCausalLM", "LlamaConfig", _reference_kwargs(rms_norm_eps=1e-6),
                               _config(**reference_sizes(kv_heads=2), norm_eps=1e-6)),
    # PaddleNLP's fused layouts (qkv per kv-head group, gate|up) into our fused ones (q|k|v, gate|up)
    "llama_fused": ReferenceCase(
        "LlamaForCausalLM", "LlamaConfig",
        _reference_kwargs(rms_norm_eps=1e-5, fuse_attention_qkv=True, fuse_attention_ffn=True),
        _config(**reference_sizes(kv_heads=2), norm_eps=1e-5, fuse_attention_qkv=True, fuse_attention_ffn=True)),
    # Llama 3: LlamaForCausalLM with rope_theta 500000 and GQA (PaddleNLP 2.8.1 runs Meta-Llama-3 this way)
    "llama3": ReferenceCase("LlamaForCausalLM", "LlamaConfig",
                            _reference_kwargs(rms_norm_eps=1e-5, rope_theta=500000.0),
                            _config(**reference_sizes(kv_heads=2), norm_eps=1e-5, rope_theta=500000.0)),
    # Llama 3.1: the same with its rotary scaling; original length 16 so that the scaled bands matter at 16 tokens
    "llama31": ReferenceCase(
        "LlamaForCausalLM", "LlamaConfig", _reference_kwargs(rms_norm_eps=1e-5, rope_theta=500000.0),
        _config(**reference_sizes(kv_heads=2), norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={**LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 16}),
        rope_scaling={**LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 16}),
}

FAMILY = Family(
    name="llama", switches=SWITCHES, scaled_output_init=True,  # LlamaPretrainedModel._init_weights
    architectures=ARCHITECTURES, tiny="llama-tiny", model_types=("llama",), read_config=read_config,
    paddlenlp=LLAMA_CLASS, hugging_face=HF_LLAMA_CLASS, reference_cases=REFERENCE_CASES,
    export_case=("llama_gqa", {}),
)
