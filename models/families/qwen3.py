"""Qwen3 dense (Hugging Face model_type "qwen3", class Qwen3ForCausalLM).

Qwen2.5's blocks (RMSNorm, rotary positions with rope_theta 1e6, SwiGLU, grouped-query attention with
8 kv heads) with two changes: no q/k/v biases, and RMSNorm on every q and k head before the rotation
("qk layernorm", one [head_dim] weight each for q and k, shared by the heads: transformers'
Qwen3Attention q_norm / k_norm; ModelConfig.qk_norm). The head width is 128 at every size, set apart
from hidden_size / num_attention_heads (config.json "head_dim"; 0.6B: 16 heads x 128 = 2048 query
columns from a width of 1024). The word embedding is tied to the head in 0.6B, 1.7B and 4B.

Sizes are the published config.json files of Qwen/<name> on the Hugging Face hub (the post-trained
models; the -Base files have the same architecture). Every size: head_dim 128, vocab 151936,
rms_norm_eps 1e-06, rope_theta 1000000, max_position_embeddings 40960, attention_bias false,
use_sliding_window false.

Where each preset was checked ("a public copy": a verbatim copy found in a public repository not
named here; THUDM/slime's scripts/models/qwen3-*.sh as mirrored in zyzshishui/slime give Megatron's
names for the same values: --num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads,
--num-query-groups, --kv-channels 128, --qk-layernorm, --disable-bias-linear, --norm-epsilon 1e-6,
--rotary-base 1000000, --vocab-size 151936, --untie-embeddings-and-output-weights where untied):
  Qwen3-0.6B   config.json quoted verbatim in a comment (a public copy: "Constants for Qwen/Qwen3-0.6B
               (https://huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json)": 1024, 28 layers,
               16/8 heads, head_dim 128, 3072, 40960, eps 1e-06, theta 1000000); slime qwen3-0.6B.sh
  Qwen3-1.7B   slime qwen3-1.7B.sh (2048, 28, 16/8, 6144; tied)
  Qwen3-4B     slime qwen3-4B.sh (2560, 36, 32/8, 9728; tied); a public copy of its Qwen3Config
               (hidden 2560, head_dim 128, 9728, 40960, 36 layers, 8 kv heads, tie_word_embeddings True)
  Qwen3-8B     slime qwen3-8B.sh (4096, 36, 32/8, 12288, untied); the model card (8.2B parameters,
               6.95B non-embedding, 36 layers, 32 / 8 heads; a public copy of the card)
  Qwen3-14B    slime qwen3-14B.sh (5120, 40, 40/8, 17408, untied)
  Qwen3-32B    slime qwen3-32B.sh (5120, 64, 64/8, 25600); untied: the model card's 32.8B parameters
               (31.2B non-embedding) are the untied count (tests/test_qwen3.py)
  max_position_embeddings 40960 of 1.7B-32B: NOT verified file by file (the 0.6B and 4B copies say it)
The parameter counts the model cards state are checked by tests/test_qwen3.py.

PaddleNLP 2.8.1 has no Qwen3 class; PaddleFormers 0.4.1's Qwen3ForCausalLM is the reference
(scripts/verify_paddleformers.py, its own environment). Export writes that layout (model_type "qwen3",
"model." names, Paddle's [in, out] matrices, no lm_head when tied); import also reads Hugging Face's
model.safetensors (the same names, PyTorch's [out, in]).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, tiny_sizes, unsupported
from models.families.llama import HF_LLAMA_REQUIRES, hf_llama_config, is_hugging_face, llama_style_table, \
    read_rope
from models.weight_names import R, _attn

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", qk_norm=True)
VOCAB = 151936
HEAD_DIM = 128


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="qwen3", **{**SWITCHES, **sizes})


def _qwen3(hidden, layers, heads, kv_heads, intermediate, tied):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, attention_head_dim=HEAD_DIM, intermediate_size=intermediate,
                   vocab_size=VOCAB, max_position_embeddings=40960, tie_word_embeddings=tied, norm_eps=1e-6,
                   rope_theta=1e6)


ARCHITECTURES = {
    "Qwen/Qwen3-0.6B": _qwen3(1024, 28, 16, 8, 3072, tied=True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 28, 16, 8, 6144, tied=True),
    "Qwen/Qwen3-4B": _qwen3(2560, 36, 32, 8, 9728, tied=True),
    "Qwen/Qwen3-8B": _qwen3(4096, 36, 32, 8, 12288, tied=False),
    "Qwen/Qwen3-14B": _qwen3(5120, 40, 40, 8, 17408, tied=False),
    "Qwen/Qwen3-32B": _qwen3(5120, 64, 64, 8, 25600, tied=False),
    # CPU preset: head_dim 32 apart from hidden / heads (64 / 4 = 16), so that every layout meets
    # query and output projections wider than the hidden state, GQA 4:2 and a tied head (as 0.6B-4B).
    "qwen3-tiny": _config(**tiny_sizes(num_key_value_heads=2), attention_head_dim=32, tie_word_embeddings=True,
                          rope_theta=1e6),
    # Real-size CPU preset: above Paddle's size thresholds (stage 3 slices parameters above 2**20 elements:
    # the MLP matrices 1024 x 2816 = 2.9M, q_proj 1024 x 1024 (8 heads x 128); stage 2 keeps those above 2**23
    # out of its gradient buffer: the embedding and head 8320 x 1024 = 8.5M), head_dim 128 as published.
    "qwen3-real": _config(vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=4, attention_head_dim=HEAD_DIM, intermediate_size=2816,
                          max_position_embeddings=1024, rope_theta=1e6),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    """Qwen3Config's keys: head_dim (its default 128, whatever hidden / heads), no attention bias."""
    if raw.get("use_sliding_window"):
        unsupported(source, f"use_sliding_window true (sliding_window {raw.get('sliding_window')}; allowed: false)")
    if raw.get("attention_bias"):
        unsupported(source, "attention_bias true (allowed: false, Qwen3's published value)")
    sizes["attention_head_dim"] = int(raw.get("head_dim", HEAD_DIM))
    sizes["qk_norm"] = True
    read_rope(raw, sizes, source)  # rope_theta and rope_scaling, transformers 4.x or 5.x form
    sizes.setdefault("tie_word_embeddings", True)  # Qwen3Config's default; the published files say it
    return sizes


