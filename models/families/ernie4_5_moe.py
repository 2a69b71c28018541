"""ERNIE 4.5 mixture of experts (model_type "ernie4_5_moe", class Ernie4_5_MoeForCausalLM): published values and
parameter counts only. NOT a family of this decoder yet: config.json files of this model_type are refused in one
line (models/registry.py: not a supported model_type), and nothing here is trained.

What the text model computes (PaddleFormers 0.4.1 transformers/ernie4_5_moe/modeling.py, nn/moe/):
  attention    ERNIE 4.5's (models/families/ernie4_5.py: interleaved rotary pairs, head_dim, no biases)
  layers       layer i is MoE when (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <=
               moe_layer_end_index (-1: the last layer); the others a dense SwiGLU MLP of intermediate_size
  router       mlp.gate.weight [hidden, E] (float32), probs = softmax(x W); the top moe_k experts are chosen on
               probs + e_score_correction_bias (mlp.moe_statics.e_score_correction_bias [1, E], not trained by
               the gradient: moe_use_aux_free), but weighted by probs alone, renormalized to sum 1 (clip
               moe_norm_min 1e-12) (nn/moe/moe_allgather_layer.py fused_gate_logits_process_fused)
  shared       moe_num_shared_experts > 0: one SwiGLU MLP of width moe_intermediate_size x moe_num_shared_experts,
               added without a gate (MOEAllGatherLayerV2.forward: combined_output += shared_experts(input))
What this decoder lacks for it: dense layers before / between the MoE ones, routing on biased scores with
unbiased weights, an ungated shared expert, and the correction bias as a checkpointed non-trained tensor.
PaddleFormers' MoE layer does not run on CPU either (expand_modality_expert_id and
moe_gate_dispatch_partial_nosoftmaxtopk have GPU kernels only), so its parity needs CPU stand-ins of them.

Published values (config.json keys):
  baidu/ERNIE-4.5-21B-A3B-Base-PT   transformers' Ernie4_5_MoeConfig defaults, documented there as "similar to
      baidu/ERNIE-4.5-21B-A3B-PT" (src/transformers/models/ernie4_5_moe/configuration_ernie4_5_moe.py)
  baidu/ERNIE-4.5-300B-A47B-Base-PT a public copy of its config.json as a test fixture (MindIE's atb_llm
      tests of ernie_moe: hidden 8192, 28672, 54 layers, 64 / 8 heads, 64 experts, 0 shared, layers 3-53,
      moe_intermediate 3584, moe_k 8, tie_word_embeddings true); NOT checked against the hub file. head_dim:
      absent there, hidden / heads = 128.
The counts these values imply (`parameter_counts`, tests/test_ernie4_5.py): 21B-A3B 21,825,437,888 total /
3,352,150,208 activated (the cards' "21B total, 3B activated" cut, not rounded); 300B-A47B 298,636,913,856 /
47,079,337,152 (the cards' "300B", "47B").
"""

from __future__ import annotations

COMMON = dict(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"], vocab_size=103424,
              hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0,
              use_bias=False, moe_layer_interval=1, tie_word_embeddings=True)

PUBLISHED = {
    "baidu/ERNIE-4.5-21B-A3B-Base-PT": dict(
        COMMON, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20,
        num_key_value_heads=4, head_dim=128, moe_num_experts=64, moe_k=6, moe_intermediate_size=1536,
        moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1),
    "baidu/ERNIE-4.5-300B-A47B-Base-PT": dict(
        COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=54, num_attention_heads=64,
        num_key_value_heads=8, moe_num_experts=64, moe_k=8, moe_intermediate_size=3584, moe_num_shared_experts=0,
        moe_layer_start_index=3, moe_layer_end_index=53),
}


def moe_layers(raw: dict) -> list[int]:
    """The MoE layers' indices, as Ernie4_5_MoeDecoderLayer.__init__ chooses them."""
    layers = raw["num_hidden_layers"]
    end = layers - 1 if raw.get("moe_layer_end_index", -1) == -1 else raw["moe_layer_end_index"]
    interval = raw.get("moe_layer_interval", 1)
    return [i for i in range(layers) if (i + 1) % interval == 0 and raw.get("moe_layer_start_index", 1) <= i <= end]


def parameter_counts(raw: dict) -> tuple[int, int]:
    """(total, activated per token) parameters of the text model these config.json values make: embedding (and
    an untied head), attention, norms, dense MLPs, and per MoE layer the router, its [E] correction bias, the
    experts (moe_k of them activated) and the shared expert. No multi-token-prediction layers (the Base-PT
    checkpoints' text model; num_nextn_predict_layers is a training option)."""
    h, vocab, layers = raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"]
    d = raw.get("head_dim") or h // raw["num_attention_heads"]
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
    embedding = vocab * h * (1 if raw.get("tie_word_embeddings", True) else 2)
    attention = 2 * h * q + 2 * h * kv
    swiglu = lambda width: 3 * h * width  # noqa: E731
    experts, k, width = raw["moe_num_experts"], raw["moe_k"], raw["moe_intermediate_size"]
    shared = swiglu(width * raw.get("moe_num_shared_experts", 0)) if raw.get("moe_num_shared_experts") else 0
    router = h * experts + experts  # gate weight and e_score_correction_bias
    sparse = len(moe_layers(raw))
    base = embedding + layers * (attention + 2 * h) + h + (layers - sparse) * swiglu(raw["intermediate_size"])
    total = base + sparse * (router + experts * swiglu(width) + shared)
    activated = base + sparse * (router + k * swiglu(width) + shared)
    return total, activated
