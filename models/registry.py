"""Named architectures with their real hyperparameters, and loading a model directory.

`model_name_or_path` is either a name below or a local directory holding a
`config.json` (and optionally weights):

* our own config.json (it has a "family" key), as written by
  scripts/import_paddlenlp.py, with `model_state.pdparams` in our canonical
  parameter names -- such a directory can be trained from (continue_training);
* a PaddleNLP / Hugging Face config.json (LLaMA, Baichuan, Qwen v1, GPT, Bloom):
  its architecture is read here (see `config_from_dict`), but its weights use
  PaddleNLP's names, so a directory that holds weights must be converted once
  with scripts/import_paddlenlp.py.

Names follow PaddleNLP's (its hub ids, "gpt3-1.3B-en" style for GPT-3). Sizes are
the published ones; the GPT-3 family takes its sizes from the GPT-3 paper (Brown
et al. 2020, table 2.1) except where PaddleNLP's own gpt3-*-en configs differ (16
heads for 1.3B, hidden 5120 for 13B), with PaddleNLP's vocabulary (50304; 51200
for 175B) and context (1024). Qwen's `intermediate_size` here is the real width of
each MLP branch: Qwen's own config.json stores twice that (22016 for qwen-7b).
"""

from __future__ import annotations

import json
import os

from llm_pretrain.errors import UsageError
from models.config import FAMILIES, RUNTIME_KEYS, ModelConfig, make_config


def _llama(hidden, layers, heads, intermediate, kv_heads=None, max_positions=2048, eps=1e-6, vocab=32000, **extra):
    return make_config(
        "llama", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_positions,
        norm_eps=eps, vocab_size=vocab, **extra,
    )


def _llama2(hidden, layers, heads, intermediate, vocab=32000, **extra):
    return _llama(hidden, layers, heads, intermediate, max_positions=4096, eps=1e-5, vocab=vocab, **extra)


def _baichuan(hidden, layers, heads, intermediate, vocab, alibi=False, norm_head=False):
    # Baichuan-7B / Baichuan2-7B: LLaMA with rotary positions; the 13B models use ALiBi.
    # Baichuan2 normalizes the rows of its output head (NormHead).
    return make_config(
        "baichuan", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=4096, norm_eps=1e-6,
        position_embedding="alibi" if alibi else "rope", norm_head=norm_head,
    )


def _qwen(hidden, layers, heads, intermediate, vocab):
    return make_config(
        "qwen", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=8192, norm_eps=1e-6,
    )


def _gpt3(hidden, layers, heads, vocab=50304):
    return make_config(
        "gpt3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=1024,
    )


def _bloom(hidden, layers, heads):
    # ALiBi has no position table; max_position_embeddings is Bloom's training length.
    return make_config(
        "bloom", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, vocab_size=250880, max_position_embeddings=2048,
    )


def _tiny(family, **extra):
    # vocab 256, 4 heads (2 kv heads where the family has GQA): every size splits 2 ways.
    sizes = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=176, max_position_embeddings=1024)
    return make_config(family, **{**sizes, **extra})


