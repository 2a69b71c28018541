"""Qwen1.5, Qwen2 and Qwen2.5 (Hugging Face model_type "qwen2", class Qwen2ForCausalLM).

LLaMA's blocks with biases on the q, k and v projections (not on o_proj or the MLP), grouped-query
attention (Qwen1.5-32B/110B and every Qwen2/Qwen2.5 size), rope_theta 1e6 (Qwen1.5-4B: 5e6), and
the word embedding tied to the head in the small sizes (Qwen1.5-0.5B, Qwen2-0.5B/1.5B,
Qwen2.5-0.5B/1.5B/3B).

Sizes are the published config.json files of the base models on the Hugging Face hub (Qwen/<name>;
PaddleNLP serves the same files under the same names). The -Instruct / -Chat models have the same
architecture, but their max_position_embeddings and rms_norm_eps can differ (Qwen2.5-14B/32B base:
1e-05, -Instruct: 1e-06), so only base-model files count as sources here.

Where each preset was checked (verbatim copies of the hub's config.json;
"a public copy": a verbatim copy found in a public repository not named here):
  Qwen1.5-0.5B  print of Qwen2Config(_name_or_path "Qwen/Qwen1.5-0.5B") (a public copy):
                tie_word_embeddings true, eps 1e-06, theta 1e6, 32768; and its parameter count
                463,987,712 (a tied head) in Nuist-XZX/QWen README.md
  Qwen1.5-1.8B  sizes: Pai-Megatron-Patch examples/qwen1_5/run_pretrain_mcore_qwen.sh; untied: the
                loaded Qwen1.5-1.8B-Chat has 1,836,828,672 parameters (a public copy)
  Qwen1.5-7B    huggingface/transformers@f092c38 examples/pytorch/torchacc/qwen/Qwen1.5-7B/config.json
  Qwen1.5-14B/32B/72B  sizes and kv heads: Pai-Megatron-Patch run_pretrain_mcore_qwen.sh (eps 1e-06, rotary
                base 1e6 for all sizes); 72B also a layer-stacked copy of Qwen1.5-72B-Chat's config.json
                (only num_hidden_layers changed) (a public copy); no copy of the 14B/32B base files found
  Qwen1.5-4B    sizes: Pai-Megatron-Patch (above); rope_theta 5e6: NOT verified (no source found)
  Qwen2-0.5B    rwth-i6/i6_experiments users/juanola/.../qwen2/qwen2_configs.py
  Qwen2-7B, Qwen2-72B  (a public copy) (dicts Qwen2_7B / Qwen2_72B; Qwen2-72B eps 1e-05)
  Qwen2-1.5B    sizes: NVIDIA NeMo nemo/collections/llm/gpt/model/qwen2.py; max_position 131072 NOT verified
  Qwen2.5-0.5B  (a public copy) ("# Qwen/Qwen2.5-0.5B ## model config")
  Qwen2.5-3B/7B/14B/32B  citsjtu2020/LLM-Prof sglang/Model_Config.md
  Qwen2.5-1.5B  sizes/tied: mlc-ai/mlc-llm model_preset.py; max_position 131072 (base) NOT verified
                (the -Instruct file says 32768)
  Qwen2.5-72B   alibaba/Pai-Megatron-Patch examples/qwen2_5/run_mcore_qwen.sh only (eps 1e-5, 131072)

Sliding-window attention: these config.json files carry "use_sliding_window": false, "sliding_window"
and "max_window_layers". With use_sliding_window false (every published file) the window is not
used and attention is full causal attention, which is what is trained here; the two size keys are
accepted and ignored. "use_sliding_window": true is refused (this decoder has no windowed attention).

PaddleNLP 2.8.1 has no Qwen2 class (it arrived in PaddleNLP 3.0 / PaddleFormers): export writes the
layout of PaddleNLP 3's Qwen2ForCausalLM ("qwen2." names, Paddle's [in, out] matrices, no lm_head
when tied); import also reads Hugging Face's model.safetensors ("model." names, PyTorch's [out, in]).
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase, reference_sizes, tiny_sizes, \
    unsupported
from models.families.llama import HF_LLAMA_REQUIRES, hf_llama_config, is_hugging_face, llama_style_table, \
    read_rope

SWITCHES = dict(norm_type="rmsnorm", position_embedding="rope", hidden_act="silu", qkv_bias=True)
SMALL_VOCAB, LARGE_VOCAB = 151936, 152064


def _config(**sizes) -> ModelConfig:
    return ModelConfig(family="qwen2", **{**SWITCHES, **sizes})


def _qwen2(hidden, layers, heads, kv_heads, intermediate, vocab, max_positions, tied=False, eps=1e-6, theta=1e6):
    return _config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                   max_position_embeddings=max_positions, tie_word_embeddings=tied, norm_eps=eps, rope_theta=theta)


ARCHITECTURES = {
    # Qwen1.5 (February 2024): max_position_embeddings 32768, rms_norm_eps 1e-06; 0.5B tied (its config.json:
    # "tie_word_embeddings": true), the others untied
    "Qwen/Qwen1.5-0.5B": _qwen2(1024, 24, 16, 16, 2816, SMALL_VOCAB, 32768, tied=True),
    "Qwen/Qwen1.5-1.8B": _qwen2(2048, 24, 16, 16, 5504, SMALL_VOCAB, 32768),
    "Qwen/Qwen1.5-4B": _qwen2(2560, 40, 20, 20, 6912, SMALL_VOCAB, 32768, theta=5e6),
    "Qwen/Qwen1.5-7B": _qwen2(4096, 32, 32, 32, 11008, SMALL_VOCAB, 32768),
    "Qwen/Qwen1.5-14B": _qwen2(5120, 40, 40, 40, 13696, LARGE_VOCAB, 32768),
    "Qwen/Qwen1.5-32B": _qwen2(5120, 64, 40, 8, 27392, LARGE_VOCAB, 32768),
    "Qwen/Qwen1.5-72B": _qwen2(8192, 80, 64, 64, 24576, LARGE_VOCAB, 32768),
    # Qwen2 (June 2024): max_position_embeddings 131072; 0.5B and 1.5B tied
    "Qwen/Qwen2-0.5B": _qwen2(896, 24, 14, 2, 4864, SMALL_VOCAB, 131072, tied=True),
    "Qwen/Qwen2-1.5B": _qwen2(1536, 28, 12, 2, 8960, SMALL_VOCAB, 131072, tied=True),
    "Qwen/Qwen2-7B": _qwen2(3584, 28, 28, 4, 18944, LARGE_VOCAB, 131072),
    "Qwen/Qwen2-72B": _qwen2(8192, 80, 64, 8, 29568, LARGE_VOCAB, 131072, eps=1e-5),
    # Qwen2.5 (September 2024): 0.5B, 1.5B, 3B tied; rms_norm_eps 1e-05 from 14B on
    "Qwen/Qwen2.5-0.5B": _qwen2(896, 24, 14, 2, 4864, SMALL_VOCAB, 32768, tied=True),
    "Qwen/Qwen2.5-1.5B": _qwen2(1536, 28, 12, 2, 8960, SMALL_VOCAB, 131072, tied=True),
    "Qwen/Qwen2.5-3B": _qwen2(2048, 36, 16, 2, 11008, SMALL_VOCAB, 32768, tied=True),
    "Qwen/Qwen2.5-7B": _qwen2(3584, 28, 28, 4, 18944, LARGE_VOCAB, 131072),
    "Qwen/Qwen2.5-14B": _qwen2(5120, 48, 40, 8, 13824, LARGE_VOCAB, 131072, eps=1e-5),
    "Qwen/Qwen2.5-32B": _qwen2(5120, 64, 40, 8, 27648, LARGE_VOCAB, 131072, eps=1e-5),
    "Qwen/Qwen2.5-72B": _qwen2(8192, 80, 64, 8, 29568, LARGE_VOCAB, 131072, eps=1e-5),
    # CPU preset: one kv head (fewer than tensor-parallel ranks: replicated) and a tied head (across
    # pipeline stages), as the small Qwen2 sizes.
    "qwen2-tiny": _config(**tiny_sizes(num_key_value_heads=1), tie_word_embeddings=True, rope_theta=1e6),
}


def read_config(raw: dict, sizes: dict, source: str) -> dict:
    if raw.get("use_sliding_window"):
        unsupported(source, f"use_sliding_window true (sliding_window {raw.get('sliding_window')})")
    if raw.get("attention_bias") is False:  # PaddleNLP 3's Qwen2Config switch (default true)
        sizes["qkv_bias"] = False
    read_rope(raw, sizes, source)
    sizes.setdefault("tie_word_embeddings", False)  # Qwen2Config's default (the published files say it)
    return sizes


def import_table(raw: dict, config, names=()) -> list:
    tied = config.tie_word_embeddings
    if is_hugging_face(names):
        return llama_style_table("model.", qkv_bias=True, head=not tied, transpose=True)
    return llama_style_table("qwen2.", qkv_bias=True, head=not tied)


def config_json(c) -> dict:
    return dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        initializer_range=c.initializer_range, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, hidden_act="silu", attention_bias=True,
        tie_word_embeddings=c.tie_word_embeddings, use_sliding_window=False,
        sliding_window=c.max_position_embeddings, max_window_layers=c.num_hidden_layers,
        **({"rope_scaling": dict(c.rope_scaling)} if c.rope_scaling else {}),
    )


def hf_qwen2_config(c) -> dict:
    """config.json of transformers' Qwen2ForCausalLM (Qwen2Config.to_dict's keys)."""
    config = hf_llama_config(c, "Qwen2ForCausalLM", "qwen2")
    for key in ("head_dim", "pretraining_tp", "attention_bias", "mlp_bias"):  # not Qwen2Config keys
        del config[key]
    return {**config, "use_sliding_window": False, "sliding_window": c.max_position_embeddings,
            "max_window_layers": c.num_hidden_layers}


HF_QWEN2_CLASS = HuggingFaceClass(
    class_name="Qwen2ForCausalLM", model_type="qwen2", requires={**HF_LLAMA_REQUIRES, "qkv_bias": True},
    table=lambda c: llama_style_table("model.", qkv_bias=True, head=not c.tie_word_embeddings, transpose=True),
    config_json=hf_qwen2_config,
)

FAMILY = Family(
    name="qwen2", switches=SWITCHES,
    scaled_output_init=True,  # Qwen2PretrainedModel._init_weights scales o_proj and down_proj (PaddleNLP 3)
    architectures=ARCHITECTURES, tiny="qwen2-tiny", model_types=("qwen2",), read_config=read_config,
    paddlenlp=PaddleNLPClass(
        class_name="Qwen2ForCausalLM", model_type="qwen2",
        requires=dict(norm_type="rmsnorm", hidden_act="silu", position_embedding="rope", qkv_bias=True,
                      linear_bias=False, embedding_layernorm=False, norm_head=False),
        export_table=lambda config: llama_style_table("qwen2.", qkv_bias=True, head=not config.tie_word_embeddings),
        import_table=import_table, config_json=config_json,
    ),
    hugging_face=HF_QWEN2_CLASS,
    reference_cases={
        # PaddleNLP 2.8.1's LlamaForCausalLM with q/k/v biases (what Qwen2 is), GQA 4:2, its head set to the
        # embedding (tied; PaddleNLP 2.8.1's LLaMA cannot tie its [hidden, vocab] head itself)
        "qwen2": ReferenceCase(
            "LlamaForCausalLM", "LlamaConfig",
            dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6),
            _config(**reference_sizes(kv_heads=2), norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True),
            qkv_bias=True),
    },
    export_case=("qwen2", {}),
)
