"""The architecture registry: every entry resolves, real hyperparameters, parameter counts, config.json reading."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_pretrain.errors import UsageError
from models.families import FAMILIES
from models.registry import ARCHITECTURES, config_from_dict, known_model_names, parameter_count, resolve_model

REQUIRED = [
    "facebook/llama-7b", "facebook/llama-13b", "facebook/llama-65b",
    "meta-llama/Llama-2-7b", "meta-llama/Llama-2-7b-chat", "meta-llama/Llama-2-13b", "meta-llama/Llama-2-13b-chat",
    "meta-llama/Llama-2-70b",
    "baichuan-inc/Baichuan-7B", "baichuan-inc/Baichuan-13B-Base", "baichuan-inc/Baichuan-13B-Chat",
    "baichuan-inc/Baichuan2-7B-Base", "baichuan-inc/Baichuan2-7B-Chat", "baichuan-inc/Baichuan2-13B-Base",
    "baichuan-inc/Baichuan2-13B-Chat",
    "FlagAlpha/Llama2-Chinese-7b-Chat", "FlagAlpha/Llama2-Chinese-13b-Chat", "idea-ccnl/ziya-llama-13b-v1",
    "linly-ai/chinese-llama-2-7b", "linly-ai/chinese-llama-2-13b",
    "qwen/qwen-7b", "qwen/qwen-7b-chat", "qwen/qwen-14b", "qwen/qwen-14b-chat",
    "bigscience/bloom-7b1", "bigscience/bloomz-7b1", "bigscience/bloomz-7b1-mt", "bigscience/bloom",
    "gpt3-125M-en", "gpt3-350M-en", "gpt3-760M-en", "gpt3-1.3B-en", "gpt3-2.7B-en", "gpt3-6.7B-en", "gpt3-13B-en",
    "gpt3-175B-en", "gpt2-medium-en",
    "llama-tiny", "llama-small", "baichuan-tiny", "qwen-tiny", "gpt3-tiny", "bloom-tiny",
    "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B", "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B", "llama3-tiny", "qwen2-tiny",
    *[f"Qwen/Qwen1.5-{size}" for size in ("0.5B", "1.8B", "4B", "7B", "14B", "32B", "72B")],
    *[f"Qwen/Qwen2-{size}" for size in ("0.5B", "1.5B", "7B", "72B")],
    *[f"Qwen/Qwen2.5-{size}" for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")],
]


def test_every_required_entry_exists_and_resolves():
    assert set(REQUIRED) <= set(known_model_names())
    for name in known_model_names():
        config, weights = resolve_model(name)
        assert weights is None and config.family in FAMILIES
        assert config.hidden_size % config.num_attention_heads == 0
        assert config.num_attention_heads % config.num_key_value_heads == 0
        assert config.architecture_dict() == ARCHITECTURES[name].architecture_dict()
    # a copy: changing it leaves the registry alone
    config, _ = resolve_model("facebook/llama-7b")
    config.vocab_size = 1
    assert ARCHITECTURES["facebook/llama-7b"].vocab_size == 32000


def _get(name):
    return resolve_model(name)[0]


def test_real_hyperparameters():
    l70 = _get("meta-llama/Llama-2-70b")
    assert (l70.hidden_size, l70.num_hidden_layers, l70.num_attention_heads, l70.num_key_value_heads,
            l70.intermediate_size, l70.max_position_embeddings, l70.norm_eps) == (8192, 80, 64, 8, 28672, 4096, 1e-5)
    l13 = _get("facebook/llama-13b")
    assert (l13.hidden_size, l13.num_hidden_layers, l13.intermediate_size, l13.norm_eps) == (5120, 40, 13824, 1e-6)
    # LLaMA's params.json: norm_eps 1e-06 for 7B/13B/30B but 1e-05 for 65B (copied verbatim in
    # tinygrad/tinygrad@00cc14b examples/llama.py MODEL_PARAMS; the 65B's HF config.json says rms_norm_eps 1e-05)
    assert _get("facebook/llama-7b").norm_eps == 1e-6 and _get("facebook/llama-65b").norm_eps == 1e-5
    assert _get("idea-ccnl/ziya-llama-13b-v1").vocab_size == 39424
    assert _get("linly-ai/chinese-llama-2-7b").vocab_size == 40076

    b7, b13 = _get("baichuan-inc/Baichuan-7B"), _get("baichuan-inc/Baichuan-13B-Base")
    assert (b7.vocab_size, b7.position_embedding, b7.norm_head) == (64000, "rope", False)
    assert (b13.vocab_size, b13.position_embedding, b13.intermediate_size, b13.hidden_size) == \
        (64000, "alibi", 13696, 5120)
    for name in ("baichuan-inc/Baichuan2-7B-Base", "baichuan-inc/Baichuan2-13B-Chat"):
        assert _get(name).vocab_size == 125696 and _get(name).norm_head
    assert _get("baichuan-inc/Baichuan2-13B-Base").position_embedding == "alibi"
    assert _get("baichuan-inc/Baichuan2-7B-Chat").position_embedding == "rope"

    q7, q14 = _get("qwen/qwen-7b"), _get("qwen/qwen-14b")
    assert (q7.vocab_size, q7.intermediate_size, q7.qkv_bias, q7.linear_bias) == (151936, 11008, True, False)
    assert (q14.hidden_size, q14.num_hidden_layers, q14.intermediate_size) == (5120, 40, 13696)
    assert q14.vocab_size == 152064  # Qwen-14B's config.json (Qwen-7B: 151936)

    bloom7, bloom = _get("bigscience/bloomz-7b1-mt"), _get("bigscience/bloom")
    assert (bloom7.hidden_size, bloom7.num_hidden_layers, bloom7.num_attention_heads, bloom7.vocab_size) == \
        (4096, 30, 32, 250880)
    assert (bloom.hidden_size, bloom.num_hidden_layers, bloom.num_attention_heads) == (14336, 70, 112)
    assert bloom.embedding_layernorm and bloom.tie_word_embeddings and bloom.hidden_act == "gelu_tanh"

    gpt2m, gpt13 = _get("gpt2-medium-en"), _get("gpt3-13B-en")
    assert (gpt2m.hidden_size, gpt2m.num_hidden_layers, gpt2m.num_attention_heads, gpt2m.vocab_size) == \
        (1024, 24, 16, 50304)
    assert (gpt13.hidden_size, gpt13.num_hidden_layers, gpt13.intermediate_size) == (5120, 40, 20480)
    assert gpt13.hidden_act == "gelu_tanh" and gpt13.position_embedding == "learned" and gpt13.norm_eps == 1e-5


# Published parameter counts (embeddings and head included).
KNOWN_COUNTS = {
    "facebook/llama-7b": 6_738_415_616,
    "facebook/llama-13b": 13_015_864_320,
    "facebook/llama-65b": 65_285_660_672,
    "meta-llama/Llama-2-70b": 68_976_648_192,
    "baichuan-inc/Baichuan2-7B-Base": 7_505_973_248,
    "baichuan-inc/Baichuan2-13B-Base": 13_896_668_160,
    "qwen/qwen-7b": 7_721_324_544,
    "bigscience/bloom-7b1": 7_069_016_064,
    "bigscience/bloom": 176_247_271_424,
    "gpt3-175B-en": 175e9,
    "TinyLlama/TinyLlama_v1.1": 1.1e9,  # the model card's "1.1B"  # the paper's round number (its vocabulary and context differ slightly)
}


@pytest.mark.parametrize("name", sorted(KNOWN_COUNTS))
def test_parameter_counts_within_one_percent(name):
    assert parameter_count(_get(name)) == pytest.approx(KNOWN_COUNTS[name], rel=0.01)


def test_parameter_count_matches_the_model():
    """The formula against the parameters the decoder actually creates (lazily, no memory)."""
    from models.paddlenlp_interop import canonical_shapes

    names = [n for n in known_model_names() if "tiny" in n or n in ("meta-llama/Llama-2-70b", "qwen/qwen-14b",
                                                                       "gpt3-1.3B-en", "bigscience/bloom-7b1")]
    for name in names:
        config = _get(name)
        assert parameter_count(config) == sum(int(np.prod(s)) for s in canonical_shapes(config).values()), name
    assert parameter_count(_get("facebook/llama-7b")) == 6_738_415_616  # exact, not just within 1%


def test_tiny_presets_split_two_ways():
    for family in FAMILIES.values():
        config = _get(family.tiny)
        assert config.family == family.name and config.hidden_size == 64 and config.num_hidden_layers == 2
        assert config.num_attention_heads == 4 and config.vocab_size == 256
        for size in (config.num_attention_heads, config.vocab_size, config.intermediate_size):
            assert size % 2 == 0
        assert config.num_key_value_heads % 2 == 0 or 2 % config.num_key_value_heads == 0  # split or replicated
    qwen2 = _get("qwen2-tiny")  # fewer kv heads than tp2 ranks, tied head: as the small Qwen2 sizes
    assert qwen2.num_key_value_heads == 1 and qwen2.tie_word_embeddings and qwen2.qkv_bias
    tiny = _get("baichuan-tiny")
    assert tiny.position_embedding == "alibi" and tiny.norm_head


def test_unknown_name_says_the_closest_built_in_ones():
    with pytest.raises(UsageError, match="closest built-in names: qwen/qwen-7b, .*`llm-plan models` lists all"):
        resolve_model("qwen/qwen-700b")


def test_reads_paddlenlp_and_hugging_face_configs(tmp_path):
    qwen = {"model_type": "qwen", "architectures": ["QWenForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32, "kv_channels": 128,
            "layer_norm_epsilon": 1e-6, "max_position_embeddings": 8192, "seq_length": 8192, "no_bias": True,
            "rotary_emb_base": 10000}
    assert config_from_dict(qwen, "q").architecture_dict() == _get("qwen/qwen-7b").architecture_dict()
    # Hugging Face Baichuan2-13B: no max_position_embeddings (ALiBi), vocabulary 125696 (NormHead)
    baichuan = {"model_type": "baichuan", "vocab_size": 125696, "hidden_size": 5120, "intermediate_size": 13696,
                "num_hidden_layers": 40, "num_attention_heads": 40, "model_max_length": 4096, "rms_norm_eps": 1e-6}
    assert config_from_dict(baichuan, "b").architecture_dict() == \
        _get("baichuan-inc/Baichuan2-13B-Base").architecture_dict()
    bloom = {"model_type": "bloom", "n_layer": 30, "n_head": 32, "hidden_size": 4096, "vocab_size": 250880,
             "layer_norm_epsilon": 1e-5}
    assert config_from_dict(bloom, "b").architecture_dict() == _get("bigscience/bloom-7b1").architecture_dict()
    gpt = {"model_type": "gpt", "vocab_size": 50304, "hidden_size": 5120, "num_hidden_layers": 40,
           "num_attention_heads": 40, "intermediate_size": 20480, "max_position_embeddings": 1024,
           "hidden_act": "gelu", "layer_norm_eps": 1e-12}  # PaddleNLP's GPT ignores the epsilon (fixed 1e-5)
    assert config_from_dict(gpt, "g").architecture_dict() == _get("gpt3-13B-en").architecture_dict()
    # PaddleNLP's LLaMA class running Baichuan-13B
    llama_alibi = {"model_type": "llama", "alibi": True, "vocab_size": 64000, "hidden_size": 5120,
                   "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 40,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "seq_length": 4096, "use_recompute": True}
    assert config_from_dict(llama_alibi, "l").architecture_dict() == \
        _get("baichuan-inc/Baichuan-13B-Base").architecture_dict()
    # run-time keys of a PaddleNLP config.json never leak into the architecture
    assert config_from_dict({**llama_alibi, "sequence_parallel": True}, "l").sequence_parallel is False
    # a directory with such a config.json and no weights is an architecture
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    assert resolve_model(str(tmp_path)) == (_get("qwen/qwen-7b"), None)


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "t5"}, "model_type"),
    ({"family": "mamba"}, "family"),
    ({"model_type": "qwen", "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 8}, "kv_channels"),
    ({"model_type": "gpt", "hidden_activation": "relu"}, "hidden_activation"),
    ({"model_type": "llama", "rope_scaling_type": "ntk"}, "rope_scaling_type"),
])
def test_unsupported_configs_are_usage_errors(raw, message):
    with pytest.raises(UsageError, match=message):
        config_from_dict(raw, "config.json")


# ----------------------------------------------------------------------------- Llama 3 and Qwen1.5 / 2 / 2.5
# (hidden, layers, heads, kv heads, intermediate, vocab, max positions, rms_norm_eps, rope_theta, tied):
# the published config.json of each base model (Hugging Face hub, meta-llama/* and Qwen/*). The copies each row
# was checked against are listed in the docstrings of models/families/llama.py and qwen2.py; rows marked
# "unverified: ..." keep values no copy of the base model's file confirmed.
PUBLISHED = {
    "meta-llama/Meta-Llama-3-8B": (4096, 32, 32, 8, 14336, 128256, 8192, 1e-5, 500000.0, False),
    "meta-llama/Meta-Llama-3-70B": (8192, 80, 64, 8, 28672, 128256, 8192, 1e-5, 500000.0, False),
    "meta-llama/Llama-3.1-8B": (4096, 32, 32, 8, 14336, 128256, 131072, 1e-5, 500000.0, False),
    "meta-llama/Llama-3.1-70B": (8192, 80, 64, 8, 28672, 128256, 131072, 1e-5, 500000.0, False),
    # 405B: a benchmark's dummy FP8 copy of its config.json [stored GitHub index id 148619068], not the base file
    "meta-llama/Llama-3.1-405B": (16384, 126, 128, 8, 53248, 128256, 131072, 1e-5, 500000.0, False),
    # Qwen1.5-0.5B is tied: its config.json says "tie_word_embeddings": true (printed Qwen2Config of
    # Qwen/Qwen1.5-0.5B, stored GitHub index id 29205825897), and the model loads with 463,987,712
    # parameters (Nuist-XZX/QWen README.md: 467,772,416 with 3,784,704 LoRA parameters) -- a head counted once.
    "Qwen/Qwen1.5-0.5B": (1024, 24, 16, 16, 2816, 151936, 32768, 1e-6, 1e6, True),
    "Qwen/Qwen1.5-1.8B": (2048, 24, 16, 16, 5504, 151936, 32768, 1e-6, 1e6, False),
    # unverified: rope_theta 5e6 (no copy of Qwen1.5-4B's config.json found)
    "Qwen/Qwen1.5-4B": (2560, 40, 20, 20, 6912, 151936, 32768, 1e-6, 5e6, False),
    "Qwen/Qwen1.5-7B": (4096, 32, 32, 32, 11008, 151936, 32768, 1e-6, 1e6, False),
    # unverified from a config.json copy: eps / theta of 14B, 32B, 72B (Pai-Megatron-Patch's scripts use 1e-6 / 1e6)
    "Qwen/Qwen1.5-14B": (5120, 40, 40, 40, 13696, 152064, 32768, 1e-6, 1e6, False),
    "Qwen/Qwen1.5-32B": (5120, 64, 40, 8, 27392, 152064, 32768, 1e-6, 1e6, False),
    "Qwen/Qwen1.5-72B": (8192, 80, 64, 64, 24576, 152064, 32768, 1e-6, 1e6, False),
    "Qwen/Qwen2-0.5B": (896, 24, 14, 2, 4864, 151936, 131072, 1e-6, 1e6, True),
    "Qwen/Qwen2-1.5B": (1536, 28, 12, 2, 8960, 151936, 131072, 1e-6, 1e6, True),  # unverified: max positions
    "Qwen/Qwen2-7B": (3584, 28, 28, 4, 18944, 152064, 131072, 1e-6, 1e6, False),
    "Qwen/Qwen2-72B": (8192, 80, 64, 8, 29568, 152064, 131072, 1e-5, 1e6, False),
    "Qwen/Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, 32768, 1e-6, 1e6, True),
    "Qwen/Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, 131072, 1e-6, 1e6, True),  # unverified: max positions
    "Qwen/Qwen2.5-3B": (2048, 36, 16, 2, 11008, 151936, 32768, 1e-6, 1e6, True),
    "Qwen/Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, 131072, 1e-6, 1e6, False),
    "Qwen/Qwen2.5-14B": (5120, 48, 40, 8, 13824, 152064, 131072, 1e-5, 1e6, False),
    "Qwen/Qwen2.5-32B": (5120, 64, 40, 8, 27648, 152064, 131072, 1e-5, 1e6, False),
    "Qwen/Qwen2.5-72B": (8192, 80, 64, 8, 29568, 152064, 131072, 1e-5, 1e6, False),  # unverified: eps, max positions
}
# Parameter counts the model cards publish (embeddings and head included; a tied head counted once).
PUBLISHED_COUNTS = {
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248, "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-405B": 405_853_388_800,
    "Qwen/Qwen2-7B": 7_615_616_512, "Qwen/Qwen2-72B": 72_706_203_648,
    "Qwen/Qwen2.5-0.5B": 494_032_768, "Qwen/Qwen2.5-1.5B": 1_543_714_304, "Qwen/Qwen2.5-3B": 3_085_938_688,
    "Qwen/Qwen2.5-14B": 14_770_033_664, "Qwen/Qwen2.5-32B": 32_763_876_352,
    # counted by loading the models: Qwen1.5-0.5B (tied head) in Nuist-XZX/QWen README.md, 467,772,416 minus its
    # 3,784,704 LoRA parameters; Qwen1.5-1.8B(-Chat, untied) 1,836,828,672 [stored GitHub index id 55173016543]
    "Qwen/Qwen1.5-0.5B": 463_987_712, "Qwen/Qwen1.5-1.8B": 1_836_828_672,
}


def _hf_config_json(name: str) -> dict:
    """The published config.json of `name` (the keys that matter), as Hugging Face writes it."""
    hidden, layers, heads, kv, inner, vocab, positions, eps, theta, tied = PUBLISHED[name]
    raw = {"architectures": ["LlamaForCausalLM" if "llama" in name else "Qwen2ForCausalLM"],
           "model_type": "llama" if "llama" in name else "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inner, "vocab_size": vocab,
           "max_position_embeddings": positions, "rms_norm_eps": eps, "rope_theta": theta,
           "tie_word_embeddings": tied, "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0,
           "torch_dtype": "bfloat16", "use_cache": True, "bos_token_id": 1, "eos_token_id": 2}
    if "Qwen" in name:
        raw.update(use_sliding_window=False, sliding_window=positions, max_window_layers=layers)
    if "3.1" in name:
        raw["rope_scaling"] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    return raw


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_new_models_have_published_hyperparameters(name):
    config = _get(name)
    hidden, layers, heads, kv, inner, vocab, positions, eps, theta, tied = PUBLISHED[name]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.max_position_embeddings, config.norm_eps,
            config.rope_theta, config.tie_word_embeddings) == PUBLISHED[name]
    assert config.family == ("llama" if "llama" in name else "qwen2")
    assert config.qkv_bias == (config.family == "qwen2") and not config.linear_bias
    assert (config.rope_scaling is not None) == ("3.1" in name)
    # and its config.json, as published, reads as the same architecture
    assert config_from_dict(_hf_config_json(name), name).architecture_dict() == config.architecture_dict()
    if name in PUBLISHED_COUNTS:
        assert parameter_count(config) == PUBLISHED_COUNTS[name]


def test_llama31_rope_scaling_is_published_one():
    assert _get("meta-llama/Llama-3.1-405B").rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert _get("meta-llama/Meta-Llama-3-8B").rope_scaling is None


def test_local_config_json_resolves_to_its_family(tmp_path):
    for name, family in (("Qwen/Qwen2.5-7B", "qwen2"), ("meta-llama/Llama-3.1-8B", "llama")):
        directory = tmp_path / family
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(_hf_config_json(name)))
        config, weights = resolve_model(str(directory))
        assert config.family == family and weights is None
        assert config.architecture_dict() == _get(name).architecture_dict()


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "mistral"},
     "supported: baichuan, bloom, deepseek_v3, ernie4_5, ernie4_5_moe, gpt, gpt2, llama, mixtral, qwen, qwen2, "
     "qwen2_moe, qwen3, "
     "qwen3_moe"),
    ({**_hf_config_json("Qwen/Qwen2-7B"), "use_sliding_window": True}, "use_sliding_window"),
    ({**_hf_config_json("meta-llama/Llama-3.1-8B"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling"),
    ({**_hf_config_json("meta-llama/Llama-3.1-8B"), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "low_freq_factor"),
])
def test_new_family_bad_configs(raw, message):
    with pytest.raises(UsageError, match=message):
        config_from_dict(raw, "config.json")


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                     "intermediate_size"])
def test_config_json_missing_a_key_names_it(missing):
    raw = {k: v for k, v in _hf_config_json("Qwen/Qwen2-0.5B").items() if k != missing}
    with pytest.raises(UsageError, match=f"has no '{missing}'"):
        config_from_dict(raw, "config.json")
    bloom = {"model_type": "bloom", "n_head": 32, "hidden_size": 4096, "vocab_size": 250880}
    with pytest.raises(UsageError, match="has no 'num_hidden_layers' or 'n_layer'"):
        config_from_dict(bloom, "config.json")


def test_every_family_record_is_complete():
    """What makes a family is in its record: registry entries, tiny preset, model_type, tables, reference."""
    from models.families import supported_model_types

    assert sorted(FAMILIES) == sorted(["llama", "baichuan", "qwen", "qwen2", "gpt3", "bloom", "mixtral", "qwen2_moe",
                                       "qwen3", "qwen3_moe", "ernie4_5", "ernie4_5_moe",
                                       "deepseek_v3"])
    for family in FAMILIES.values():
        assert family.tiny in family.architectures
        assert all(config.family == family.name for config in family.architectures.values())
        assert all(config.family == family.name for config in
                   (case.config for case in family.reference_cases.values()))
        # PaddleNLP 2.8.1 has no class for Qwen3, ERNIE 4.5 or DeepSeek-V3: PaddleFormers judges them instead
        # (scripts/verify_paddleformers.py)
        assert (family.export_case[0] in family.reference_cases
                if family.name not in ("qwen3", "qwen3_moe", "ernie4_5", "ernie4_5_moe", "deepseek_v3")
                else not family.export_case)
        assert family.paddlenlp.export_table(_get(family.tiny))
    assert supported_model_types() == ["baichuan", "bloom", "deepseek_v3", "ernie4_5", "ernie4_5_moe", "gpt", "gpt2",
                                      "llama", "mixtral",
                                      "qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]