ARCHITECTURES: dict[str, ModelConfig] = {
    # LLaMA (Touvron et al. 2023)
    "facebook/llama-7b": _llama(4096, 32, 32, 11008),
    "facebook/llama-13b": _llama(5120, 40, 40, 13824),
    "facebook/llama-65b": _llama(8192, 80, 64, 22016),
    # Llama 2
    "meta-llama/Llama-2-7b": _llama2(4096, 32, 32, 11008),
    "meta-llama/Llama-2-7b-chat": _llama2(4096, 32, 32, 11008),
    "meta-llama/Llama-2-13b": _llama2(5120, 40, 40, 13824),
    "meta-llama/Llama-2-13b-chat": _llama2(5120, 40, 40, 13824),
    "meta-llama/Llama-2-70b": _llama2(8192, 80, 64, 28672, kv_heads=8),
    # Chinese LLaMA derivatives
    "FlagAlpha/Llama2-Chinese-7b-Chat": _llama2(4096, 32, 32, 11008),
    "FlagAlpha/Llama2-Chinese-13b-Chat": _llama2(5120, 40, 40, 13824),
    "idea-ccnl/ziya-llama-13b-v1": _llama(5120, 40, 40, 13824, vocab=39424),
    "linly-ai/chinese-llama-2-7b": _llama2(4096, 32, 32, 11008, vocab=40076),
    "linly-ai/chinese-llama-2-13b": _llama2(5120, 40, 40, 13824, vocab=40076),
    # Baichuan
    "baichuan-inc/Baichuan-7B": _baichuan(4096, 32, 32, 11008, vocab=64000),
    "baichuan-inc/Baichuan-13B-Base": _baichuan(5120, 40, 40, 13696, vocab=64000, alibi=True),
    "baichuan-inc/Baichuan-13B-Chat": _baichuan(5120, 40, 40, 13696, vocab=64000, alibi=True),
    "baichuan-inc/Baichuan2-7B-Base": _baichuan(4096, 32, 32, 11008, vocab=125696, norm_head=True),
    "baichuan-inc/Baichuan2-7B-Chat": _baichuan(4096, 32, 32, 11008, vocab=125696, norm_head=True),
    "baichuan-inc/Baichuan2-13B-Base": _baichuan(5120, 40, 40, 13696, vocab=125696, alibi=True, norm_head=True),
    "baichuan-inc/Baichuan2-13B-Chat": _baichuan(5120, 40, 40, 13696, vocab=125696, alibi=True, norm_head=True),
    # Qwen v1 (config.json intermediate_size 22016 / 27392 = 2 x the widths below)
    "qwen/qwen-7b": _qwen(4096, 32, 32, 11008, vocab=151936),
    "qwen/qwen-7b-chat": _qwen(4096, 32, 32, 11008, vocab=151936),
    "qwen/qwen-14b": _qwen(5120, 40, 40, 13696, vocab=152064),
    "qwen/qwen-14b-chat": _qwen(5120, 40, 40, 13696, vocab=152064),
    # GPT-3 sizes (see the module docstring) and PaddleNLP's GPT-2 medium
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
    # BLOOM
    "bigscience/bloom-7b1": _bloom(4096, 30, 32),
    "bigscience/bloomz-7b1": _bloom(4096, 30, 32),
    "bigscience/bloomz-7b1-mt": _bloom(4096, 30, 32),
    "bigscience/bloom": _bloom(14336, 70, 112),
    # Small presets for CPU runs and tests. Their vocabulary grows to the tokenizer's.
    "llama-tiny": _tiny("llama", num_key_value_heads=2),
    "llama-small": make_config(
        "llama", vocab_size=256, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=688, max_position_embeddings=2048,
    ),
    # Real-size CPU preset: above Paddle's size thresholds (stage 3 slices parameters above 2**20
    # elements, stage 2 keeps parameters above 2**23 out of its gradient buffer): MLP matrices
    # 1024 x 2816 = 2.9M, embedding and head 8320 x 1024 = 8.5M elements.
    "llama-real": make_config(
        "llama", vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=1024,
    ),
    "baichuan-tiny": _tiny("baichuan", position_embedding="alibi", norm_head=True),  # Baichuan2-13B style
    "qwen-tiny": _tiny("qwen"),
    "gpt3-tiny": _tiny("gpt3", intermediate_size=256),
    "bloom-tiny": _tiny("bloom", intermediate_size=256),
}


def known_model_names() -> list[str]:
    return sorted(ARCHITECTURES)


def parameter_count(config: ModelConfig) -> int:
    """Number of parameters of the whole (unsplit) model, from the architecture alone."""
    h, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    norm = h if config.norm_type == "rmsnorm" else 2 * h
    attention = 2 * h * h + 2 * h * kv
    if config.qkv_bias or config.linear_bias:
        attention += h + 2 * kv
    if config.linear_bias:
        attention += h
    mlp = (3 if config.uses_swiglu else 2) * h * inner
    if config.linear_bias:
        mlp += (2 * inner if config.uses_swiglu else inner) + h
    total = config.num_hidden_layers * (2 * norm + attention + mlp) + norm + vocab * h
    if config.position_embedding == "learned":
        total += config.max_position_embeddings * h
    if config.embedding_layernorm:
        total += 2 * h
    if not config.tie_word_embeddings:
        total += h * vocab
    return total


