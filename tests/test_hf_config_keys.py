"""Every config.json form read, none silently defaulted (issue 37, item 1).

* Every key of each family's Hugging Face config class (models/families/hf_config_keys.py CLASS_KEYS,
  transcribed from transformers with its source) is used, without effect (with the reason) or refused
  with a value; each claim is checked against config_from_dict.
* transformers 5's rope_parameters and 4.x's top-level rope_theta / rope_scaling give the same config;
  rope types default, linear and llama3 are computed, the others refused in one line naming the key.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from models.errors import UsageError
from models.families import FAMILIES
from models.families.base import EXPERT_COUNT_KEYS
from models.families.hf_config_keys import CLASS_KEYS, COMMON_KEYS, KEYS_BY_MODEL_TYPE, NoEffect, Refused, Used, \
    classify
from models.registry import ARCHITECTURES, config_from_dict
from models.rope import read_rope_config, scaled_inv_freq

HF_FAMILIES = [name for name, family in FAMILIES.items() if family.hugging_face]


def hf_config(family: str) -> dict:
    """config.json of the family's tiny preset as its Hugging Face class writes it (transformers 4.x form)."""
    record = FAMILIES[family]
    return record.hugging_face.config_json(ARCHITECTURES[record.tiny])


def to_transformers5(raw: dict) -> dict:
    """The same config.json as transformers 5 writes it: rope_theta and rope_scaling inside rope_parameters
    (convert_rope_params_to_dict), dtype for torch_dtype."""
    five = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    if "rope_theta" in raw or raw.get("rope_scaling"):
        scaling = dict(raw.get("rope_scaling") or {})
        kind = scaling.pop("type", scaling.pop("rope_type", "default"))
        five["rope_parameters"] = {"rope_theta": raw.get("rope_theta", 10000.0), "rope_type": kind, **scaling}
    if "torch_dtype" in raw:
        five["dtype"] = raw["torch_dtype"]
    if raw.get("model_type") == "qwen3_moe" and "num_experts" in five:  # 5.24.0's attribute_map writes it so
        five["num_local_experts"] = five.pop("num_experts")
    return five


def _model_type(family: str) -> str:
    return FAMILIES[family].hugging_face.model_type


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_key_of_the_hugging_face_class_is_classified(family):
    model_type = _model_type(family)
    assert model_type in CLASS_KEYS, f"{family}: no key list for model_type {model_type}"
    unclassified = [key for key in (*CLASS_KEYS[model_type], *COMMON_KEYS) if classify(model_type, key) is None]
    assert not unclassified, f"{model_type}: keys in none of the three lists: {unclassified}"
    # and what the exporter writes is a key of the class too
    written = set(hf_config(family)) - set(CLASS_KEYS[model_type]) - set(COMMON_KEYS)
    assert not written, f"{family}'s export writes keys missing from CLASS_KEYS[{model_type!r}]: {written}"
    for key in (*CLASS_KEYS[model_type], *COMMON_KEYS):
        entry = classify(model_type, key)
        assert isinstance(entry, (Used, NoEffect, Refused)), (key, entry)
        if isinstance(entry, NoEffect):
            assert len(entry.reason) > 10, (key, "a no-effect key needs its reason")


