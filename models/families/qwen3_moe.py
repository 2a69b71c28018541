"""Qwen3-MoE (Hugging Face model_type "qwen3_moe", class Qwen3MoeForCausalLM).

Qwen3's attention (no q/k/v biases, RMSNorm on every q and k head, head_dim 128 apart from
hidden / heads; models/families/qwen3.py) with a fine-grained mixture of experts in every layer
(models/moe.py): 128 SwiGLU experts of width moe_intermediate_size, the top 8 per token weighted by
their router probabilities renormalized to sum 1 (norm_topk_prob true), no shared expert. The
load-balancing loss is the Switch / Mixtral form (router_aux_loss_coef 0.001 as published).

Sizes are the published config.json files (Qwen/<name> on the Hugging Face hub). Both: head_dim 128,
128 experts, top 8, norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [] (every layer
sparse), router_aux_loss_coef 0.001, vocab 151936, rms_norm_eps 1e-06, rope_theta 1000000,
max_position_embeddings 40960, untied head.
  Qwen3-30B-A3B    2048, 48 layers, 32 / 4 heads, intermediate 6144 (no dense layer uses it),
                   moe_intermediate 768: THUDM/slime scripts/models/qwen3-30B-A3B.sh (mirrored in
                   zyzshishui/slime: --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
                   --num-attention-heads 32 --num-query-groups 4 --kv-channels 128 --qk-layernorm
                   --moe-ffn-hidden-size 768 --moe-router-topk 8 --num-experts 128 --moe-layer-freq
                   [1]*48 --moe-router-score-function softmax --untie-embeddings-and-output-weights);
                   the model card: 30.5B parameters, 3.3B activated (tests/test_qwen3.py)
  Qwen3-235B-A22B  4096, 94 layers, 64 / 4 heads, intermediate 12288, moe_intermediate 1536: slime
                   scripts/models/qwen3-235B-A22B.sh (every layer MoE); the model card: 235B, 22B
                   activated
  router_aux_loss_coef 0.001 and max_position_embeddings 40960: NOT verified against a copy of the
  files (transformers' Qwen3MoeConfig default and the dense sizes' value)

What this decoder cannot express is refused in one line (`read_config`): dense layers between the
MoE ones (decoder_sparse_step > 1, mlp_only_layers), a sliding window, attention biases.

Qwen's "global-batch load balancing" (the experts' pick frequencies summed over the data-parallel ranks
before the load-balancing loss, Qiu et al. 2025) is the run's `moe_global_batch_balance` key.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, read_expert_count, tiny_sizes, unsupported
from models.families.qwen3 import HEAD_DIM, QWEN3_REQUIRES, hf_qwen3_config, qk_norm_rules
from models.families.qwen3 import read_config as read_qwen3_config
from models.families.qwen2_moe import qwen2_moe_table
from models.weight_names import R

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", qk_norm=True,
                norm_topk_prob=True, router_aux_loss_coef=0.001)
VOCAB = 151936


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="qwen3_moe", **{**SWITCHES, **sizes})


def _qwen3_moe(hidden, layers, heads, kv_heads, intermediate, moe_intermediate):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, attention_head_dim=HEAD_DIM, intermediate_size=intermediate,
                   moe_intermediate_size=moe_intermediate, num_experts=128, num_experts_per_tok=8, vocab_size=VOCAB,
                   max_position_embeddings=40960, norm_eps=1e-6, rope_theta=1e6)


ARCHITECTURES = {
    "Qwen/Qwen3-30B-A3B": _qwen3_moe(2048, 48, 32, 4, 6144, 768),
    "Qwen/Qwen3-235B-A22B": _qwen3_moe(4096, 94, 64, 4, 12288, 1536),
    # CPU preset: 16 experts of width 32, top 4 renormalized, no shared expert; head_dim 32 apart from
    # hidden / heads (64 / 4), GQA 4:2, untied head (as published).
    "qwen3-moe-tiny": _config(**tiny_sizes(num_key_value_heads=2), attention_head_dim=32, moe_intermediate_size=32,
                              num_experts=16, num_experts_per_tok=4, rope_theta=1e6, router_aux_loss_coef=0.02),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        unsupported(source, f"dense layers between the MoE ones (decoder_sparse_step {raw.get('decoder_sparse_step')}, "
                            f"mlp_only_layers {raw.get('mlp_only_layers')}; allowed: decoder_sparse_step 1 and "
                            f"mlp_only_layers [], every layer sparse as published)")
    if raw.get("shared_expert_intermediate_size"):
        unsupported(source, f"shared_expert_intermediate_size {raw['shared_expert_intermediate_size']} "
                            f"(Qwen3-MoE has no shared expert; allowed: 0 or absent)")
    sizes = read_qwen3_config(raw, sizes, source)
    count = read_expert_count(raw, source)  # transformers 5 writes num_local_experts (models/families/base.py)
    if count is not None:
        sizes["num_experts"] = count
    sizes.setdefault("num_experts", 128)  # Qwen3MoeConfig's defaults
    sizes.setdefault("num_experts_per_tok", 8)
    sizes.setdefault("moe_intermediate_size", 768)
    sizes.setdefault("norm_topk_prob", False)  # Qwen3MoeConfig's default; the published files say true
    sizes.setdefault("router_aux_loss_coef", 0.001)
    sizes["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    return sizes


def qwen3_moe_table(config, transpose: bool = False) -> list:
    """PaddleFormers' and Hugging Face's Qwen3MoeForCausalLM: Qwen2-MoE's names without the shared expert,
    plus the q/k norms."""
    rules = [r for r in qwen2_moe_table(config, "model.", transpose) if "shared_expert" not in r.theirs
             and ".bias" not in r.theirs]
    # lm_head [vocab, hidden] in PaddleFormers too (models/families/qwen3.py qwen3_table)
    rules = [R("lm_head.weight", "lm_head.weight", "transpose") if r.theirs == "lm_head.weight" else r for r in rules]
    return rules + qk_norm_rules("model.")


def import_table(raw: dict, config, names=()) -> list:
    from models.families.qwen3 import is_hugging_face_layout

    return qwen3_moe_table(config, transpose=is_hugging_face_layout(raw, names))


def hf_qwen3_moe_config(c) -> dict:
    """config.json of Qwen3MoeForCausalLM (Qwen3MoeConfig's keys): Qwen3's and the experts'."""
    return {**hf_qwen3_config(c), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": c.expert_intermediate_size, "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": c.router_aux_loss_coef,
            "output_router_logits": c.router_aux_loss_coef > 0}


def check_qwen3_moe_class(c):
    if c.shared_expert_intermediate_size:
        return "a shared expert: Qwen3MoeForCausalLM has none (shared_expert_intermediate_size 0)"
    return None


HF_QWEN3_MOE_CLASS = HuggingFaceClass(
    class_name="Qwen3MoeForCausalLM", model_type="qwen3_moe", requires=QWEN3_REQUIRES,
    table=lambda c: qwen3_moe_table(c, transpose=True), config_json=hf_qwen3_moe_config, check=check_qwen3_moe_class,
)

FAMILY = Family(
    name="qwen3_moe", switches=SWITCHES,
    scaled_output_init=False,  # as Qwen3 (models/families/qwen3.py)
    architectures=ARCHITECTURES, tiny="qwen3-moe-tiny", model_types=("qwen3_moe",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="Qwen3MoeForCausalLM", model_type="qwen3_moe", requires=QWEN3_REQUIRES,
        export_table=lambda config: qwen3_moe_table(config), import_table=import_table,
        config_json=hf_qwen3_moe_config, check=check_qwen3_moe_class,
    ),
    hugging_face=HF_QWEN3_MOE_CLASS,
)
