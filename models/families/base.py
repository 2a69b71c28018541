"""What a family record holds (see models/families/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from models.config import ModelConfig


@dataclass(frozen=True)
class PaddleNLPClass:
    """The PaddleNLP (or Hugging Face) class that computes what the family does, for export and import.

    requires: ModelConfig values the class can express (a tuple: any of them); export refuses others.
    check: further limits of the class -> a one-line reason, or None when the config is exportable.
    export_table(config): our canonical names -> theirs (models/weight_names.Rule list).
    import_table(raw config.json, our config, names in their weights): theirs -> ours.
    config_json(config): the class's config.json for `config`.
    explicit_head: a tied head is written as an explicit lm_head (the class cannot tie it).
    """

    class_name: str
    model_type: str
    requires: dict
    export_table: Callable
    import_table: Callable
    config_json: Callable
    check: Callable[[ModelConfig], Optional[str]] = lambda config: None
    explicit_head: bool = False


@dataclass(frozen=True)
class HuggingFaceClass:
    """The Hugging Face transformers class that computes what the family does (llm_pretrain/checkpoint/hf_export.py).

    table(config): our canonical names -> Hugging Face's (models/paddlenlp_interop.Rule list; PyTorch
    [out, in] matrices: "_transpose" joins). Import reads the same table back (the family's
    paddlenlp.import_table recognizes Hugging Face's names).
    config_json(config): config.json as transformers writes it, without torch_dtype and the token ids
    (the exporter adds them).
    requires / check: as PaddleNLPClass: what the class can express.
    remote_code: the class is not in transformers but in the model repository's own code
    (trust_remote_code; config.json "auto_map" names it).
    published_copies(config): {name: the name it copies} of tensors published files hold twice (DeepSeek-V3's
    MTP layer); the import checks each copy's shape from the headers and reads none (models/hf_directory.py).
    """

    class_name: str
    model_type: str
    requires: dict
    table: Callable
    config_json: Callable
    check: Callable[[ModelConfig], Optional[str]] = lambda config: None
    remote_code: bool = False
    published_copies: Callable[[ModelConfig], dict] = lambda config: {}


@dataclass(frozen=True)
class ReferenceCase:
    """A tiny model of the reference implementation the tests compare against (tests/test_reference_parity.py).

    module.class_name(config_class(**kwargs)) computes what our `config` computes with the same weights.
    qkv_bias: the reference is PaddleNLP's LLaMA with biases given to its q/k/v projections (Qwen2 is
    LLaMA with q/k/v biases; PaddleNLP 2.8.1 has no Qwen2 class). rope_scaling: the reference's rotary
    tables are replaced by Llama 3.1's (computed in numpy by the test; PaddleNLP 2.8.1 has no such scaling).
    """

    class_name: str
    config_class: str
    kwargs: dict
    config: ModelConfig
    module: str = "paddlenlp.transformers"
    qkv_bias: bool = False
    rope_scaling: Optional[dict] = None


@dataclass(frozen=True)
class Family:
    """Everything that makes one family; models/families/<name>.py defines one as FAMILY."""

    name: str
    switches: dict                  # ModelConfig fields that make the family; registry entries add sizes
    scaled_output_init: bool        # o_proj / down_proj drawn with std initializer_range / sqrt(2 * layers)
    architectures: dict             # registry entries: name -> ModelConfig (published sizes, tiny presets)
    tiny: str                       # the CPU preset the parallel parity tests train
    model_types: tuple              # config.json model_type values read as this family
    read_config: Callable           # (raw config.json, sizes in our names, source) -> sizes (may set "family")
    paddlenlp: PaddleNLPClass
    hugging_face: Optional[HuggingFaceClass] = None  # None: no Hugging Face class (export refuses the family)
    reference_cases: dict = field(default_factory=dict)  # case name -> ReferenceCase
    export_case: tuple = ()         # (reference case, changes to its config) for the export tests
    required_keys: tuple = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size")

    def config(self, **sizes) -> ModelConfig:
        return ModelConfig(family=self.name, **{**self.switches, **sizes})


def unsupported(source: str, what: str):
    from models.errors import UsageError

    raise UsageError(f"model_name_or_path: {source}: {what} is not supported by this toolkit's decoder")


# transformers 5.24.0's MixtralConfig and Qwen3MoeConfig: attribute_map {"num_experts": "num_local_experts"}
# (models/mixtral, models/qwen3_moe configuration_*.py), so either spelling sets the count and 5.x's
# save_pretrained writes num_local_experts, also for Qwen3-MoE, whose 4.x files say num_experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def read_expert_count(raw: dict, source: str) -> Optional[int]:
    """The number of experts a Mixtral / Qwen3-MoE config.json gives in either spelling (None: neither)."""
    given = {key: raw[key] for key in EXPERT_COUNT_KEYS if raw.get(key) is not None}
    if len(set(given.values())) > 1:
        from models.errors import UsageError

        raise UsageError(f"model_name_or_path: {source}: num_experts {given['num_experts']} and num_local_experts "
                         f"{given['num_local_experts']} disagree (allowed: one of them, or both equal)")
    return next(iter(given.values()), None)


def no_grouped_query(c: ModelConfig) -> Optional[str]:
    """A PaddleNLPClass.check for classes without grouped-query attention (QWen, GPT, Bloom)."""
    if c.num_key_value_heads != c.num_attention_heads:
        return (f"grouped-query attention (num_key_value_heads {c.num_key_value_heads} != num_attention_heads "
                f"{c.num_attention_heads})")
    return None


def tiny_sizes(**extra) -> dict:
    """vocab 256, 4 heads, width 64, 2 layers: every size splits 2 ways."""
    return {**dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=176, max_position_embeddings=1024), **extra}


def reference_sizes(hidden=64, heads=4, kv_heads=None, inner=176) -> dict:
    """Our sizes of the tiny reference models (tests/test_reference_parity.py)."""
    return dict(vocab_size=256, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
