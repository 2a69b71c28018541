"""Qwen1.5-MoE and Qwen2-MoE (Hugging Face model_type "qwen2_moe", class Qwen2MoeForCausalLM).

Qwen2's blocks (q/k/v biases, rope_theta 1e6, untied head) with a fine-grained mixture of
experts in every layer: num_experts SwiGLU experts of width moe_intermediate_size, the top
num_experts_per_tok of them per token weighted by their router probabilities as they are
(norm_topk_prob false: not renormalized), plus one shared expert of width
shared_expert_intermediate_size that every token goes through, scaled by sigmoid(x w) of its
own gate (models/moe.py). The load-balancing loss is Mixtral's (router_aux_loss_coef 0.001).

Sizes are the published config.json files (Qwen/<name> on the Hugging Face hub):
  Qwen1.5-MoE-A2.7B  the -Chat-GPTQ-Int4 file (same architecture; a public copy): 2048, 24 layers,
                     16/16 heads, intermediate 5632, moe_intermediate 1408, 60 experts, top 4,
                     norm_topk_prob false, decoder_sparse_step 1; shared_expert_intermediate_size 5632,
                     vocab 151936, 8192 positions, eps 1e-06, theta 1e6: transformers' Qwen2MoeConfig
                     defaults, which are this model's (a public copy of the mindnlp port); the parameter
                     count 14,315,784,192 ("14.3B parameters in total", the model card) is checked by
                     tests/test_moe.py
  Qwen2-57B-A14B     3584, 28 layers, 28/4 heads, intermediate 18944, moe_intermediate 2560, 64 experts,
                     top 8, shared 20480, 131072 positions, eps 1e-06, theta 1e6: NOT verified here (no
                     copy of the file found; from the Qwen2 technical report's table of the MoE model)
Layers other than MoE ones (decoder_sparse_step > 1, mlp_only_layers) are refused: every published
file makes every layer sparse.

PaddleNLP 2.8.1 has no Qwen2-MoE class: export writes the layout of PaddleNLP 3's
Qwen2MoeForCausalLM ("qwen2_moe." names, Paddle's [in, out] matrices), import also reads Hugging
Face's model.safetensors ("model." names, PyTorch's [out, in]).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, reference_sizes, tiny_sizes, \
    unsupported
from models.families.llama import is_hugging_face, read_rope
from models.families.mixtral import reference_kwargs
from models.families.qwen2 import HF_QWEN2_CLASS, hf_qwen2_config
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, QKV_BIASES, R, _attn, _mlp

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", qkv_bias=True,
                norm_topk_prob=False, router_aux_loss_coef=0.001)
VOCAB = 151936


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="qwen2_moe", **{**SWITCHES, **sizes})


def _qwen2_moe(hidden, layers, heads, kv_heads, intermediate, moe_intermediate, shared, experts, top_k, positions):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
                   shared_expert_intermediate_size=shared, num_experts=experts, num_experts_per_tok=top_k,
                   vocab_size=VOCAB, max_position_embeddings=positions, norm_eps=1e-6, rope_theta=1e6)


ARCHITECTURES = {
    "Qwen/Qwen1.5-MoE-A2.7B": _qwen2_moe(2048, 24, 16, 16, 5632, 1408, 5632, 60, 4, 8192),
    "Qwen/Qwen2-57B-A14B": _qwen2_moe(3584, 28, 28, 4, 18944, 2560, 20480, 64, 8, 131072),
    # CPU preset: 16 fine-grained experts of width 32, top 4, a shared expert of width 64.
    "qwen2-moe-tiny": _config(**tiny_sizes(num_key_value_heads=2), moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                              rope_theta=1e6, router_aux_loss_coef=0.02),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if raw.get("use_sliding_window"):
        unsupported(source, f"use_sliding_window true (sliding_window {raw.get('sliding_window')})")
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        unsupported(source, f"dense layers between the MoE ones (decoder_sparse_step {raw.get('decoder_sparse_step')}, "
                            f"mlp_only_layers {raw.get('mlp_only_layers')})")
    sizes.setdefault("num_experts", 60)  # Qwen2MoeConfig's defaults
    sizes.setdefault("num_experts_per_tok", 4)
    sizes.setdefault("moe_intermediate_size", 1408)
    sizes.setdefault("shared_expert_intermediate_size", 5632)
    sizes.setdefault("norm_topk_prob", False)
    sizes.setdefault("tie_word_embeddings", False)
    read_rope(raw, sizes, source)
    return sizes


def qwen2_moe_table(config, prefix: str = "qwen2_moe.", transpose: bool = False) -> list:
    p = prefix + "layers.{i}."
    same = "transpose" if transpose else "same"
    mlp = ("gate_proj", "up_proj", "down_proj")
    return [
        R(prefix + "embed_tokens.weight", "embeddings.word_embeddings.weight"),
        R(p + "input_layernorm.weight", INPUT_NORM + ".weight"),
        *[R(p + f"self_attn.{n}_proj.weight", _attn(f"{n}_proj.weight"), same) for n in "qkvo"],
        *[R(p + f"self_attn.{n}_proj.bias", b) for n, b in zip("qkv", QKV_BIASES)],
        R(p + "post_attention_layernorm.weight", POST_ATTENTION_NORM + ".weight"),
        R(p + "mlp.gate.weight", _mlp("gate.weight"), same),
        *[R(p + f"mlp.experts.{e}.{n}.weight", _mlp(f"experts.{e}.{n}.weight"), same)
          for e in range(config.num_experts) for n in mlp],
        *[R(p + f"mlp.shared_expert.{n}.weight", _mlp(f"shared_expert.{n}.weight"), same) for n in mlp],
        R(p + "mlp.shared_expert_gate.weight", _mlp("shared_expert_gate.weight"), same),
        R(prefix + "norm.weight", "norm.weight"),
        *([R("lm_head.weight", "lm_head.weight", same)] if not config.tie_word_embeddings else []),
    ]


def import_table(raw: dict, config, names=()) -> list:
    if is_hugging_face(names):
        return qwen2_moe_table(config, "model.", transpose=True)
    return qwen2_moe_table(config)


def config_json(c) -> dict:
    return dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, initializer_range=c.initializer_range, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.expert_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=c.router_aux_loss_coef, output_router_logits=True,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, hidden_act="silu",
        tie_word_embeddings=c.tie_word_embeddings, use_sliding_window=False,
        **({"rope_scaling": dict(c.rope_scaling)} if c.rope_scaling else {}),
    )


# ----------------------------------------------------------------------------- Hugging Face (export)
def hf_qwen2_moe_config(c) -> dict:
    """config.json of transformers' Qwen2MoeForCausalLM (Qwen2MoeConfig's keys): Qwen2's and the experts'.
    Every layer sparse (decoder_sparse_step 1, no mlp_only_layers), as this family's decoder is."""
    config = hf_qwen2_config(c)
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", qkv_bias=True,
                  moe_intermediate_size=c.expert_intermediate_size,
                  shared_expert_intermediate_size=c.shared_expert_intermediate_size, num_experts=c.num_experts,
                  num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=c.router_aux_loss_coef,
                  output_router_logits=c.router_aux_loss_coef > 0)
    return config