def _base(family: str) -> dict:
    raw = hf_config(family)
    raw.pop("head_dim", None)  # derived; the Used perturbations change hidden_size and heads
    return raw


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_used_keys_change_the_config_and_no_effect_keys_do_not(family):
    model_type = _model_type(family)
    base_raw = _base(family)
    base = config_from_dict(base_raw, "base").architecture_dict()
    for key in CLASS_KEYS[model_type]:
        entry = classify(model_type, key)
        if isinstance(entry, Used):
            # rope_parameters replaces the 4.x keys, one spelling of the expert count the other (both at once
            # would be refused as ambiguous)
            raw = {k: v for k, v in base_raw.items()
                   if not (key == "rope_parameters" and k in ("rope_scaling", "rope_theta"))
                   and not (key in EXPERT_COUNT_KEYS and k in EXPERT_COUNT_KEYS)}
            other = (not base[entry.field]) if isinstance(entry.other, bool) else copy.deepcopy(entry.other)
            scaling = raw.get("rope_scaling") or {}
            if key == "max_position_embeddings" and scaling.get("rope_type", scaling.get("type")) == "yarn":
                # DeepSeek-V3's YaRN factor must be max_position_embeddings / original (else refused): both move
                raw["rope_scaling"] = {**scaling, "original_max_position_embeddings": other // scaling["factor"]}
            config = config_from_dict({**raw, key: other}, key).architecture_dict()
            assert config[entry.field] != base[entry.field], (key, entry.field, config[entry.field])
        elif isinstance(entry, NoEffect):
            for other in (None, 12345, True, "something-else"):
                try:
                    config = config_from_dict({**base_raw, key: other}, key).architecture_dict()
                except UsageError:
                    continue
                assert config == base, (key, {k: v for k, v in config.items() if base[k] != v})


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_refused_keys_are_one_line_naming_the_key(family):
    model_type = _model_type(family)
    base_raw = _base(family)
    for key in CLASS_KEYS[model_type] + tuple(COMMON_KEYS):
        entry = classify(model_type, key)
        if not isinstance(entry, Refused):
            continue
        with pytest.raises(UsageError) as refused:
            config_from_dict({**base_raw, key: copy.deepcopy(entry.bad)}, "dir/config.json")
        message = str(refused.value)
        assert "\n" not in message and f": {key} " in message and "dir/config.json" in message, message
        assert entry.allowed in message, message


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers5_form_reads_as_the_4x_form(family):
    raw = hf_config(family)
    assert config_from_dict(to_transformers5(raw), "5").architecture_dict() == \
        config_from_dict(raw, "4").architecture_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_rope_theta_inside_rope_parameters_is_read(family):
    """The issue's Qwen2: transformers 5 writes the base only inside rope_parameters; it must not fall back to 10000."""
    raw = to_transformers5({**hf_config(family), "rope_theta": 1000000.0})
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 1000000.0
    assert config_from_dict(raw, "x").rope_theta == 1000000.0
    raw["rope_parameters"]["rope_theta"] = 250000.0
    assert config_from_dict(raw, "x").rope_theta == 250000.0


def test_qwen3_moe_expert_count_as_transformers5_writes_it():
    """transformers 5.24 writes a Qwen3-MoE's count as num_local_experts (its attribute_map); before, the import read
    only num_experts and took Qwen3MoeConfig's default 128 (found by scripts/verify_hf_import.py)."""
    raw = hf_config("qwen3_moe")
    five = to_transformers5(raw)
    assert "num_experts" not in five and five["num_local_experts"] == raw["num_experts"] != 128
    assert config_from_dict(five, "5").num_experts == raw["num_experts"]
    with pytest.raises(UsageError, match=r"^model_name_or_path: x: num_experts 16 and num_local_experts 4 disagree"):
        config_from_dict({**raw, "num_local_experts": 4}, "x")
    mixtral = {k: v for k, v in hf_config("mixtral").items() if k != "num_local_experts"}
    assert config_from_dict({**mixtral, "num_experts": 6}, "x").num_experts == 6  # MixtralConfig's alias


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("form", ["4.x", "5.x", "4.x type"])
def test_llama31_rope_scaling_in_every_form(form):
    raw = {**hf_config("llama"), "rope_theta": 500000.0, "rope_scaling": dict(LLAMA31)}
    if form == "5.x":
        raw = to_transformers5(raw)
    elif form == "4.x type":  # the first Llama 3.1 files said "type"
        raw["rope_scaling"] = {"type": "llama3", **{k: v for k, v in LLAMA31.items() if k != "rope_type"}}
    config = config_from_dict(raw, "x")
    assert config.rope_theta == 500000.0 and config.rope_scaling == LLAMA31


def test_linear_scaling_divides_every_frequency():
    theta, scaling = read_rope_config({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear",
                                                           "factor": 4.0}}, "x")
    assert theta == 10000.0 and scaling == {"rope_type": "linear", "factor": 4.0}
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    np.testing.assert_array_equal(scaled_inv_freq(inv_freq, scaling), (inv_freq / np.float32(4.0)))
    assert read_rope_config({"rope_scaling": {"type": "linear", "factor": 1.0}}, "x")[1] is None


