"""Mixtral 8x7B and 8x22B (model_type "mixtral", class MixtralForCausalLM): sparse mixture of experts.

LLaMA's blocks (RMSNorm, rotary positions, GQA with 8 kv heads, no biases, untied head) with the
MLP replaced by 8 SwiGLU experts of width intermediate_size behind a softmax router over the
hidden state; each token goes to its top-2 experts, weighted by their router probabilities
renormalized to sum 1 (models/moe.py). The load-balancing loss (router_aux_loss_coef, 0.001 in
PaddleNLP's MixtralConfig and in Hugging Face's; "output_router_logits" switches it on there) is
added to the loss in the form of Hugging Face's / PaddleNLP's load_balancing_loss_func.

Sizes are the published config.json files (mistralai/* on the Hugging Face hub):
  Mixtral-8x7B-v0.1   huggingface/candle candle-transformers/src/models/mixtral.rs Config::v0_1_8x7b
                      (citing huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json): 4096,
                      14336, 32 layers, 32/8 heads, 32000, 32768 positions, eps 1e-05, theta 1e6, 8 experts,
                      top 2; the parameter count 46,702,792,704 is the hub's published total
                      (tests/test_moe.py checks registry.parameter_count against it)
  Mixtral-8x22B-v0.1  6144, 16384, 56 layers, 48/8 heads, 65536 positions, eps 1e-05, theta 1e6, 8 experts,
                      top 2: the Cerebras model zoo's Mixtral-8x22B config ("based on
                      mistral-community/Mixtral-8x22B-v0.1": vocab 32000); NOT verified against
                      mistralai's own file (whose later revisions use the 32768 vocabulary of v0.3)
Sliding-window attention: the files carry "sliding_window" (null, or 4096 in the first 8x7B
revision). PaddleNLP 2.8.1's MixtralForCausalLM ignores it ("We do not support sliding window
attention for now", mixtral/modeling.py); this decoder computes full causal attention, so a window
shorter than max_position_embeddings (which transformers applies) is refused in one line
(models/families/hf_config_keys.py); null is read.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, read_expert_count, \
    reference_sizes, tiny_sizes, unsupported
from models.families.llama import HF_LLAMA_REQUIRES, hf_llama_config, is_hugging_face, read_rope
from models.weight_names import INPUT_NORM, POST_ATTENTION_NORM, R, _attn, _mlp

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.001)


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="mixtral", **{**SWITCHES, **sizes})


def _mixtral(hidden, layers, heads, intermediate, vocab, max_positions):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                   intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max_positions,
                   norm_eps=1e-5, rope_theta=1e6)


ARCHITECTURES = {
    "mistralai/Mixtral-8x7B-v0.1": _mixtral(4096, 32, 32, 14336, 32000, 32768),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": _mixtral(4096, 32, 32, 14336, 32000, 32768),
    "mistralai/Mixtral-8x22B-v0.1": _mixtral(6144, 56, 48, 16384, 32000, 65536),
    # CPU preset: 8 experts of width 88 (top-2: the activated MLP width is the dense tiny's 176), GQA 4:2.
    "mixtral-tiny": _config(**tiny_sizes(num_key_value_heads=2, intermediate_size=88), norm_eps=1e-5,
                            rope_theta=1e6, router_aux_loss_coef=0.02),
    # Real-size CPU preset: expert matrices 1024 x 2816 = 2.9M elements (above Paddle's 2**20 threshold of
    # stage 3), embedding and head 8320 x 1024 = 8.5M (above stage 2's 2**23), 4 experts to keep it light.
    "mixtral-real": _config(vocab_size=8320, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=1024,
                            num_experts=4, norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=0.02),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    count = read_expert_count(raw, source)
    sizes["num_experts"] = 8 if count is None else count  # MixtralConfig's default
    read_rope(raw, sizes, source)
    sizes.setdefault("tie_word_embeddings", False)
    sizes.setdefault("num_key_value_heads", 8)  # MixtralConfig's default
    sizes.setdefault("rope_theta", 1e6)
    sizes.setdefault("norm_eps", 1e-5)
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        unsupported(source, "attention_bias / mlp_bias")
    return sizes


# ----------------------------------------------------------------------------- PaddleNLP / HF tables
# Our expert MLP gate_proj / up_proj / down_proj are Mixtral's w1 / w3 / w2.
EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def mixtral_table(config, prefix: str = "mixtral.", transpose: bool = False) -> list:
    """PaddleNLP's MixtralForCausalLM (prefix "mixtral.") or Hugging Face's ("model.", [out, in] matrices)."""
    p = prefix + "layers.{i}."
    same = "transpose" if transpose else "same"
    experts = [R(p + f"block_sparse_moe.experts.{e}.{theirs}.weight", _mlp(f"experts.{e}.{ours}.weight"), same)
               for e in range(config.num_experts) for theirs, ours in EXPERT_NAMES]
    return [
        R(prefix + "embed_tokens.weight", "embeddings.word_embeddings.weight"),
        R(p + "input_layernorm.weight", INPUT_NORM + ".weight"),
        *[R(p + f"self_attn.{n}_proj.weight", _attn(f"{n}_proj.weight"), same) for n in "qkvo"],
        R(p + "post_attention_layernorm.weight", POST_ATTENTION_NORM + ".weight"),
        R(p + "block_sparse_moe.gate.weight", _mlp("gate.weight"), same),
        *experts,
        R(prefix + "norm.weight", "norm.weight"),
        R("lm_head.weight", "lm_head.weight", same),
    ]


def import_table(raw: dict, config, names=()) -> list:
    if is_hugging_face(names):
        return mixtral_table(config, "model.", transpose=True)
    return mixtral_table(config)


def config_json(c) -> dict:
    return dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, initializer_range=c.initializer_range, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        seq_length=c.max_position_embeddings, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, hidden_act="silu",
        tie_word_embeddings=False, num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        router_aux_loss_coef=c.router_aux_loss_coef, output_router_logits=True, sliding_window=None,
    )


def check_mixtral_experts(c):
    """What both MixtralForCausalLM classes (PaddleNLP's, Hugging Face's) cannot express of our experts."""
    if c.shared_expert_intermediate_size or not c.norm_topk_prob:
        return "a shared expert or unnormalized top-k weights (Qwen2-MoE): MixtralForCausalLM has neither"
    if c.moe_intermediate_size not in (None, c.intermediate_size):
        return "moe_intermediate_size differs from intermediate_size: MixtralForCausalLM's experts are intermediate_size wide"
    return None


def check_mixtral_class(c):
    if c.rope_scaling:
        return "rope_scaling: PaddleNLP 2.8.1's MixtralForCausalLM has none"
    return check_mixtral_experts(c)


MIXTRAL_CLASS = PaddleNLPClass(
    class_name="MixtralForCausalLM", model_type="mixtral",
    requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding="rope", linear_bias=False,
                  qkv_bias=False, embedding_layernorm=False, tie_word_embeddings=False, norm_head=False),
    export_table=lambda config: mixtral_table(config), import_table=import_table, config_json=config_json,
    check=check_mixtral_class,
)


# ----------------------------------------------------------------------------- Hugging Face (export)
def hf_mixtral_config(c) -> dict:
    """config.json of transformers' MixtralForCausalLM (MixtralConfig's keys). output_router_logits: its
    forward with labels adds the load-balancing loss, as our training does whenever router_aux_loss_coef > 0."""
    config = hf_llama_config(c, "MixtralForCausalLM", "mixtral")
    for key in ("pretraining_tp", "attention_bias", "mlp_bias"):  # not MixtralConfig keys
        del config[key]
    return {**config, "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": c.router_aux_loss_coef > 0,
            "router_jitter_noise": 0.0, "sliding_window": None}


# The import reads the same names back (import_table: "model." names are Hugging Face's); transformers 5
# stacks the experts in memory (MixtralExperts.gate_up_proj) but reads and writes the hub's per-expert
# w1 / w3 / w2 (its conversion_mapping.py "mixtral" entry), which is what this table writes.
HF_MIXTRAL_CLASS = HuggingFaceClass(
    class_name="MixtralForCausalLM", model_type="mixtral", requires={**HF_LLAMA_REQUIRES, "tie_word_embeddings": False},
    table=lambda c: mixtral_table(c, "model.", transpose=True), config_json=hf_mixtral_config,
    check=check_mixtral_experts,  # rope_scaling it has (rope_parameters; hf_llama_config writes it)
)


def reference_kwargs(**extra) -> dict:
    """PaddleNLP's MixtralConfig of the tiny reference: 8 experts of width 88, top 2, its aux loss on."""
    return {**dict(vocab_size=256, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e6,
                   num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True),
            **extra}


FAMILY = Family(
    name="mixtral", switches=SWITCHES,
    scaled_output_init=True,  # MixtralPretrainedModel._init_weights scales o_proj and every expert's w2
    architectures=ARCHITECTURES, tiny="mixtral-tiny", model_types=("mixtral",), read_config=read_config,
    paddlenlp=MIXTRAL_CLASS, hugging_face=HF_MIXTRAL_CLASS,
    reference_cases={
        "mixtral": ReferenceCase("MixtralForCausalLM", "MixtralConfig", reference_kwargs(),
                                 _config(**reference_sizes(kv_heads=2, inner=88), norm_eps=1e-5, rope_theta=1e6,
                                         router_aux_loss_coef=0.02)),
    },
    export_case=("mixtral", {}),
)
