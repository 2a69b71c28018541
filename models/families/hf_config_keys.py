"""Every key of the Hugging Face config classes this toolkit reads, and what the import does with each.

A config.json key is one of:

    Used(field, other)        it changes the model's function and the import reads it into ModelConfig.field
                              (`other`: a second valid value, with which the test sees the field change)
    NoEffect(reason)          it does not change what training computes (use_cache, generation, labels ...)
    Refused(allowed, honoured, bad)   a value the decoder cannot compute is one line naming the key
                              (`honoured(value, raw)`: whether it can; `bad`: a value that cannot be)

`check_config_keys` applies the refusals before a family's read_config (models/registry.py
config_from_dict); tests/test_hf_config_keys.py walks every key of CLASS_KEYS and fails on one that is
in none of the three lists, on a Used key that does not change the config, on a NoEffect key that
does, and on a Refused key whose bad value is not refused.

Sources of CLASS_KEYS (transcribed, not imported: transformers is not installed here):
  transformers 5.x  huggingface/transformers@008e574 (dataclass configs): models/llama, qwen2, mixtral,
                    qwen2_moe, qwen3, qwen3_moe, ernie4_5 configuration_*.py; deepseek_v3: transformers
                    5.24.0 and 4.57.6 (pip) DeepseekV3Config's arguments and to_dict; configuration_utils.py PreTrainedConfig's fields;
                    modeling_rope_utils.py RopeParameters (the keys inside rope_parameters: models/rope.py);
                    transformers 5.24.0 (pip): Mixtral's and Qwen3-MoE's attribute_map num_experts ->
                    num_local_experts (5.24's save_pretrained writes num_local_experts for Qwen3-MoE too)
  transformers 4.x  the same classes' __init__ arguments rope_theta and rope_scaling (moved into
                    rope_parameters by 5.x's convert_rope_params_to_dict), torch_dtype (5.x: dtype);
                    GPT2Config at huggingface/transformers@01ae98a and BloomConfig at @04efa88 (their
                    __init__ arguments; 5.x keeps their names)
  Baichuan          not in transformers (remote code, the model repositories' configuration_baichuan.py):
                    the keys of models/families/baichuan.py hf_baichuan_config plus the token ids and
                    z_loss_weight; NOT verified against a published file here
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from models.errors import UsageError


@dataclass(frozen=True)
class Used:
    field: str  # the ModelConfig field it sets
    other: object  # another valid value (tests/test_hf_config_keys.py; a bool: the opposite of the preset's)


@dataclass(frozen=True)
class NoEffect:
    reason: str


@dataclass(frozen=True)
class Refused:
    allowed: str
    honoured: Callable  # (value, raw config.json) -> bool
    bad: object  # a value that is refused


def _equals(*values):
    return lambda value, raw: value in values


def _falsy(value, raw) -> bool:
    return not value


def _full_attention_only(value, raw) -> bool:
    return value is None or all(kind == "full_attention" for kind in value)


def _head_dim_is_hidden_over_heads(value, raw) -> bool:
    heads = raw.get("num_attention_heads") or raw.get("n_head")
    return value is None or (heads and value * heads == raw.get("hidden_size"))


GENERATION = "a generation setting (decoding only, never training)"
TOKEN_ID = "a special token's id: the tokenizer's and the data's business, not the model's function"
CLASSIFICATION = "sequence classification heads only (a causal LM has none)"
BOOKKEEPING = "written by save_pretrained to describe the file, not the model's function"

FP8_ALLOWED = ('absent, PaddleNLP\'s with weight_quantize_algo null, or DeepSeek-V3\'s block FP8 {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": '
               '[128, 128], "activation_scheme": "dynamic"}, dequantized on import')


def _not_quantized(value) -> bool:
    """PaddleNLP's config.json always carries its QuantizationConfig (paddlenlp/quantization/quantization_config.py
    QuantizationConfig.__init__: weight_quantize_algo and quant_type default to None): with both null nothing is
    quantized."""
    return (isinstance(value, dict) and "quant_method" not in value and "weight_quantize_algo" in value
            and value.get("weight_quantize_algo") is None and value.get("quant_type") is None)


def _published_fp8(value) -> bool:
    """DeepSeek-V3's fine-grained FP8 (transformers' FineGrainedFP8Config writes no fmt; modules_to_not_convert
    names layers left unquantized, which are read as they are stored), or PaddleNLP's config without quantization."""
    return value is None or _not_quantized(value) or (isinstance(value, dict) and value.get("quant_method") == "fp8"
                             and value.get("fmt", "e4m3") == "e4m3" and value.get("weight_block_size") == [128, 128]
                             and value.get("activation_scheme", "dynamic") == "dynamic"
                             and set(value) <= {"quant_method", "fmt", "weight_block_size", "activation_scheme",
                                                "modules_to_not_convert"})