def resolve_model(name_or_path: str) -> tuple[ModelConfig, str | None]:
    """The architecture and, for a directory with weights, the weights file.

    Raises UsageError for a name that is neither built in nor a directory, and for a
    PaddleNLP/Hugging Face directory with weights (they need scripts/import_paddlenlp.py).
    """
    if name_or_path in ARCHITECTURES:
        return ARCHITECTURES[name_or_path].replace(), None
    if os.path.isdir(name_or_path):
        config_file = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(config_file):
            raise UsageError(f"model_name_or_path: directory {name_or_path} has no config.json")
        raw = read_config_json(config_file)
        config = config_from_dict(raw, source=config_file)
        weights_file = find_weights_file(name_or_path)
        if "family" not in raw and (weights_file or _has_foreign_weights(name_or_path)):
            raise UsageError(
                f"model_name_or_path: {name_or_path} holds weights in PaddleNLP/Hugging Face names; convert it once "
                f"with `python scripts/import_paddlenlp.py {name_or_path} OUT_DIR` and use OUT_DIR"
            )
        return config, weights_file
    names = ", ".join(known_model_names())
    raise UsageError(
        f"model_name_or_path: {name_or_path!r} is neither a built-in architecture nor a local directory "
        f"(models are never downloaded); built-in: {names}"
    )


def read_config_json(config_file: str) -> dict:
    try:
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"model_name_or_path: {config_file} is not valid JSON: {e.msg} at line {e.lineno}")
    if not isinstance(raw, dict):
        raise UsageError(f"model_name_or_path: {config_file} must hold a JSON object")
    return raw


WEIGHT_FILES = ("model_state.pdparams", "model.pdparams")
# Weight files of other layouts (sharded PaddleNLP, safetensors, PyTorch) in a PaddleNLP/HF directory.
FOREIGN_WEIGHT_FILES = ("model_state.pdparams.index.json", "model.safetensors", "model.safetensors.index.json",
                        "pytorch_model.bin", "pytorch_model.bin.index.json")


def find_weights_file(directory: str) -> str | None:
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def _has_foreign_weights(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in FOREIGN_WEIGHT_FILES)


# ----------------------------------------------------------------------------- config.json
# PaddleNLP / Hugging Face config.json keys that mean the same as ours under another name.
_KEY_ALIASES = {
    "rms_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps",
    "layer_norm_eps": "norm_eps",
    "n_layer": "num_hidden_layers",  # Bloom
    "n_head": "num_attention_heads",
    "n_embed": "hidden_size",
    "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "emb_dropout_prob": "hidden_dropout_prob",  # Qwen
    "attn_dropout_prob": "attention_probs_dropout_prob",
    "rotary_emb_base": "rope_theta",
}

# Run-time fields (seq_length, recompute, ...) come from the run's arguments, never from config.json.
_ARCHITECTURE_KEYS = set(ModelConfig.__dataclass_fields__) - set(RUNTIME_KEYS) - {"family"}
_MODEL_TYPE_TO_FAMILY = {"llama": "llama", "baichuan": "baichuan", "qwen": "qwen", "gpt": "gpt3", "bloom": "bloom"}
BAICHUAN2_VOCAB_SIZE = 125696


