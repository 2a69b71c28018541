"""ERNIE 4.5 dense (Hugging Face / PaddleFormers model_type "ernie4_5", class Ernie4_5ForCausalLM).

LLaMA's blocks (RMSNorm, SwiGLU, grouped-query attention, no biases: config.json "use_bias" false) with two
differences: the head width is set apart from hidden / heads (config.json "head_dim": 128 at 0.3B, where
1024 / 16 = 64), and the rotary embedding rotates interleaved pairs of each head (dims 2j and 2j + 1 at
frequency j; PaddleFormers 0.4.1 transformers/ernie4_5/modeling.py rotate_half / apply_rotary_pos_emb, the
same in transformers' modeling_ernie4_5.py). Our decoder rotates halves (dims j and j + d/2); the two are the
same function once q_proj's and k_proj's output columns are reordered within each head, which the weight
tables do (join "rope_pairs", models/paddlenlp_interop.py _rope_pairs), so the decoder is LLaMA's.

baidu/ERNIE-4.5-0.3B-Base-PT, its config.json values (the -PT and -Base-PT files share the architecture):
vocab 103424, hidden 1024, intermediate 3072, 18 layers, 16 query / 2 key-value heads, head_dim 128,
max_position_embeddings 131072, rms_norm_eps 1e-05, rope_theta 500000, use_bias false, tie_word_embeddings
true. Source: transformers' Ernie4_5Config defaults, documented there as the 0.3B configuration
("Initializing a Ernie4_5 0.3B style configuration", checkpoint baidu/ERNIE-4.5-0.3B-PT;
src/transformers/models/ernie4_5/configuration_ernie4_5.py, default_theta 500000.0). The model card's
"0.36B" parameters are the tied count of these values (360,748,032; tests/test_ernie4_5.py).

The mixture-of-experts models (baidu/ERNIE-4.5-21B-A3B-Base-PT, -300B-A47B-Base-PT, model_type
"ernie4_5_moe") are their own family, models/families/ernie4_5_moe.py, with this attention.

Not computed, refused in one line (`read_config`): use_bias true, a rope_scaling / rope_parameters other than
the default (models/rope.py), the vision parts of ERNIE 4.5 VL (another model_type, ernie4_5_moe_vl).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, tiny_sizes, unsupported
from models.families.llama import HF_LLAMA_REQUIRES, hf_llama_config, llama_style_table, read_rope
from models.families.qwen3 import is_hugging_face_layout
from models.weight_names import R

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu")
VOCAB = 103424
HEAD_DIM = 128


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="ernie4_5", **{**SWITCHES, **sizes})


ARCHITECTURES = {
    "baidu/ERNIE-4.5-0.3B-Base-PT": _config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18, num_attention_heads=16,
        num_key_value_heads=2, attention_head_dim=HEAD_DIM, max_position_embeddings=131072, norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True),
    # CPU preset: head_dim 32 apart from hidden / heads (64 / 4 = 16), GQA 4:2 and a tied head, as 0.3B.
    "ernie4_5-tiny": _config(**tiny_sizes(num_key_value_heads=2), attention_head_dim=32, tie_word_embeddings=True,
                             norm_eps=1e-5, rope_theta=500000.0),
    # Real-size CPU preset: above Paddle's size thresholds (stage 3 slices parameters above 2**20 elements: the
    # MLP matrices 1024 x 3072 = 3.1M, q_proj 1024 x 1024 (8 heads x 128); stage 2 keeps those above 2**23 out of
    # its gradient buffer: the tied embedding 8320 x 1024 = 8.5M), head_dim 128 as published.
    "ernie4_5-real": _config(vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=2, attention_head_dim=HEAD_DIM, intermediate_size=3072,
                             max_position_embeddings=1024, norm_eps=1e-5, rope_theta=500000.0,
                             tie_word_embeddings=True),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    """Ernie4_5Config's keys (PaddleFormers 0.4.1 transformers/ernie4_5/configuration.py, transformers')."""
    if raw.get("use_bias"):
        unsupported(source, "use_bias true (allowed: false, ERNIE 4.5's published value)")
    sizes["attention_head_dim"] = int(raw.get("head_dim") or HEAD_DIM)  # both classes' default 128
    read_rope(raw, sizes, source)  # rope_theta (500000 as published) and no scaling, either transformers form
    if (sizes["rope_scaling"] or {}).get("rope_type") == "yarn":  # not published for ERNIE 4.5, and not judged
        unsupported(source, "rope_scaling 'yarn' (allowed: none as published, linear or llama3)")
    sizes.setdefault("tie_word_embeddings", True)  # Ernie4_5Config's default; the 0.3B file says it
    return sizes


def ernie4_5_table(config, transpose: bool = False) -> list:
    """PaddleFormers' and Hugging Face's Ernie4_5ForCausalLM: "model." names (transpose: PyTorch's [out, in]),
    q_proj / k_proj in interleaved-pair order (module docstring), lm_head [vocab, hidden] in both."""
    pairs = "rope_pairs_transpose" if transpose else "rope_pairs"
    table = []
    for rule in llama_style_table("model.", head=not config.tie_word_embeddings, transpose=transpose):
        if rule.theirs == "lm_head.weight":
            rule = R("lm_head.weight", "lm_head.weight", "transpose")
        elif rule.theirs.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            rule = R(rule.theirs, rule.ours, pairs)
        table.append(rule)
    return table


def import_table(raw: dict, config, names=()) -> list:
    return ernie4_5_table(config, transpose=is_hugging_face_layout(raw, names))


def ernie4_5_config_json(c) -> dict:
    """config.json of Ernie4_5ForCausalLM (Ernie4_5Config's keys)."""
    config = hf_llama_config(c, "Ernie4_5ForCausalLM", "ernie4_5")
    for key in ("pretraining_tp", "mlp_bias", "attention_bias", "attention_dropout"):  # not Ernie4_5Config keys
        del config[key]
    return {**config, "use_bias": False}


ERNIE4_5_REQUIRES = dict(HF_LLAMA_REQUIRES)

FAMILY = Family(
    name="ernie4_5", switches=SWITCHES,
    # PaddleFormers' Ernie4_5ForCausalLM draws every matrix with one std (it replaces initializer_range by
    # sqrt(0.3333 / hidden_size), transformers/ernie4_5/modeling.py), without scaled output projections.
    scaled_output_init=False,
    architectures=ARCHITECTURES, tiny="ernie4_5-tiny", model_types=("ernie4_5",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="Ernie4_5ForCausalLM", model_type="ernie4_5", requires=ERNIE4_5_REQUIRES,
        export_table=lambda config: ernie4_5_table(config), import_table=import_table,
        config_json=ernie4_5_config_json,
    ),
    # transformers' Ernie4_5ForCausalLM (the same names and interleaved rotation; not run against transformers
    # here: no transformers environment on this machine)
    hugging_face=HuggingFaceClass(
        class_name="Ernie4_5ForCausalLM", model_type="ernie4_5", requires=ERNIE4_5_REQUIRES,
        table=lambda c: ernie4_5_table(c, transpose=True), config_json=ernie4_5_config_json,
    ),
)