# PreTrainedConfig's own keys: 5.x fields (configuration_utils.py@008e574) and what 4.x's to_dict writes.
COMMON_KEYS = {
    "model_type": NoEffect("chooses the family (models/families); checked by models/registry.py"),
    "architectures": NoEffect("names the transformers class; model_type chooses the family here"),
    "transformers_version": NoEffect(BOOKKEEPING),
    "_name_or_path": NoEffect(BOOKKEEPING),
    "auto_map": NoEffect("names remote-code classes; the weights are read by name here, no code is run"),
    "dtype": NoEffect("the weights' storage dtype; the run's dtype comes from its arguments (fp16/bf16)"),
    "torch_dtype": NoEffect("4.x name of dtype: the weights' storage dtype"),
    "use_bfloat16": NoEffect("4.x storage hint, as torch_dtype"),
    "output_hidden_states": NoEffect("what the forward returns, not what it computes"),
    "output_attentions": NoEffect("what the forward returns, not what it computes"),
    "return_dict": NoEffect("what the forward returns, not what it computes"),
    "torchscript": NoEffect("a PyTorch export switch"),
    "chunk_size_feed_forward": NoEffect("computes the MLP in chunks along the sequence: the same function"),
    "pruned_heads": Refused("{} (no heads pruned)", _falsy, {"0": [1]}),
    "is_encoder_decoder": Refused("false (a decoder-only model)", _falsy, True),
    "is_decoder": NoEffect("the causal mask is always applied by a causal LM"),
    "add_cross_attention": Refused("false (no encoder to attend to)", _falsy, True),
    "cross_attention_hidden_size": NoEffect("used only with add_cross_attention, which is refused"),
    "tie_encoder_decoder": NoEffect("encoder-decoder models only"),
    "tf_legacy_loss": NoEffect("TensorFlow models only"),
    "id2label": NoEffect(CLASSIFICATION), "label2id": NoEffect(CLASSIFICATION),
    "num_labels": NoEffect(CLASSIFICATION), "problem_type": NoEffect(CLASSIFICATION),
    "finetuning_task": NoEffect(CLASSIFICATION),
    "task_specific_params": NoEffect("pipelines' settings"),
    "tokenizer_class": NoEffect("the tokenizer comes from the tokenizer files"),
    "prefix": NoEffect("a text prefix for pipelines"),
    "pad_token_id": NoEffect(TOKEN_ID), "bos_token_id": NoEffect(TOKEN_ID), "eos_token_id": NoEffect(TOKEN_ID),
    "sep_token_id": NoEffect(TOKEN_ID), "decoder_start_token_id": NoEffect(TOKEN_ID),
    **{key: NoEffect(GENERATION) for key in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
        "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens")},
    "use_cache": NoEffect("the key/value cache of generation"),
    # deepseek-ai/DeepSeek-V3's config.json: {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    # "weight_block_size": [128, 128]}; its F8_E4M3 weights are dequantized as read (models/hf_directory.py)
    "quantization_config": Refused(FP8_ALLOWED, lambda value, raw: _published_fp8(value),
                                   {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}),
}

