"""Baichuan and Baichuan2 (the sizes PaddleNLP lists: 7B and 13B, Base and Chat).

LLaMA's blocks; the 7B models use rotary positions, the 13B models ALiBi; Baichuan2 normalizes the
rows of its output head (NormHead). PaddleNLP runs them as LlamaForCausalLM (13B: config "alibi": true);
Hugging Face's checkpoints (model_type "baichuan", trust_remote_code) pack q/k/v into W_pack.

Checked: Baichuan-13B (hidden 5120, 40 layers, 40 heads, intermediate 13696, model_max_length 4096 and no
max_position_embeddings, rms_norm_eps 1e-06, vocab 64000) against a fine-tune's copy of the 13B config.json
(DISC-FinLLM) [stored GitHub index id 45597557903]; Baichuan2-7B (4096, 32, 32, 11008, max_position_embeddings
and model_max_length 4096, 1e-06, vocab 125696) against mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py
"baichuan" and a logged BaichuanConfig (a public copy). Baichuan-7B: a converted copy only (a public copy);
Baichuan2-13B: not checked against its own file (its sizes are the 13B ones, its vocabulary Baichuan2's).
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, ReferenceCase, reference_sizes, tiny_sizes
from models.families.llama import LLAMA_CLASS, llama_style_table
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_WEIGHTS, R, _attn, _mlp

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu")
BAICHUAN2_VOCAB_SIZE = 125696


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="baichuan", **{**SWITCHES, **sizes})


def _baichuan(hidden, layers, heads, intermediate, vocab, alibi=False, norm_head=False):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=4096, norm_eps=1e-6,
                   position_embedding="alibi" if alibi else "rope", norm_head=norm_head)


ARCHITECTURES = {
    "baichuan-inc/Baichuan-7B": _baichuan(4096, 32, 32, 11008, vocab=64000),
    "baichuan-inc/Baichuan-13B-Base": _baichuan(5120, 40, 40, 13696, vocab=64000, alibi=True),
    "baichuan-inc/Baichuan-13B-Chat": _baichuan(5120, 40, 40, 13696, vocab=64000, alibi=True),
    "baichuan-inc/Baichuan2-7B-Base": _baichuan(4096, 32, 32, 11008, vocab=BAICHUAN2_VOCAB_SIZE, norm_head=True),
    "baichuan-inc/Baichuan2-7B-Chat": _baichuan(4096, 32, 32, 11008, vocab=BAICHUAN2_VOCAB_SIZE, norm_head=True),
    "baichuan-inc/Baichuan2-13B-Base": _baichuan(5120, 40, 40, 13696, vocab=BAICHUAN2_VOCAB_SIZE, alibi=True,
                                                 norm_head=True),
    "baichuan-inc/Baichuan2-13B-Chat": _baichuan(5120, 40, 40, 13696, vocab=BAICHUAN2_VOCAB_SIZE, alibi=True,
                                                 norm_head=True),
    "baichuan-tiny": _config(**tiny_sizes(), position_embedding="alibi", norm_head=True),  # Baichuan2-13B style
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    """Hugging Face Baichuan / Baichuan2 config.json (model_type "baichuan").

    It does not name the position scheme or the head: the 13B models (ALiBi) give only
    model_max_length, the 7B ones (rotary) also max_position_embeddings; only Baichuan2
    (vocabulary 125696) has the NormHead. PaddleNLP's conversions say "alibi".
    """
    if raw.get("alibi") or "max_position_embeddings" not in raw:
        sizes["position_embedding"] = "alibi"
        sizes.setdefault("max_position_embeddings", raw.get("model_max_length", 4096))
    sizes.setdefault("norm_head", raw.get("vocab_size") == BAICHUAN2_VOCAB_SIZE)
    return sizes


def hf_baichuan_table() -> list:
    """Hugging Face Baichuan/Baichuan2 (import only): LLaMA with W_pack = [q; k; v], PyTorch [out, in] layout."""
    p = "model.layers.{i}."
    return [
        R("model.embed_tokens.weight", "embeddings.word_embeddings.weight"),
        R(p + "input_layernorm.weight", INPUT_NORM + ".weight"),
        R(p + "self_attn.W_pack.weight", QKV_WEIGHTS, "concat_transpose"),
        R(p + "self_attn.o_proj.weight", _attn("o_proj.weight"), "transpose"),
        R(p + "post_attention_layernorm.weight", POST_ATTENTION_NORM + ".weight"),
        *[R(p + f"mlp.{n}.weight", _mlp(f"{n}.weight"), "transpose") for n in ("gate_proj", "up_proj", "down_proj")],
        R("model.norm.weight", "norm.weight"),
        R("lm_head.weight", "lm_head.weight", "transpose"),
    ]


def hf_baichuan_config(c) -> dict:
    """config.json of Baichuan's own Hugging Face code (trust_remote_code; the model repositories' files).

    The 13B models (ALiBi) give only model_max_length, the 7B ones (rotary) also max_position_embeddings:
    that is how their code and read_config above tell them apart. "norm_head" is not a key of theirs
    (Baichuan2's code always has its NormHead); it is kept for the way back."""
    return dict(
        architectures=["BaichuanForCausalLM"], model_type="baichuan",
        auto_map={"AutoConfig": "configuration_baichuan.BaichuanConfig",
                  "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads, hidden_act="silu",
        model_max_length=c.max_position_embeddings,
        **({} if c.position_embedding == "alibi" else {"max_position_embeddings": c.max_position_embeddings}),
        initializer_range=c.initializer_range, rms_norm_eps=c.norm_eps, use_cache=True, tie_word_embeddings=False,
        **({"norm_head": True} if c.norm_head else {}),
    )


def hf_check(c):
    if c.num_key_value_heads != c.num_attention_heads:
        return "grouped-query attention (Baichuan's W_pack holds q, k and v of equal width)"
    if c.position_embedding == "rope" and (c.rope_theta != 10000.0 or c.rope_scaling):
        return f"rope_theta {c.rope_theta} / rope_scaling (Baichuan's rotary code fixes the base at 10000)"
    return None


def import_table(raw: dict, config, names=()) -> list:
    # A "baichuan" config.json over weights in PaddleNLP's LLaMA names is PaddleNLP's own conversion.
    if any(n.startswith("llama.") for n in names):
        return llama_style_table(fuse_qkv=bool(raw.get("fuse_attention_qkv")),
                                 fuse_ffn=bool(raw.get("fuse_attention_ffn")))
    return hf_baichuan_table()


REFERENCE_CASES = {
    # Baichuan-13B: PaddleNLP's LLaMA with alibi=True; 6 heads exercise the non-power-of-2 slopes (13B has 40)
    "baichuan13b_alibi": ReferenceCase(
        "LlamaForCausalLM", "LlamaConfig",
        dict(vocab_size=256, hidden_size=96, intermediate_size=176, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=6, max_position_embeddings=64, alibi=True),
        _config(**reference_sizes(96, 6), position_embedding="alibi")),
}

FAMILY = Family(
    name="baichuan", switches=SWITCHES, scaled_output_init=True,  # as LLaMA (PaddleNLP runs it as LLaMA)
    architectures=ARCHITECTURES, tiny="baichuan-tiny", model_types=("baichuan",), read_config=read_config,
    # Export: PaddleNLP's LlamaForCausalLM; import of model_type "baichuan": Hugging Face's W_pack layout
    paddlenlp=dataclasses.replace(LLAMA_CLASS, import_table=import_table),
    # Export: Baichuan's own layout (W_pack); a NormHead is written normalized, as to PaddleNLP
    hugging_face=HuggingFaceClass(
        class_name="BaichuanForCausalLM", model_type="baichuan",
        requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding=("rope", "alibi"),
                      linear_bias=False, qkv_bias=False, embedding_layernorm=False, tie_word_embeddings=False),
        table=lambda config: hf_baichuan_table(), config_json=hf_baichuan_config, check=hf_check, remote_code=True,
    ),
    reference_cases=REFERENCE_CASES, export_case=("baichuan13b_alibi", dict(norm_head=True)),  # ALiBi + NormHead
)
