"""Named architectures with their real hyperparameters, and loading a model directory.

`model_name_or_path` is either a name below or a local directory holding a
`config.json` (and optionally weights):

* our own config.json (it has a "family" key), as written by
  scripts/import_paddlenlp.py, with `model_state.pdparams` in our canonical
  parameter names -- such a directory can be trained from (continue_training);
* a Hugging Face directory (config.json in the 4.x or 5.x form, model.safetensors or a sharded
  index): trained from directly, its weights mapped by name as they are read (models/hf_directory.py);
  `llm-import-hf` converts it once for those who want a directory of ours;
* a PaddleNLP config.json (model_type llama, baichuan, qwen, qwen2, gpt, bloom): its architecture
  is read here (see `config_from_dict`), but its .pdparams use PaddleNLP's names, so a directory
  that holds them must be converted once with scripts/import_paddlenlp.py.

The entries come from the family records (models/families/<family>.py), which give
their sources. Names follow PaddleNLP's (its hub ids, "gpt3-1.3B-en" style for GPT-3);
sizes are the published ones.
"""

from __future__ import annotations

import json
import os

from models.errors import UsageError, closest_matches
from models.config import RUNTIME_KEYS, ModelConfig
from models.families import FAMILIES, FAMILY_NAMES, family_for_model_type, get_family, supported_model_types
from models.families.hf_config_keys import check_config_keys

# Every family's entries (models/families/<family>.py), in family order.
ARCHITECTURES: dict[str, ModelConfig] = {
    name: config for family in FAMILIES.values() for name, config in family.architectures.items()
}


def make_config(family: str, **sizes) -> ModelConfig:
    """A config of `family` (its record's switches) with the given sizes."""
    return get_family(family).config(**sizes)


def known_model_names() -> list[str]:
    return sorted(ARCHITECTURES)


def parameter_count(config: ModelConfig) -> int:
    """Number of parameters of the whole (unsplit) model, from the architecture alone."""
    h, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.num_key_value_heads * config.head_dim
    norm = h if config.norm_type == "rmsnorm" else 2 * h
    attention = 2 * h * q + 2 * h * kv  # q and o_proj, k and v
    if config.qkv_bias or config.linear_bias:
        attention += q + 2 * kv
    if config.linear_bias:
        attention += h
    if config.qk_norm:  # Qwen3's q_norm and k_norm: one [head_dim] weight each
        attention += 2 * config.head_dim
    if config.uses_mla:  # models/mla.py: the latent projections, their norms, the up-projections, o_proj
        c, heads = config, config.num_attention_heads
        attention = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
                     + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
                     + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    mlp = (3 if config.uses_swiglu else 2) * h * inner
    if config.linear_bias:
        mlp += (2 * inner if config.uses_swiglu else inner) + h
    dense_mlp = mlp
    if config.is_moe:  # router + experts (+ the shared expert and its gate); models/moe.py
        mlp = h * config.num_experts + config.num_experts * 3 * h * config.expert_intermediate_size
        if config.shared_expert_intermediate_size:
            mlp += 3 * h * config.shared_expert_intermediate_size + (h if config.shared_expert_gate else 0)
        if config.has_correction_bias:  # DeepSeek-V3's and ERNIE 4.5's correction bias (models/deepseek_moe.py)
            mlp += config.num_experts
    moe_layers = config.moe_layer_count
    total = (config.num_hidden_layers * (2 * norm + attention) + moe_layers * mlp
             + (config.num_hidden_layers - moe_layers) * dense_mlp + norm + vocab * h)
    if config.num_nextn_predict_layers:  # DeepSeek-V3's MTP module: 3 norms, eh_proj and one (MoE) block
        last = config.num_hidden_layers
        total += 3 * norm + 2 * h * h + 2 * norm + attention + (mlp if config.is_moe_layer(last) else dense_mlp)
    if config.position_embedding == "learned":
        total += config.max_position_embeddings * h
    if config.embedding_layernorm:
        total += 2 * h
    if not config.tie_word_embeddings:
        total += h * vocab
    return total


def activated_parameter_count(config: ModelConfig) -> int:
    """Parameters one token passes through: all but the experts it is not routed to (a mixture of experts'
    "A3B" / "activated" figure; the whole count for a dense model)."""
    idle_experts = config.num_experts - config.num_experts_per_tok if config.is_moe else 0
    mlp_matrices = 3 if config.uses_swiglu else 2
    moe_layers = config.moe_layer_count + (1 if config.num_nextn_predict_layers and config.is_moe else 0)
    return parameter_count(config) - moe_layers * idle_experts * mlp_matrices * config.hidden_size \
        * config.expert_intermediate_size