# The keys the rotary families share (LlamaConfig's, which Qwen2, Mixtral and Qwen2-MoE repeat).
_ROTARY_KEYS = {
    "vocab_size": Used("vocab_size", 300),
    "hidden_size": Used("hidden_size", 128),
    "intermediate_size": Used("intermediate_size", 352),
    "num_hidden_layers": Used("num_hidden_layers", 3),
    "num_attention_heads": Used("num_attention_heads", 8),
    "num_key_value_heads": Used("num_key_value_heads", 4),
    "hidden_act": Refused("'silu' (SwiGLU)", _equals("silu"), "gelu"),
    "max_position_embeddings": Used("max_position_embeddings", 4096),
    "initializer_range": Used("initializer_range", 0.01),
    "rms_norm_eps": Used("norm_eps", 1e-3),
    "tie_word_embeddings": Used("tie_word_embeddings", True),
    "attention_dropout": Used("attention_probs_dropout_prob", 0.1),
    # 5.x: the rotary base and scaling; 4.x: rope_theta and rope_scaling (models/rope.py reads both)
    "rope_parameters": Used("rope_scaling", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "rope_theta": Used("rope_theta", 123456.0),
    "rope_scaling": Used("rope_scaling", {"rope_type": "linear", "factor": 4.0}),
}
_SLIDING_WINDOW_KEYS = {
    "use_sliding_window": Refused("false (this decoder has no windowed attention)", _falsy, True),
    "sliding_window": NoEffect("the window's size, used only with use_sliding_window true, which is refused"),
    "max_window_layers": NoEffect("which layers get the window, used only with use_sliding_window true"),
    "layer_types": Refused("every entry 'full_attention'", _full_attention_only, ["sliding_attention"]),
}

KEYS_BY_MODEL_TYPE = {
    "llama": {
        **_ROTARY_KEYS,
        "pretraining_tp": NoEffect("splits the projections' matmuls into pretraining_tp slices: the same "
                                   "function up to rounding"),
        "attention_bias": Refused("false (no biases in the attention projections)", _falsy, True),
        "mlp_bias": Refused("false (no biases in the MLP)", _falsy, True),
        "head_dim": Refused("hidden_size / num_attention_heads", _head_dim_is_hidden_over_heads, 7),
    },
    "qwen2": {**_ROTARY_KEYS, **_SLIDING_WINDOW_KEYS},
    "mixtral": {
        **_ROTARY_KEYS,
        "head_dim": Refused("hidden_size / num_attention_heads", _head_dim_is_hidden_over_heads, 7),
        # HF's attention applies a window of this size; none (null) or one no shorter than the model's
        # positions computes full causal attention, as this decoder does
        "sliding_window": Refused("null or at least max_position_embeddings",
                                  lambda v, raw: v is None or v >= raw.get("max_position_embeddings", 131072), 16),
        "num_experts_per_tok": Used("num_experts_per_tok", 1),
        "num_local_experts": Used("num_experts", 4),
        "num_experts": Used("num_experts", 6),  # 5.24.0's attribute_map alias (models/families/base.py)
        "output_router_logits": NoEffect("whether transformers adds the load-balancing loss to its loss; here "
                                         "router_aux_loss_coef decides (0: none)"),
        "router_aux_loss_coef": Used("router_aux_loss_coef", 0.05),
        "router_jitter_noise": Refused("0.0 (no noise on the router's input)", _falsy, 0.1),
    },
    "qwen2_moe": {
        **_ROTARY_KEYS, **_SLIDING_WINDOW_KEYS,
        "decoder_sparse_step": Refused("1 (every layer a mixture of experts)", _equals(1), 2),
        "mlp_only_layers": Refused("[] (no dense layers between the experts)", _falsy, [0]),
        "moe_intermediate_size": Used("moe_intermediate_size", 48),
        "shared_expert_intermediate_size": Used("shared_expert_intermediate_size", 96),
        "num_experts_per_tok": Used("num_experts_per_tok", 1),
        "num_experts": Used("num_experts", 6),
        "norm_topk_prob": Used("norm_topk_prob", True),
        "output_router_logits": NoEffect("whether transformers adds the load-balancing loss to its loss; here "
                                         "router_aux_loss_coef decides (0: none)"),
        "router_aux_loss_coef": Used("router_aux_loss_coef", 0.05),
        "qkv_bias": Refused("true (q/k/v biases, as every published Qwen2-MoE)", _equals(True), False),
    },
    "qwen3": {
        **_ROTARY_KEYS, **_SLIDING_WINDOW_KEYS,
        "head_dim": Used("attention_head_dim", 64),  # Qwen3's 128 at every size, apart from hidden / heads
        "attention_bias": Refused("false (no biases in the attention projections, as every published Qwen3)",
                                  _falsy, True),
    },
    "ernie4_5": {
        **_ROTARY_KEYS,
        "tie_word_embeddings": Used("tie_word_embeddings", False),  # Ernie4_5Config's default true, as 0.3B
        "head_dim": Used("attention_head_dim", 64),  # 128 at 0.3B, apart from hidden / heads (64)
        "use_bias": Refused("false (no biases, as the published ERNIE 4.5)", _falsy, True),
    },
    "ernie4_5_moe": {
        **_ROTARY_KEYS,
        "tie_word_embeddings": Used("tie_word_embeddings", False),  # Ernie4_5_MoeConfig's default true
        "head_dim": Used("attention_head_dim", 64),  # read by the modeling code through getattr, as ERNIE 4.5's
        "use_bias": Refused("false (no biases, as the published ERNIE 4.5)", _falsy, True),
        # (its attribute_map aliases num_experts / num_experts_per_tok, never written: ernie4_5_moe.read_config)
        "moe_num_experts": Used("num_experts", 6),
        "moe_k": Used("num_experts_per_tok", 1),
        "moe_intermediate_size": Used("moe_intermediate_size", 48),
        "moe_num_shared_experts": Used("shared_expert_intermediate_size", 0),
        "moe_layer_start_index": Used("first_k_dense_replace", 0),
        "moe_layer_end_index": Used("moe_layer_end_index", 0),
        "moe_layer_interval": Used("moe_layer_interval", 3),
        # the top-k weights / max(their sum, moe_norm_min): only a sum below it (never in practice) would see another
        "moe_norm_min": Refused("1e-12 (Ernie4_5_MoeConfig's default)", _equals(1e-12), 1e-3),
        # PaddleFormers 0.4.1's Ernie4_5_MoeConfig (default 1) and save_pretrained write it; its MTP block
        # (model.mtp_block, mtp_*_norm, mtp_linear_proj) has no place in this decoder: not dropped silently
        "num_nextn_predict_layers": Refused("0 (no multi-token-prediction block for ERNIE 4.5 MoE here)", _falsy, 1),
        "output_router_logits": NoEffect("whether transformers adds the load-balancing loss to its loss; here "
                                         "router_aux_loss_coef decides (0: none)"),
        "router_aux_loss_coef": Used("router_aux_loss_coef", 0.05),
    },
    "qwen3_moe": {
        **_ROTARY_KEYS, **_SLIDING_WINDOW_KEYS,
        # not a Qwen3MoeConfig field at 008e574, but in every published file (Qwen3-30B-A3B: 128 with
        # hidden 2048 / 32 heads) and read by the modeling code through getattr: read like Qwen3's
        "head_dim": Used("attention_head_dim", 64),
        "attention_bias": Refused("false (no biases in the attention projections)", _falsy, True),
        "decoder_sparse_step": Refused("1 (every layer a mixture of experts)", _equals(1), 2),
        "mlp_only_layers": Refused("[] (no dense layers between the experts)", _falsy, [0]),
        "moe_intermediate_size": Used("moe_intermediate_size", 48),
        "num_experts_per_tok": Used("num_experts_per_tok", 1),
        "num_experts": Used("num_experts", 6),
        "num_local_experts": Used("num_experts", 6),  # what 5.24.0 writes (models/families/base.py)
        "norm_topk_prob": Used("norm_topk_prob", False),
        "output_router_logits": NoEffect("whether transformers adds the load-balancing loss to its loss; here "
                                         "router_aux_loss_coef decides (0: none)"),
        "router_aux_loss_coef": Used("router_aux_loss_coef", 0.05),
        "shared_expert_intermediate_size": Refused("0 or absent (Qwen3-MoE has no shared expert)", _falsy, 96),
    },
    # DeepseekV3Config (transformers 4.57.6 and 5.24.0, pip: its __init__ arguments and to_dict), plus the keys of
    # the published deepseek-ai/DeepSeek-V3 config.json that the class does not have (scoring_func ...)
    "deepseek_v3": {
        **{k: v for k, v in _ROTARY_KEYS.items() if k not in ("rope_parameters", "rope_scaling")},
        # YaRN's factor must be max_position_embeddings / original (models/families/deepseek_v3.py read_config)
        "rope_parameters": Used("rope_scaling", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 512}),
        "rope_scaling": Used("rope_scaling", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}),
        "num_key_value_heads": NoEffect("latent attention has a key per query head whatever it says (read as "
                                        "num_attention_heads; transformers' class works only with them equal)"),
        "moe_intermediate_size": Used("moe_intermediate_size", 48),
        "n_shared_experts": Used("shared_expert_intermediate_size", 2),
        "n_routed_experts": Used("num_experts", 16),
        "routed_scaling_factor": Used("routed_scaling_factor", 1.0),
        "kv_lora_rank": Used("kv_lora_rank", 8),
        "q_lora_rank": Used("q_lora_rank", 64),
        "qk_rope_head_dim": Used("qk_rope_head_dim", 4),
        "v_head_dim": Used("v_head_dim", 8),
        "qk_nope_head_dim": Used("qk_nope_head_dim", 8),
        "n_group": Used("n_group", 2),
        "topk_group": Used("topk_group", 1),
        "num_experts_per_tok": Used("num_experts_per_tok", 1),
        "first_k_dense_replace": Used("first_k_dense_replace", 0),
        "norm_topk_prob": Used("norm_topk_prob", False),
        "num_nextn_predict_layers": Used("num_nextn_predict_layers", 0),
        # derived: DeepseekV3Config computes both (5.24.0 __post_init__, 4.57.6 __init__), and both write them
        "qk_head_dim": NoEffect("derived: qk_nope_head_dim + qk_rope_head_dim, which are read"),
        "head_dim": NoEffect("derived: transformers' rotary width, qk_rope_head_dim, which is read"),
        "rope_interleave": Refused("true (DeepSeek's interleaved rotary pairs)", lambda v, raw: v in (True, None),
                                   False),
        "attention_bias": Refused("false (no biases in the attention projections)", _falsy, True),
        "pretraining_tp": NoEffect("splits the projections' matmuls into pretraining_tp slices: the same function "
                                   "up to rounding"),
        "output_router_logits": NoEffect("DeepseekV3ForCausalLM adds no router loss either way; here "
                                         "seq_aux_loss_coef and moe_bias_update_rate decide"),
        "scoring_func": Refused("'sigmoid'", _equals("sigmoid"), "softmax"),
        "topk_method": Refused("'noaux_tc' (group-limited top-k with the correction bias)", _equals("noaux_tc"),
                               "greedy"),
        "moe_layer_freq": Refused("1 (every layer after the first first_k_dense_replace a mixture of experts)",
                                  _equals(1), 2),
        "ep_size": NoEffect("the expert-parallel size of DeepSeek's inference code; the run's "
                            "expert_parallel_degree decides here"),
    },
    "gpt2": {
        "vocab_size": Used("vocab_size", 300),
        "n_positions": Used("max_position_embeddings", 4096),
        "n_ctx": NoEffect("4.x duplicate of n_positions, which is read"),
        "n_embd": Used("hidden_size", 128),
        "n_layer": Used("num_hidden_layers", 3),
        "n_head": Used("num_attention_heads", 8),
        "n_inner": Used("intermediate_size", 352),
        "activation_function": Refused("'gelu_new' or 'gelu_pytorch_tanh' (tanh GELU)",
                                       _equals("gelu_new", "gelu_pytorch_tanh"), "relu"),
        "resid_pdrop": Used("hidden_dropout_prob", 0.2),
        "embd_pdrop": NoEffect("the embedding dropout; this decoder applies resid_pdrop there (equal in "
                               "GPT-2's files)"),
        "attn_pdrop": Used("attention_probs_dropout_prob", 0.2),
        "layer_norm_epsilon": Used("norm_eps", 1e-3),
        "initializer_range": Used("initializer_range", 0.01),
        **{key: NoEffect("GPT2DoubleHeadsModel's summary head only") for key in (
            "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
            "summary_first_dropout")},
        "scale_attn_weights": Refused("true (scores divided by sqrt(head_dim))", _equals(True), False),
        "scale_attn_by_inverse_layer_idx": Refused("false", _falsy, True),
        "reorder_and_upcast_attn": Refused("false", _falsy, True),
        "tie_word_embeddings": Refused("true (GPT-2's head is the word embedding)", lambda v, raw: v in (True, None),
                                       False),
    },
    "bloom": {
        "vocab_size": Used("vocab_size", 300),
        "hidden_size": Used("hidden_size", 128),
        "n_embed": Used("hidden_size", 128),
        "n_layer": Used("num_hidden_layers", 3),
        "num_hidden_layers": Used("num_hidden_layers", 3),
        "n_head": Used("num_attention_heads", 8),
        "num_attention_heads": Used("num_attention_heads", 8),
        "n_inner": NoEffect("BloomMLP is 4 x hidden_size whatever n_inner says (modeling_bloom.py)"),
        "masked_softmax_fusion": NoEffect("a Megatron kernel choice: the same function"),
        "layer_norm_epsilon": Used("norm_eps", 1e-3),
        "initializer_range": Used("initializer_range", 0.01),
        "apply_residual_connection_post_layernorm": Refused("false", _falsy, True),
        "bias_dropout_fusion": NoEffect("a Megatron kernel choice: the same function"),
        "hidden_dropout": Used("hidden_dropout_prob", 0.2),
        "attention_dropout": Used("attention_probs_dropout_prob", 0.2),
        "attention_softmax_in_fp32": NoEffect("a precision choice under fp16; fp32 computes the same"),
        "pretraining_tp": NoEffect("splits matmuls into slices (with slow_but_exact): the same function up to "
                                   "rounding"),
        "slow_but_exact": NoEffect("the same function up to rounding (see pretraining_tp)"),
        "gradient_checkpointing": NoEffect("recompute: memory, not the function (the run's recompute key)"),
        "seq_length": Used("max_position_embeddings", 4096),
        "tie_word_embeddings": Refused("true (Bloom's head is the word embedding)", lambda v, raw: v in (True, None),
                                       False),
    },
    "baichuan": {
        "vocab_size": Used("vocab_size", 300),
        "hidden_size": Used("hidden_size", 128),
        "intermediate_size": Used("intermediate_size", 352),
        "num_hidden_layers": Used("num_hidden_layers", 3),
        "num_attention_heads": Used("num_attention_heads", 8),
        "hidden_act": Refused("'silu' (SwiGLU)", _equals("silu"), "gelu"),
        "max_position_embeddings": Used("max_position_embeddings", 4096),
        # the 13B models (ALiBi) give only model_max_length; with max_position_embeddings (the 7B, rotary) it
        # is the tokenizer's length (models/families/baichuan.py read_config)
        "model_max_length": Used("max_position_embeddings", 4096),
        "initializer_range": Used("initializer_range", 0.01),
        "rms_norm_eps": Used("norm_eps", 1e-3),
        "tie_word_embeddings": Refused("false", _falsy, True),
        "z_loss_weight": Refused("0 (no z-loss on the logits)", _falsy, 0.1),
        "gradient_checkpointing": NoEffect("recompute: memory, not the function (the run's recompute key)"),
        "norm_head": Used("norm_head", False),
    },
}