def qk_norm_rules(prefix: str) -> list:
    """q_norm / k_norm weights: the same names and [head_dim] vectors in every layout."""
    p = prefix + "layers.{i}."
    return [R(p + f"self_attn.{n}_norm.weight", _attn(f"{n}_norm.weight")) for n in "qk"]


def qwen3_table(config, transpose: bool = False) -> list:
    """PaddleFormers' and Hugging Face's Qwen3ForCausalLM: "model." names (transpose: PyTorch's [out, in]).
    lm_head is [vocab, hidden] in both (PaddleFormers 0.4.1's LMHead holds it so: nn/lm_head.py), ours [hidden,
    vocab]: always transposed."""
    table = [R("lm_head.weight", "lm_head.weight", "transpose") if rule.theirs == "lm_head.weight" else rule
             for rule in llama_style_table("model.", head=not config.tie_word_embeddings, transpose=transpose)]
    return table + qk_norm_rules("model.")


def is_hugging_face_layout(raw: dict, names=()) -> bool:
    """Hugging Face's files (PyTorch's [out, in] matrices) rather than PaddleFormers' ([in, out]): both name the
    tensors "model.", so the config.json tells them apart: transformers writes "transformers_version" /
    "torch_dtype" (and so does llm-export-hf), PaddleFormers' save_pretrained neither."""
    return is_hugging_face(names) and ("transformers_version" in raw or "torch_dtype" in raw)


def import_table(raw: dict, config, names=()) -> list:
    return qwen3_table(config, transpose=is_hugging_face_layout(raw, names))


def hf_qwen3_config(c) -> dict:
    """config.json of transformers' (and PaddleFormers') Qwen3ForCausalLM (Qwen3Config's keys)."""
    config = hf_llama_config(c, "Qwen3ForCausalLM", "qwen3")
    for key in ("pretraining_tp", "mlp_bias"):  # not Qwen3Config keys
        del config[key]
    return {**config, "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_hidden_layers}


QWEN3_REQUIRES = {**HF_LLAMA_REQUIRES, "qk_norm": True}

HF_QWEN3_CLASS = HuggingFaceClass(
    class_name="Qwen3ForCausalLM", model_type="qwen3", requires=QWEN3_REQUIRES,
    table=lambda c: qwen3_table(c, transpose=True), config_json=hf_qwen3_config,
)

FAMILY = Family(
    name="qwen3", switches=SWITCHES,
    # Every matrix N(0, initializer_range), o_proj and down_proj too: PaddleFormers' Qwen3PretrainedModel has no
    # _init_weights of its own (paddleformers/transformers/qwen3/modeling.py), nor scaled output projections.
    scaled_output_init=False,
    architectures=ARCHITECTURES, tiny="qwen3-tiny", model_types=("qwen3",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="Qwen3ForCausalLM", model_type="qwen3", requires=QWEN3_REQUIRES,
        export_table=lambda config: qwen3_table(config), import_table=import_table, config_json=hf_qwen3_config,
    ),
    hugging_face=HF_QWEN3_CLASS,
)