def resolve_model(name_or_path: str) -> tuple[ModelConfig, str | None]:
    """The architecture and, for a directory with weights, the weights file (ours: model_state.pdparams;
    a Hugging Face directory: its model.safetensors or model.safetensors.index.json).

    Raises UsageError for a name that is neither built in nor a directory, and for a PaddleNLP
    directory with weights (they need scripts/import_paddlenlp.py).
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
        if "family" not in raw:
            from models.hf_directory import SafetensorsFiles, hf_config_for_weights, hf_weights_file

            hf_weights = hf_weights_file(name_or_path)
            if hf_weights:  # a Hugging Face directory: trained from directly (models/hf_directory.py)
                return hf_config_for_weights(config, SafetensorsFiles(hf_weights).names()), hf_weights
            if weights_file or _has_foreign_weights(name_or_path):
                raise UsageError(
                    f"model_name_or_path: {name_or_path} holds weights in PaddleNLP names (or PyTorch's "
                    f"pytorch_model.bin); convert it once with `python scripts/import_paddlenlp.py {name_or_path} "
                    "OUT_DIR` and use OUT_DIR (a Hugging Face directory with model.safetensors trains as it is)"
                )
        return config, weights_file
    raise UsageError(unknown_model_message(name_or_path))


LIST_MODELS_COMMAND = "llm-plan models"  # every built-in name with its family and size (llm_pretrain/cli/plan.py)


def unknown_model_message(name: str, n: int = 5) -> str:
    """One line: `name` is not a model here, its `n` closest built-in names, and the command listing them all."""
    names = known_model_names()
    # A hub name also answers to its part after the "/" (Llama-3.1-8B finds meta-llama/Llama-3.1-8B).
    spellings = {**{full.split("/")[-1]: full for full in names}, **{full: full for full in names}}
    closest = closest_matches(name, spellings, n=n, cutoff=0.6)
    hint = f"; closest built-in names: {', '.join(closest)}" if closest else ""
    return (f"model_name_or_path: {name!r} is neither a built-in architecture nor a local directory (models are "
            f"never downloaded){hint}; `{LIST_MODELS_COMMAND}` lists all {len(names)}")


def built_in_models() -> list[dict]:
    """Every built-in name, by family (FAMILY_NAMES order) then size: name, family, parameters, weights_needed.

    A built-in name is an architecture only (models/families/<family>.py): no weights come with it, and a run
    starts from a random initialization, so no weights file is needed (`resolve_model` returns none for it).
    Training from weights needs a local directory instead (continue_training; PaddleNLP/HF weights converted
    once with scripts/import_paddlenlp.py).
    """
    rows = []
    for family in FAMILIES.values():
        entries = [(parameter_count(config), name) for name, config in family.architectures.items()]
        for count, name in sorted(entries):
            rows.append({"name": name, "family": family.name, "parameters": count, "weights_needed": False})
    return rows


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


def config_from_dict(raw: dict, source: str) -> ModelConfig:
    """Our ModelConfig from our own config.json or a PaddleNLP/HF one of a supported family.

    Foreign configs are read by their family's record (models/families/<family>.py, `read_config`),
    which translates them to our conventions: Qwen's doubled intermediate_size is halved, Bloom's
    4h MLP and GPT's fixed LayerNorm epsilon / tanh GELU are made explicit, PaddleNLP LLaMA's
    `alibi` switch becomes position_embedding "alibi" (a Baichuan), Llama 3.1's rope_scaling is kept.
    """
    if "family" in raw:  # ours: the field names are ModelConfig's
        family = raw["family"]
        if family not in FAMILIES:
            raise UsageError(f"model_name_or_path: {source} has family {family!r}; "
                             f"supported: {', '.join(FAMILY_NAMES)}{_closest_note(family, FAMILY_NAMES)}")
        sizes = {k: v for k, v in raw.items() if k in _ARCHITECTURE_KEYS}
        return _make(family, sizes, source)

    model_type = str(raw.get("model_type", "llama")).lower()
    record = family_for_model_type(model_type)
    if record is None:
        raise UsageError(f"model_name_or_path: {source} has model_type {raw.get('model_type')!r}; supported: "
                         f"{', '.join(supported_model_types())}{_closest_note(model_type, supported_model_types())}")
    check_config_keys(raw, model_type, source)  # a value the decoder cannot compute: one line naming the key
    sizes = {}
    for key, value in raw.items():
        key = _KEY_ALIASES.get(key, key)
        if key in _ARCHITECTURE_KEYS:
            sizes[key] = value
    sizes = record.read_config(raw, sizes, source)
    return _make(sizes.pop("family", record.name), sizes, source)


def _closest_note(value: str, supported) -> str:
    """" (closest: 'x')" for the supported value closest to `value` (difflib, as unknown argument keys), else "".

    Said as the closest, not "did you mean": a model type that is near one of ours by spelling (mistral,
    qwen3) is often another architecture, which changing the word would not make readable."""
    nearest = closest_matches(str(value), supported, n=1, cutoff=0.6)
    return f" (closest: {nearest[0]!r})" if nearest else ""


def _make(family: str, sizes: dict, source: str) -> ModelConfig:
    missing = [key for key in get_family(family).required_keys if key not in sizes]
    if missing:
        aliases = "".join(f" or {alias!r}" for alias, key in _KEY_ALIASES.items() if key == missing[0])
        raise UsageError(f"model_name_or_path: {source} has no {missing[0]!r}{aliases}, which a {family} model "
                         f"needs (required: {', '.join(get_family(family).required_keys)})")
    try:
        return get_family(family).config(**sizes)
    except TypeError as e:
        raise UsageError(f"model_name_or_path: {source} could not be read as a model config: {e}")