def _transformers_yarn(head_dim: int, base: float, seq: int, scaling: dict) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [seq, head_dim] as transformers computes them for rope_type yarn (modeling_rope_utils.py
    _compute_yarn_parameters, truncate true, and the rotary embedding's cos/sin times attention_scaling),
    transcribed in NumPy (float64 here: the comparison is at float32's precision)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow") or 1)), head_dim - 1)
    pos_freqs = base ** (np.arange(0, head_dim, 2) / head_dim)
    ramp = np.clip((np.arange(head_dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    angles = np.outer(np.arange(seq), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles) * attention, np.sin(angles) * attention


@pytest.mark.parametrize("form", ["4.x", "5.x"])
@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.25, "beta_fast": 16}])
def test_yarn_is_transformers_yarn(form, extra):
    """YaRN as Qwen2.5's and Qwen3's model cards set it (rope_type yarn, factor 4 over 32768 positions), read in
    both forms: the decoder's rotary tables equal transformers' (frequencies ramped between beta_slow and
    beta_fast rotations, cos and sin times the attention factor: 0.1 ln 4 + 1 = 1.139 unless given)."""
    from models.decoder import rotary_cos_sin

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, **extra}
    raw = {**hf_config("qwen2"), "rope_theta": 1e6, "max_position_embeddings": 131072, "rope_scaling": scaling}
    if form == "5.x":
        raw = to_transformers5(raw)
    config = config_from_dict(raw, "q/config.json")
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 1e6
    head_dim = config.hidden_size // config.num_attention_heads
    # 256 positions: float32 angles (position x frequency) stay within 1e-5 of the float64 transcription
    cos, sin = (t.numpy()[0, :, 0, :] for t in rotary_cos_sin(256, head_dim, config.rope_theta, config.rope_scaling))
    want_cos, want_sin = _transformers_yarn(head_dim, 1e6, 256, scaling)
    np.testing.assert_allclose(cos, want_cos, atol=1e-5)
    np.testing.assert_allclose(sin, want_sin, atol=1e-5)
    plain = rotary_cos_sin(256, head_dim, config.rope_theta)[0].numpy()[0, :, 0, :]
    assert np.abs(cos - plain).max() > 0.1  # the scaling changes the model
    assert abs(cos[0, 0] - (extra.get("attention_factor") or 0.1 * math.log(4.0) + 1)) < 1e-6


def test_yarn_without_truncation_is_refused():
    raw = {**hf_config("qwen2"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768, "truncate": False}}
    with pytest.raises(UsageError, match=r"rope_scaling.truncate False .*allowed: true"):
        config_from_dict(raw, "q/config.json")


def test_linear_scaling_changes_the_model():
    """The decoder computes the scaled frequencies (the rotary tables differ from unscaled ones)."""
    from models.decoder import rotary_cos_sin

    plain = rotary_cos_sin(32, 16, 10000.0)[0].numpy()
    linear = rotary_cos_sin(32, 16, 10000.0, {"rope_type": "linear", "factor": 2.0})[0].numpy()
    np.testing.assert_allclose(linear[:, ::2], plain[:, :16], atol=1e-6)  # position 2k acts as k
    assert not np.allclose(plain, linear)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "nonsense"])
@pytest.mark.parametrize("form", ["4.x", "5.x"])
def test_unsupported_rope_types_are_refused_naming_the_key(rope_type, form):
    scaling = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 32768}
    raw = {**hf_config("qwen2"), "rope_scaling": scaling}
    key = "rope_scaling.rope_type"
    if form == "5.x":
        raw, key = to_transformers5(raw), "rope_parameters.rope_type"
    with pytest.raises(UsageError) as refused:
        config_from_dict(raw, "q/config.json")
    message = str(refused.value)
    assert f"{key} {rope_type!r}" in message and "default, linear, llama3" in message and "\n" not in message


@pytest.mark.parametrize("raw,key", [
    ({"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "rope_parameters.partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}}, "rope_parameters.beta_fast"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
])
def test_rope_settings_that_cannot_be_honoured_name_their_key(raw, key):
    with pytest.raises(UsageError, match=f": {key} "):
        config_from_dict({**hf_config("llama"), "rope_theta": None, "rope_scaling": None, **raw}, "x")


def test_llama3_without_its_factors_names_the_missing_one():
    raw = to_transformers5({**hf_config("llama"), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(UsageError, match="rope_parameters has no 'low_freq_factor'"):
        config_from_dict(raw, "x")


def test_per_layer_type_rope_parameters_of_full_attention_only_are_read():
    raw = {**hf_config("qwen2"), "rope_theta": None, "rope_scaling": None,
           "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"}}}
    assert config_from_dict(raw, "x").rope_theta == 1e6


def test_the_key_lists_cover_only_families_with_a_hugging_face_class():
    assert set(KEYS_BY_MODEL_TYPE) == set(CLASS_KEYS) == {_model_type(f) for f in HF_FAMILIES}
