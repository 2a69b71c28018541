"""DeepSeek-V3 (Hugging Face model_type "deepseek_v3", class DeepseekV3ForCausalLM).

Multi-head latent attention (models/mla.py) with YaRN rope scaling; the first first_k_dense_replace layers a
dense SwiGLU MLP, the others DeepSeek's mixture of experts (models/deepseek_moe.py): sigmoid router with a
correction bias that only chooses, group-limited top-k, renormalized weights times routed_scaling_factor, one
ungated shared expert; auxiliary-loss-free balancing (the run's moe_bias_update_rate), the sequence-wise
balance loss (seq_aux_loss_coef) and one multi-token-prediction module (models/decoder.py MTPLayer).

Sizes: the published config.json of deepseek-ai/DeepSeek-V3 and deepseek-ai/DeepSeek-V3-Base (the same file
for both on the Hugging Face hub): hidden_size 7168, intermediate_size 18432, moe_intermediate_size 2048,
num_hidden_layers 61, first_k_dense_replace 3, moe_layer_freq 1, num_attention_heads 128, num_key_value_heads
128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8, n_group 8, topk_group 4,
routed_scaling_factor 2.5, norm_topk_prob true, scoring_func "sigmoid", topk_method "noaux_tc",
vocab_size 129280, tie_word_embeddings false, rope_theta 10000, rope_scaling {"type": "yarn", "factor": 40,
"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim":
1.0}, max_position_embeddings 163840, rms_norm_eps 1e-06, num_nextn_predict_layers 1, hidden_act "silu",
attention_bias false. Its parameters without the MTP module: 671,026,419,200 (the model card's "671B total";
tests/test_deepseek_v3.py). Training values from the DeepSeek-V3 report (arXiv 2412.19437) sec. 4.2:
bias update speed 0.001 (0.0 for the last 500B tokens), balance factor alpha 0.0001, MTP weight 0.3 (0.1 after
the first 10T tokens).

What the decoder cannot express is refused in one line (`read_config`): another scoring function or topk
method, an MTP depth above 1, a dense-layer pattern other than the first k, attention biases, no q_lora_rank.
PaddleFormers 0.4.1's DeepseekV3ForCausalLM is the reference (scripts/verify_paddleformers.py); Hugging Face
transformers' DeepseekV3ForCausalLM (4.57 and 5.24) judges the export and the import (scripts/verify_hf_export.py,
scripts/verify_hf_import.py). transformers has no MTP module: it ignores the published layer 61 (its
_keys_to_ignore_on_load_unexpected), and a directory it writes holds no MTP layer (models/hf_directory.py
hf_config_for_weights: trained without MTP, with a note).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, unsupported
from models.rope import read_rope_config
from models.weight_names import R

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", router_score="sigmoid",
                shared_expert_gate=False, norm_topk_prob=True, router_aux_loss_coef=0.0, seq_aux_loss_coef=0.0001,
                mtp_loss_weight=0.3)
PUBLISHED_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="deepseek_v3", **{**SWITCHES, **sizes})


def _published() -> ModelConfig:
    return _config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   num_experts=256, shared_expert_intermediate_size=2048, num_experts_per_tok=8, n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, rope_theta=10000.0, rope_scaling=dict(PUBLISHED_YARN),
                   max_position_embeddings=163840, norm_eps=1e-6, num_nextn_predict_layers=1)


def _cpu(**sizes) -> ModelConfig:
    """A CPU preset with every switch on: latent attention with YaRN (factor 4 over 256 positions), one dense
    layer then MoE layers of 8 experts in 4 groups (top 2 of 2 groups), a shared expert, MTP."""
    base = dict(num_key_value_heads=sizes["num_attention_heads"], first_k_dense_replace=1, num_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=10000.0,
                rope_scaling={**PUBLISHED_YARN, "factor": 4, "original_max_position_embeddings": 256},
                max_position_embeddings=1024, norm_eps=1e-6, num_nextn_predict_layers=1)
    return _config(**{**base, **sizes})


ARCHITECTURES = {
    "deepseek-ai/DeepSeek-V3": _published(),
    "deepseek-ai/DeepSeek-V3-Base": _published(),
    "deepseek-v3-tiny": _cpu(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
    # real size: the embedding and the head 8320 x 1024 = 8.5M elements (above 2**23), as llama-real
    "deepseek-v3-real": _cpu(vocab_size=8320, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                             num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                             qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=256,
                             shared_expert_intermediate_size=256),
}

READ_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
             "num_nextn_predict_layers", "moe_intermediate_size", "num_experts_per_tok")


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    """DeepseekV3Config's keys into ours; what the decoder cannot compute is refused in one line naming the key."""
    checks = [("scoring_func", raw.get("scoring_func", "sigmoid"), ("sigmoid",)),
              ("topk_method", raw.get("topk_method", "noaux_tc"), ("noaux_tc",)),
              ("num_nextn_predict_layers", raw.get("num_nextn_predict_layers", 0), (0, 1)),
              ("moe_layer_freq", raw.get("moe_layer_freq", 1), (1,)),
              ("attention_bias", raw.get("attention_bias", False), (False,)),
              ("hidden_act", raw.get("hidden_act", "silu"), ("silu",))]
    for key, value, allowed in checks:
        if value not in allowed:
            unsupported(source, f"{key} {value!r} (allowed: {', '.join(repr(a) for a in allowed)})")
    if not raw.get("q_lora_rank"):
        unsupported(source, f"q_lora_rank {raw.get('q_lora_rank')!r} (a plain q_proj, DeepSeek-V2-Lite's; "
                            "allowed: a positive rank)")
    if raw.get("n_routed_experts", 0) % raw.get("n_group", 1):
        unsupported(source, f"n_group {raw.get('n_group')} (must divide n_routed_experts {raw.get('n_routed_experts')})")
    for key in READ_KEYS:
        if key in raw:
            sizes[key] = raw[key]
    if "num_attention_heads" in sizes:  # latent attention: a key per query head (hf_config_keys: no effect)
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sizes["num_experts"] = raw.get("n_routed_experts", 0)
    sizes["shared_expert_intermediate_size"] = raw.get("n_shared_experts", 0) * raw.get("moe_intermediate_size", 0)
    sizes["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    theta, scaling = read_rope_config(raw, source, yarn=True)
    if theta is not None:
        sizes["rope_theta"] = theta
    if scaling and scaling["rope_type"] == "yarn":
        # PaddleFormers' (and transformers') frequencies take max_position_embeddings / original as the factor,
        # the softmax scale `factor` itself: one model only when both agree (DeepSeek-V3: 163840 / 4096 = 40)
        ratio = raw.get("max_position_embeddings", 0) / scaling["original_max_position_embeddings"]
        if ratio != scaling["factor"]:
            unsupported(source, f"rope_scaling.factor {scaling['factor']} with max_position_embeddings / "
                                f"original_max_position_embeddings {ratio} (allowed: equal, as published)")
    elif scaling:
        unsupported(source, f"rope_scaling {scaling['rope_type']!r} (allowed: yarn or none)")
    sizes["rope_scaling"] = scaling
    return sizes


# ----------------------------------------------------------------------------- PaddleFormers' names
MLA_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
SWIGLU = ("gate_proj", "up_proj", "down_proj")


def _block_rules(config, theirs: str, ours: str, moe: bool, same: str) -> list:
    rules = [R(f"{theirs}input_layernorm.weight", f"{ours}input_layernorm.weight"),
             R(f"{theirs}post_attention_layernorm.weight", f"{ours}post_attention_layernorm.weight"),
             *[R(f"{theirs}self_attn.{n}.weight", f"{ours}self_attn.{n}.weight", same) for n in MLA_NAMES],
             *[R(f"{theirs}self_attn.{n}.weight", f"{ours}self_attn.{n}.weight") for n in ("q_a_layernorm", "kv_a_layernorm")]]
    if not moe:
        return rules + [R(f"{theirs}mlp.{n}.weight", f"{ours}mlp.{n}.weight", same) for n in SWIGLU]
    return rules + [
        R(f"{theirs}mlp.gate.weight", f"{ours}mlp.gate.weight", same),
        R(f"{theirs}mlp.gate.e_score_correction_bias", f"{ours}mlp.e_score_correction_bias"),
        *[R(f"{theirs}mlp.experts.{e}.{n}.weight", f"{ours}mlp.experts.{e}.{n}.weight", same)
          for e in range(config.num_experts) for n in SWIGLU],
        *[R(f"{theirs}mlp.shared_experts.{n}.weight", f"{ours}mlp.shared_expert.{n}.weight", same) for n in SWIGLU],
    ]


def deepseek_v3_table(config, transpose: bool = False) -> list:
    """PaddleFormers 0.4.1's DeepseekV3ForCausalLM ("model." names; [in, out] matrices as it saves them, lm_head
    [vocab, hidden]); the MTP module is its layer num_hidden_layers (enorm, hnorm, eh_proj, the block), whose
    output goes through the main model.norm (ours: the MTP's own norm, given the same weight) and whose eh_proj
    takes [hidden; embedding] (ours [embedding; hidden]: the halves swapped)."""
    same = "transpose" if transpose else "same"
    rules = [R("model.embed_tokens.weight", "embeddings.word_embeddings.weight")]
    for i in range(config.num_hidden_layers):
        rules += _block_rules(config, f"model.layers.{i}.", f"layers.{i}.", config.is_moe_layer(i), same)
    if config.num_nextn_predict_layers:
        n = config.num_hidden_layers
        rules += _block_rules(config, f"model.layers.{n}.", "mtp.block.", config.is_moe_layer(n), same)
        rules += [R(f"model.layers.{n}.enorm.weight", "mtp.enorm.weight"),
                  R(f"model.layers.{n}.hnorm.weight", "mtp.hnorm.weight"),
                  R(f"model.layers.{n}.eh_proj.weight", "mtp.eh_proj.weight", "swap_halves" + ("_transpose" if transpose else "")),
                  R("model.norm.weight", "mtp.norm.weight")]  # before the main norm's rule: export writes that one
    rules.append(R("model.norm.weight", "norm.weight"))
    if not config.tie_word_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight", "transpose"))
    return rules


def hf_deepseek_v3_table(config) -> list:
    """Hugging Face's names (transformers' DeepseekV3ForCausalLM, [out, in] matrices; the hub's per-expert
    mlp.experts.<e>.gate_proj/up_proj/down_proj, which transformers 5 stacks when it loads them: its
    conversion_mapping.py maps deepseek_v3 to qwen2_moe's). The MTP module as the published files hold it
    (deepseek-ai/DeepSeek-V3 model.safetensors.index.json, layer 61; vLLM's deepseek_mtp.py reads it): layer
    num_hidden_layers with enorm, hnorm, eh_proj on [embedding; hidden] (ours too: no swap), the block and
    shared_head.norm (its own norm). The published copies of the embedding and the head in that layer
    (embed_tokens, shared_head.head) are not written: ours are shared with the main model's."""
    rules = [R("model.embed_tokens.weight", "embeddings.word_embeddings.weight")]
    for i in range(config.num_hidden_layers):
        rules += _block_rules(config, f"model.layers.{i}.", f"layers.{i}.", config.is_moe_layer(i), "transpose")
    if config.num_nextn_predict_layers:
        n = config.num_hidden_layers
        rules += _block_rules(config, f"model.layers.{n}.", "mtp.block.", config.is_moe_layer(n), "transpose")
        rules += [R(f"model.layers.{n}.enorm.weight", "mtp.enorm.weight"),
                  R(f"model.layers.{n}.hnorm.weight", "mtp.hnorm.weight"),
                  R(f"model.layers.{n}.eh_proj.weight", "mtp.eh_proj.weight", "transpose"),
                  R(f"model.layers.{n}.shared_head.norm.weight", "mtp.norm.weight")]
    rules.append(R("model.norm.weight", "norm.weight"))
    if not config.tie_word_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight", "transpose"))
    return rules


def hf_published_copies(config) -> dict:
    """The MTP layer's embed_tokens and shared_head.head in the published files: copies of model.embed_tokens
    and lm_head ("Shares parameters with the Embedding layer / the output Head of the Main Model",
    deepseek-ai/DeepSeek-V3 README_WEIGHTS.md), as ours are shared. Ignored as transformers ignores the whole
    layer (DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected) and DeepSeek's inference/convert.py skips
    it ("model.layers.61" not read); their shapes are checked, their values not read (2 x 0.9B values)."""
    if not config.num_nextn_predict_layers:
        return {}
    n = config.num_hidden_layers
    copies = {f"model.layers.{n}.embed_tokens.weight": "model.embed_tokens.weight"}
    if not config.tie_word_embeddings:
        copies[f"model.layers.{n}.shared_head.head.weight"] = "lm_head.weight"
    return copies


def import_table(raw: dict, config, names=()) -> list:
    from models.families.qwen3 import is_hugging_face_layout

    if is_hugging_face_layout(raw, names):
        return hf_deepseek_v3_table(config)
    return deepseek_v3_table(config)


def hf_deepseek_v3_config(c) -> dict:
    """config.json of transformers' DeepseekV3ForCausalLM (DeepseekV3Config's keys, as 4.57 writes them), plus the
    published file's num_nextn_predict_layers (5.x's DeepseekV3Config has it; its model builds no MTP)."""
    config = {k: v for k, v in paddleformers_config(c).items()
              if k not in ("seq_length", "topk_method", "moe_layer_freq", "scoring_func")}
    head_dims = dict(qk_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim, head_dim=c.qk_rope_head_dim)
    return {**config, **head_dims, "rope_interleave": True, "pretraining_tp": 1, "use_cache": True,
            # "rope_type" as the other families write it (transformers reads "type", the published spelling, too)
            "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None}


def paddleformers_config(c) -> dict:
    """config.json of PaddleFormers' DeepseekV3ForCausalLM (DeepseekV2Config's keys)."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, moe_intermediate_size=c.expert_intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, n_shared_experts=c.shared_expert_intermediate_size // c.expert_intermediate_size,
        n_routed_experts=c.num_experts, routed_scaling_factor=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim, topk_method="noaux_tc", n_group=c.n_group, topk_group=c.topk_group,
        num_experts_per_tok=c.num_experts_per_tok, moe_layer_freq=1, first_k_dense_replace=c.first_k_dense_replace,
        norm_topk_prob=c.norm_topk_prob, scoring_func="sigmoid", hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope_theta,
        rope_scaling=({**{k: v for k, v in c.rope_scaling.items() if k != "rope_type"}, "type": "yarn"}
                      if c.rope_scaling else None),
        attention_bias=False, attention_dropout=0.0, num_nextn_predict_layers=c.num_nextn_predict_layers,
        # PaddleFormers' DeepseekV2Attention reshapes the rotary key by config.seq_length (the run's tokens)
        seq_length=c.seq_length,
    )


def check_paddleformers_class(c):
    if c.shared_expert_intermediate_size % c.expert_intermediate_size:
        return "a shared expert whose width is not a multiple of moe_intermediate_size (n_shared_experts)"
    return None


HF_DEEPSEEK_V3_CLASS = HuggingFaceClass(
    class_name="DeepseekV3ForCausalLM", model_type="deepseek_v3",
    requires=dict(router_score="sigmoid", shared_expert_gate=False, linear_bias=False),
    table=hf_deepseek_v3_table, config_json=hf_deepseek_v3_config, check=check_paddleformers_class,
    published_copies=hf_published_copies,
)

FAMILY = Family(
    name="deepseek_v3", switches=SWITCHES,
    scaled_output_init=False,  # PaddleFormers' DeepseekV2PretrainedModel._init_weights: one std for every matrix
    architectures=ARCHITECTURES, tiny="deepseek-v3-tiny", model_types=("deepseek_v3",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="DeepseekV3ForCausalLM", model_type="deepseek_v3",
        requires=dict(router_score="sigmoid", shared_expert_gate=False, linear_bias=False),
        export_table=lambda config: deepseek_v3_table(config), import_table=import_table,
        config_json=paddleformers_config, check=check_paddleformers_class,
    ),
    hugging_face=HF_DEEPSEEK_V3_CLASS,
    required_keys=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                   "kv_lora_rank", "qk_rope_head_dim"),
)