def config_from_dict(raw: dict, source: str) -> ModelConfig:
    """Our ModelConfig from our own config.json or a PaddleNLP/HF one of a supported family.

    Foreign configs are translated to our conventions: Qwen's doubled intermediate_size
    is halved, Bloom's 4h MLP and GPT's fixed LayerNorm epsilon / tanh GELU are made
    explicit, PaddleNLP LLaMA's `alibi` switch becomes position_embedding "alibi".
    """
    if "family" in raw:  # ours: the field names are ModelConfig's
        family = raw["family"]
        if family not in FAMILIES:
            raise UsageError(f"model_name_or_path: {source} has family {family!r}; supported: {', '.join(FAMILIES)}")
        sizes = {k: v for k, v in raw.items() if k in _ARCHITECTURE_KEYS}
        return _make(family, sizes, source)

    model_type = str(raw.get("model_type", "llama")).lower()
    family = _MODEL_TYPE_TO_FAMILY.get(model_type)
    if family is None:
        supported = ", ".join(sorted(_MODEL_TYPE_TO_FAMILY))
        raise UsageError(f"model_name_or_path: {source} has model_type {raw.get('model_type')!r}; "
                         f"supported: {supported}")
    sizes = {}
    for key, value in raw.items():
        key = _KEY_ALIASES.get(key, key)
        if key in _ARCHITECTURE_KEYS:
            sizes[key] = value

    def unsupported(what: str):
        raise UsageError(f"model_name_or_path: {source}: {what} is not supported by this toolkit's decoder")

    if model_type == "llama":
        if raw.get("alibi"):
            sizes["position_embedding"] = "alibi"
        if raw.get("rope_scaling_type"):
            unsupported(f"rope_scaling_type {raw['rope_scaling_type']!r}")
        # PaddleNLP runs Baichuan checkpoints as LlamaForCausalLM; ALiBi or a NormHead says it is one.
        if sizes.get("position_embedding") == "alibi" or raw.get("norm_head"):
            family = "baichuan"
    elif model_type == "baichuan":  # Hugging Face Baichuan / Baichuan2 (trust_remote_code models)
        # Their config.json does not name the position scheme or the head: the 13B models (ALiBi)
        # give only model_max_length, the 7B ones (rotary) also max_position_embeddings; only
        # Baichuan2 (vocabulary 125696) has the NormHead. PaddleNLP's conversions say "alibi".
        if raw.get("alibi") or "max_position_embeddings" not in raw:
            sizes["position_embedding"] = "alibi"
            sizes.setdefault("max_position_embeddings", raw.get("model_max_length", 4096))
        sizes.setdefault("norm_head", raw.get("vocab_size") == BAICHUAN2_VOCAB_SIZE)
    elif model_type == "qwen":
        # Qwen's intermediate_size counts both SwiGLU branches (QWenMLP uses intermediate_size // 2).
        if "intermediate_size" in raw:
            sizes["intermediate_size"] = raw["intermediate_size"] // 2
        heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
        if heads and hidden and raw.get("kv_channels", hidden // heads) * heads != hidden:
            unsupported(f"kv_channels {raw['kv_channels']} x num_attention_heads {heads} != hidden_size {hidden}")
        if raw.get("rotary_pct", 1.0) != 1.0:
            unsupported(f"rotary_pct {raw['rotary_pct']}")
        sizes["linear_bias"] = not raw.get("no_bias", True)  # c_proj / MLP biases when no_bias is false
        sizes.setdefault("max_position_embeddings", raw.get("seq_length", 8192))
    elif model_type == "gpt":
        # PaddleNLP's GPT fixes LayerNorm epsilon at 1e-5 and always uses GELU's tanh approximation.
        sizes["norm_eps"] = 1e-5
        activation = raw.get("hidden_activation", raw.get("hidden_act", "gelu"))
        if activation not in ("gelu", "gelu_new"):
            unsupported(f"hidden_activation {activation!r}")
        sizes["hidden_act"] = "gelu_tanh"
        if not raw.get("normalize_before", True):
            unsupported("normalize_before false (post-norm)")
        if raw.get("scale_qk_coeff", 1.0) != 1.0:
            unsupported(f"scale_qk_coeff {raw['scale_qk_coeff']}")
    elif model_type == "bloom":
        if raw.get("apply_residual_connection_post_layernorm"):
            unsupported("apply_residual_connection_post_layernorm")
        hidden = sizes.get("hidden_size", 64)
        sizes["intermediate_size"] = 4 * hidden
        sizes.setdefault("max_position_embeddings", raw.get("seq_length", 2048))
    return _make(family, sizes, source)


def _make(family: str, sizes: dict, source: str) -> ModelConfig:
    try:
        return make_config(family, **sizes)
    except TypeError as e:
        raise UsageError(f"model_name_or_path: {source} could not be read as a model config: {e}")
