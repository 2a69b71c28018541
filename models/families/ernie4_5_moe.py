"""ERNIE 4.5 mixture of experts, the text model (model_type "ernie4_5_moe", class Ernie4_5_MoeForCausalLM).

ERNIE 4.5's attention (models/families/ernie4_5.py: interleaved rotary pairs reordered by the weight table,
head_dim apart, no biases, tied head) with this decoder's mixture of experts in some layers:
  layers       layer i is MoE when (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <=
               moe_layer_end_index (-1: the last layer); the others a dense SwiGLU MLP of intermediate_size
               (ours: first_k_dense_replace = moe_layer_start_index, moe_layer_interval, moe_layer_end_index;
               models/config.py is_moe_layer)
  router       probs = softmax(x W_gate) in float32; the top moe_k experts are chosen on probs +
               e_score_correction_bias (a [1, E] tensor the optimizer does not train: moe_use_aux_free), but
               weighted by probs alone, renormalized (sum clipped at moe_norm_min 1e-12): models/deepseek_moe.py
               with router_score "softmax" and router_correction_bias
  shared       moe_num_shared_experts > 0: one SwiGLU MLP of width moe_intermediate_size x moe_num_shared_experts,
               added without a gate (shared_expert_gate false)
Sources: transformers 5.24.0 models/ernie4_5_moe/modeling_ernie4_5_moe.py (Ernie4_5_MoeTopKRouter,
Ernie4_5_MoeSparseMoeBlock, Ernie4_5_MoeDecoderLayer), 4.57.6 the same; PaddleFormers 0.4.1
transformers/ernie4_5_moe/modeling.py and nn/moe/moe_allgather_layer.py fused_gate_logits_process_fused.
Judged against transformers (scripts/verify_hf_import.py, case ernie4_5_moe, both config.json forms) and
PaddleFormers 0.4.1 both ways (scripts/verify_paddleformers.py; its names are transformers 4's with [in, out]
matrices). Its MoE layer calls kernels Paddle registers on GPU only (expand_modality_expert_id,
moe_gate_dispatch_partial_nosoftmaxtopk, moe_combine): that judge runs on CPU with stand-ins of just those
(scripts/paddleformers_cpu_kernels.py, from the CUDA sources). Text model only: the vision experts
(ernie4_5_moe_vl) are another model_type, refused.

The correction bias moves by the run's moe_bias_update_rate (DeepSeek-V3's rule, models/deepseek_moe.py; ERNIE's
own update rule in PaddleFormers is not compared). Load balancing: router_aux_loss_coef as transformers'
(0.001, the Mixtral form transformers adds only with output_router_logits).

Refused in one line (`read_config`, models/families/hf_config_keys.py): use_bias true, a moe_layer_interval
below 1, moe_num_experts not set (a dense file), a rope scaling other than none / linear / llama3, and
num_nextn_predict_layers above 0 (PaddleFormers' MTP block, which its own default of 1 adds to its saves).

Published values (config.json keys):
  baidu/ERNIE-4.5-21B-A3B-Base-PT   transformers' Ernie4_5_MoeConfig defaults, documented there as "similar to
      baidu/ERNIE-4.5-21B-A3B-PT" (src/transformers/models/ernie4_5_moe/configuration_ernie4_5_moe.py)
  baidu/ERNIE-4.5-300B-A47B-Base-PT a public copy of its config.json as a test fixture (MindIE's atb_llm
      tests of ernie_moe: hidden 8192, 28672, 54 layers, 64 / 8 heads, 64 experts, 0 shared, layers 3-53,
      moe_intermediate 3584, moe_k 8, tie_word_embeddings true); NOT checked against the hub file. head_dim:
      absent there, hidden / heads = 128.
The counts these values imply (`parameter_counts`, tests/test_ernie4_5.py; the registry's count of the built-in
architectures is the same, tests/test_ernie4_5_moe.py): 21B-A3B 21,825,437,888 total / 3,352,150,208 activated
(the cards' "21B total, 3B activated" cut, not rounded); 300B-A47B 298,636,913,856 / 47,079,337,152 (the cards'
"300B", "47B").
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, tiny_sizes, unsupported
from models.families.ernie4_5 import ERNIE4_5_REQUIRES, ernie4_5_config_json, ernie4_5_table
from models.families.ernie4_5 import read_config as read_ernie4_5
from models.families.qwen3 import is_hugging_face_layout
from models.weight_names import R

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


# ----------------------------------------------------------------------------- the family
SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", router_correction_bias=True,
                shared_expert_gate=False, norm_topk_prob=True, router_aux_loss_coef=0.001)
MOE_DEFAULTS = dict(moe_num_experts=64, moe_k=6, moe_intermediate_size=1536, moe_num_shared_experts=2,
                    moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1)  # Ernie4_5_MoeConfig's


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="ernie4_5_moe", **{**SWITCHES, **sizes})


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    """Ernie4_5_MoeConfig's keys into ours (ERNIE 4.5's attention keys as the dense family reads them)."""
    read_ernie4_5(raw, sizes, source)
    value = {key: raw.get(key, default) for key, default in MOE_DEFAULTS.items()}
    for key, alias in (("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok")):
        # Ernie4_5_MoeConfig's attribute_map aliases (never written by save_pretrained; read if a file has them)
        if raw.get(alias) is not None:
            if key in raw and raw[key] != raw[alias]:
                unsupported(source, f"{alias} {raw[alias]!r} and {key} {raw[key]!r} disagree (allowed: one of them, "
                                    "or both equal)")
            value[key] = raw[alias]
    if not isinstance(value["moe_num_experts"], int) or value["moe_num_experts"] < 1:
        unsupported(source, f"moe_num_experts {value['moe_num_experts']!r} (allowed: one positive count; a list is "
                            "ERNIE 4.5 VL's text and vision experts)")
    if not isinstance(value["moe_layer_interval"], int) or value["moe_layer_interval"] < 1:
        unsupported(source, f"moe_layer_interval {value['moe_layer_interval']!r} (allowed: a positive integer)")
    layers, end = int(raw["num_hidden_layers"]), value["moe_layer_end_index"]
    if end < -1:
        unsupported(source, f"moe_layer_end_index {end} (allowed: -1 for the last layer, or a layer index)")
    sizes.update(num_experts=value["moe_num_experts"], num_experts_per_tok=value["moe_k"],
                 moe_intermediate_size=value["moe_intermediate_size"],
                 shared_expert_intermediate_size=value["moe_num_shared_experts"] * value["moe_intermediate_size"],
                 first_k_dense_replace=value["moe_layer_start_index"], moe_layer_interval=value["moe_layer_interval"],
                 # transformers writes the last layer's index for -1 (Ernie4_5_MoeConfig.__post_init__): one config
                 moe_layer_end_index=-1 if end >= layers - 1 else end)
    return sizes


def _published(name: str) -> ModelConfig:
    raw = PUBLISHED[name]
    sizes = dict(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                 num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
                 num_key_value_heads=raw["num_key_value_heads"], max_position_embeddings=raw["max_position_embeddings"],
                 norm_eps=raw["rms_norm_eps"], tie_word_embeddings=raw["tie_word_embeddings"])
    return _config(**read_config(raw, sizes, name))


ARCHITECTURES = {
    **{name: _published(name) for name in PUBLISHED},
    # CPU preset: ERNIE 4.5's attention (head_dim 32 apart from 64 / 4, GQA 4:2, tied); layer 0 dense, layer 1 MoE
    # (start 1 as 21B-A3B; interval 2 keeps layer 1), 8 experts top 2, 2 shared (width 64)
    "ernie4_5_moe-tiny": _config(**tiny_sizes(num_key_value_heads=2), attention_head_dim=32,
                                 tie_word_embeddings=True, norm_eps=1e-5, rope_theta=500000.0, num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                 first_k_dense_replace=1, moe_layer_interval=2),
    # Real-size CPU preset: above Paddle's thresholds (the tied embedding 8320 x 1024 = 8.5M > 2**23; each expert's
    # matrices 1024 x 1536 = 1.6M > 2**20, the dense layer's 1024 x 3072), head_dim 128 as published; layer 0
    # dense, layer 1 MoE (4 experts top 2, one shared)
    "ernie4_5_moe-real": _config(vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=2, attention_head_dim=128, intermediate_size=3072,
                                 max_position_embeddings=1024, norm_eps=1e-5, rope_theta=500000.0,
                                 tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=1536, shared_expert_intermediate_size=1536,
                                 first_k_dense_replace=1),
}


def ernie4_5_moe_table(config, transpose: bool = False) -> list:
    """transformers' (and PaddleFormers') Ernie4_5_MoeForCausalLM: ERNIE 4.5's attention names, then per layer
    the dense MLP or mlp.gate (the router), mlp.moe_statics.e_score_correction_bias [1, E], mlp.experts.{e} and
    mlp.shared_experts (transformers 5 stacks the experts in memory but reads and writes these per-expert names:
    its conversion_mapping.py "ernie4_5_moe" entry)."""
    same = "transpose" if transpose else "same"
    swiglu = ("gate_proj", "up_proj", "down_proj")
    table = [rule for rule in ernie4_5_table(config, transpose) if ".mlp." not in rule.theirs]
    for i in range(config.num_hidden_layers):
        theirs, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        if not config.is_moe_layer(i):
            table += [R(f"{theirs}{n}.weight", f"{ours}{n}.weight", same) for n in swiglu]
            continue
        table += [R(f"{theirs}gate.weight", f"{ours}gate.weight", same),
                  R(f"{theirs}moe_statics.e_score_correction_bias", f"{ours}e_score_correction_bias", "row"),
                  *[R(f"{theirs}experts.{e}.{n}.weight", f"{ours}experts.{e}.{n}.weight", same)
                    for e in range(config.num_experts) for n in swiglu]]
        if config.shared_expert_intermediate_size:
            table += [R(f"{theirs}shared_experts.{n}.weight", f"{ours}shared_expert.{n}.weight", same) for n in swiglu]
    return table


def import_table(raw: dict, config, names=()) -> list:
    return ernie4_5_moe_table(config, transpose=is_hugging_face_layout(raw, names))


def config_json(c) -> dict:
    """config.json of Ernie4_5_MoeForCausalLM (Ernie4_5_MoeConfig's keys)."""
    config = ernie4_5_config_json(c)
    config.update(architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", moe_num_experts=c.num_experts,
                  moe_k=c.num_experts_per_tok, moe_intermediate_size=c.expert_intermediate_size,
                  moe_num_shared_experts=c.shared_expert_intermediate_size // c.expert_intermediate_size,
                  moe_layer_start_index=c.first_k_dense_replace, moe_layer_end_index=c.moe_layer_end_index,
                  moe_layer_interval=c.moe_layer_interval, moe_norm_min=1e-12,
                  router_aux_loss_coef=c.router_aux_loss_coef, output_router_logits=c.router_aux_loss_coef > 0)
    return config


def paddleformers_config_json(c) -> dict:
    """PaddleFormers 0.4.1's Ernie4_5_MoeConfig defaults num_nextn_predict_layers to 1 (ERNIE 4.5's MTP; its
    configuration.py): a file without the key builds an MTP block this text model has no weights for, and its
    criterion drops each sequence's last label (nn/criterion/sft_loss.py). No MTP here: 0, said."""
    return {**config_json(c), "num_nextn_predict_layers": 0}


def check_class(c):
    if c.shared_expert_intermediate_size % c.expert_intermediate_size:
        return "a shared expert whose width is not a multiple of moe_intermediate_size (moe_num_shared_experts)"
    return None


REQUIRES = dict(ERNIE4_5_REQUIRES, router_score="softmax", router_correction_bias=True, shared_expert_gate=False,
                norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, seq_aux_loss_coef=0.0)

FAMILY = Family(
    name="ernie4_5_moe", switches=SWITCHES,
    scaled_output_init=False,  # as ERNIE 4.5 dense (models/families/ernie4_5.py)
    architectures=ARCHITECTURES, tiny="ernie4_5_moe-tiny", model_types=("ernie4_5_moe",), read_config=read_config,
    # PaddleFormers 0.4.1's class: the same names, [in, out] matrices (judged on CPU with stand-ins of its GPU-only
    # kernels: scripts/verify_paddleformers.py)
    paddlenlp=PaddleNLPClass(
        class_name="Ernie4_5_MoeForCausalLM", model_type="ernie4_5_moe", requires=REQUIRES,
        export_table=lambda config: ernie4_5_moe_table(config), import_table=import_table,
        config_json=paddleformers_config_json, check=check_class,
    ),
    hugging_face=HuggingFaceClass(
        class_name="Ernie4_5_MoeForCausalLM", model_type="ernie4_5_moe", requires=REQUIRES,
        table=lambda c: ernie4_5_moe_table(c, transpose=True), config_json=config_json, check=check_class,
    ),
)