def check_hf_qwen2_moe_class(c):
    if not c.shared_expert_intermediate_size:
        return "no shared expert: Qwen2MoeForCausalLM always has one (shared_expert_intermediate_size > 0)"
    return None


# As Mixtral's: the import reads these names back; transformers 5 stacks the experts in memory but reads and
# writes per-expert gate_proj / up_proj / down_proj (its conversion_mapping.py "qwen2_moe" entry).
HF_QWEN2_MOE_CLASS = HuggingFaceClass(
    class_name="Qwen2MoeForCausalLM", model_type="qwen2_moe", requires=HF_QWEN2_CLASS.requires,
    table=lambda c: qwen2_moe_table(c, "model.", transpose=True), config_json=hf_qwen2_moe_config,
    check=check_hf_qwen2_moe_class,
)

FAMILY = Family(
    name="qwen2_moe", switches=SWITCHES,
    scaled_output_init=True,  # as Qwen2 (LLaMA's initialization; the experts' down_proj too)
    architectures=ARCHITECTURES, tiny="qwen2-moe-tiny", model_types=("qwen2_moe",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="Qwen2MoeForCausalLM", model_type="qwen2_moe",
        requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding="rope", qkv_bias=True,
                      linear_bias=False, embedding_layernorm=False, norm_head=False),
        export_table=lambda config: qwen2_moe_table(config), import_table=import_table, config_json=config_json,
    ),
    hugging_face=HF_QWEN2_MOE_CLASS,
    reference_cases={
        # PaddleNLP 2.8.1's MixtralForCausalLM given what Qwen2-MoE adds (tests/test_reference_parity.py):
        # q/k/v biases, a shared expert (width 64) behind a sigmoid gate, top-k weights not renormalized.
        "qwen2_moe": ReferenceCase(
            "MixtralForCausalLM", "MixtralConfig", reference_kwargs(num_experts_per_tok=4, rms_norm_eps=1e-6),
            _config(**reference_sizes(kv_heads=2, inner=88), moe_intermediate_size=88, num_experts=8, num_experts_per_tok=4,
                    shared_expert_intermediate_size=64, norm_eps=1e-6, rope_theta=1e6, router_aux_loss_coef=0.02),
            qkv_bias=True),
    },
    export_case=("qwen2_moe", {}),
)