# The class keys the test walks (transcribed from the sources above; common keys: COMMON_KEYS).
CLASS_KEYS = {
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
              "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp", "tie_word_embeddings",
              "rope_parameters", "attention_bias", "attention_dropout", "mlp_bias", "head_dim",
              "rope_theta", "rope_scaling"),  # the last two: 4.x
    "qwen2": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
              "use_cache", "tie_word_embeddings", "rope_parameters", "use_sliding_window", "sliding_window",
              "max_window_layers", "layer_types", "attention_dropout", "pad_token_id", "bos_token_id",
              "eos_token_id", "rope_theta", "rope_scaling"),
    "mixtral": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                "sliding_window", "attention_dropout", "num_experts_per_tok", "num_local_experts",
                "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "rope_parameters",
                "rope_theta", "rope_scaling",
                "num_experts"),  # 5.24.0: attribute_map num_experts -> num_local_experts
    "qwen2_moe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
                  "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_parameters", "use_sliding_window",
                  "sliding_window", "max_window_layers", "attention_dropout", "decoder_sparse_step",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts",
                  "norm_topk_prob", "output_router_logits", "router_aux_loss_coef", "mlp_only_layers", "qkv_bias",
                  "layer_types", "pad_token_id", "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling"),
    "qwen3": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
              "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_parameters", "attention_bias",
              "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "attention_dropout",
              "pad_token_id", "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling"),
    "qwen3_moe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
                  "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_parameters", "attention_bias",
                  "use_sliding_window", "sliding_window", "attention_dropout", "decoder_sparse_step",
                  "moe_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
                  "output_router_logits", "router_aux_loss_coef", "mlp_only_layers", "pad_token_id",
                  "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling",
                  "head_dim", "max_window_layers",  # these two: in the published files (4.x wrote both)
                  "num_local_experts"),  # 5.24.0: attribute_map num_experts -> num_local_experts, written so
    # transformers' Ernie4_5Config (models/ernie4_5/configuration_ernie4_5.py at 008e574, dataclass fields) and
    # its 4.x rope_theta / rope_scaling; PaddleFormers 0.4.1's Ernie4_5Config writes the same keys of the model
    # plus use_cache and the token ids (its training switches are register_unsavable_keys, never written)
    "ernie4_5": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                 "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                 "rope_parameters", "use_bias", "head_dim", "rope_theta", "rope_scaling"),
    "deepseek_v3": ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                    "norm_topk_prob", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp",
                    "tie_word_embeddings", "rope_interleave", "attention_bias", "attention_dropout", "qk_head_dim",
                    "head_dim", "rope_theta", "rope_scaling",  # 4.57.6
                    "rope_parameters", "output_router_logits", "num_nextn_predict_layers"),  # 5.24.0
    # transformers 5.24.0's Ernie4_5_MoeConfig (dataclass fields; 4.57.6's __init__ arguments the same with
    # rope_theta / rope_scaling) and head_dim
    "ernie4_5_moe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
                     "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
                     "tie_word_embeddings", "rope_parameters", "use_bias", "moe_intermediate_size", "moe_k",
                     "moe_num_experts", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
                     "moe_layer_interval", "moe_norm_min", "output_router_logits", "router_aux_loss_coef",
                     "rope_theta", "rope_scaling", "head_dim"),
    "gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
             "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "summary_type",
             "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
             "scale_attn_weights", "use_cache", "bos_token_id", "eos_token_id", "scale_attn_by_inverse_layer_idx",
             "reorder_and_upcast_attn", "n_ctx", "tie_word_embeddings"),
    "bloom": ("vocab_size", "hidden_size", "n_layer", "n_head", "n_inner", "masked_softmax_fusion",
              "layer_norm_epsilon", "initializer_range", "use_cache", "bos_token_id", "eos_token_id",
              "apply_residual_connection_post_layernorm", "bias_dropout_fusion", "hidden_dropout",
              "attention_dropout", "attention_softmax_in_fp32", "pretraining_tp", "dtype", "gradient_checkpointing",
              "slow_but_exact", "n_embed", "num_hidden_layers", "num_attention_heads", "seq_length",
              "tie_word_embeddings"),
    "baichuan": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "hidden_act", "max_position_embeddings", "model_max_length", "initializer_range", "rms_norm_eps",
                 "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "z_loss_weight",
                 "gradient_checkpointing", "norm_head", "auto_map"),
}


def classify(model_type: str, key: str):
    """The Used / NoEffect / Refused entry of `key` for config.json files of `model_type`, or None."""
    return KEYS_BY_MODEL_TYPE.get(model_type, {}).get(key, COMMON_KEYS.get(key))


def check_config_keys(raw: dict, model_type: str, source: str) -> None:
    """One line naming the first key whose value this toolkit cannot honour (Refused), before anything else."""
    if model_type not in KEYS_BY_MODEL_TYPE:
        return  # PaddleNLP-only model types (qwen, gpt): their family's read_config checks them
    for key, value in raw.items():
        entry = classify(model_type, key)
        if isinstance(entry, Refused) and not entry.honoured(value, raw):
            shown = json.dumps(value)  # as config.json spells it (true, null, "gelu")
            raise UsageError(f"model_name_or_path: {source}: {key} {shown} cannot be honoured by this toolkit's "
                             f"decoder (allowed: {entry.allowed})")
