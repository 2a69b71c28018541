"""Rotary position embeddings: which config.json settings this toolkit computes, and their frequencies.

Hugging Face config.json files give the rotary base and its scaling in two forms:

    transformers 4.x   top-level "rope_theta" and "rope_scaling" ({"rope_type" or "type", "factor", ...})
    transformers 5.x   "rope_parameters": {"rope_theta", "rope_type", "factor", ...} and no top-level keys
                       (modeling_rope_utils.py RopeParameters / convert_rope_params_to_dict)

`read_rope_config` reads both into ours (ModelConfig.rope_theta, ModelConfig.rope_scaling). Rope types
computed here, as transformers' ROPE_INIT_FUNCTIONS compute them (modeling_rope_utils.py):

    default   no scaling
    linear    every inverse frequency divided by `factor` (_compute_linear_scaling_rope_parameters)
    llama3    Llama 3.1's: frequencies whose wavelength is shorter than original_max_position_embeddings /
              high_freq_factor stay, those longer than original / low_freq_factor are divided by `factor`,
              the band between is interpolated smoothly (_compute_llama3_parameters; Meta's apply_scaling)

    yarn      frequencies interpolated by `factor` below the band beta_slow..beta_fast rotations over
              original_max_position_embeddings, kept above it, ramped between (truncated to whole dimensions);
              cos/sin times attention_factor, or mscale(factor, mscale) / mscale(factor, mscale_all_dim), or
              mscale(factor) = 0.1 ln(factor) + 1 (transformers' _compute_yarn_parameters, the same as
              PaddleFormers 0.4.1 deepseek_v2/modeling.py). Read for the families that publish it, when the
              family's reader asks (`read_rope_config(..., yarn=True)`): Qwen2.5's and Qwen3's long-context
              setting (their model cards), DeepSeek-V3's config.json (whose latent attention also scales its
              logits by mscale(factor, mscale_all_dim)^2, models/mla.py).

"dynamic" and "longrope" (and any other type) are refused in one line naming the key: their frequencies depend
on the sequence length or on per-dimension factor lists, which the decoder does not compute.
"""

from __future__ import annotations

import math

import numpy as np

from models.errors import UsageError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# The keys each supported type reads besides rope_type / rope_theta (transformers' validation functions).
ROPE_TYPE_KEYS = {"default": (), "linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings")}
YARN_OPTIONAL = {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}  # PaddleFormers' defaults
# transformers' further yarn keys: attention_factor (given, it is the cos/sin factor itself), truncate (true only)
YARN_IF_GIVEN = ("attention_factor", "truncate")


def _refuse(source: str, key: str, value, allowed: str) -> None:
    raise UsageError(f"model_name_or_path: {source}: {key} {value!r} cannot be computed by this toolkit's decoder "
                     f"(allowed: {allowed})")


def read_rope_config(raw: dict, source: str, yarn: bool = False) -> tuple[float | None, dict | None]:
    """(rope_theta or None when the file gives none, our rope_scaling or None) of a Hugging Face config.json.
    yarn: the family computes YaRN (DeepSeek-V3's latent attention)."""
    parameters = raw.get("rope_parameters")
    top_theta, legacy_scaling = raw.get("rope_theta"), raw.get("rope_scaling")
    if parameters is not None:
        if not isinstance(parameters, dict):
            _refuse(source, "rope_parameters", parameters, "a JSON object with rope_theta and rope_type")
        if "rope_type" not in parameters and "type" not in parameters and "full_attention" in parameters:
            # transformers 5 per layer type ({"full_attention": {...}, "sliding_attention": {...}})
            others = sorted(set(parameters) - {"full_attention"})
            if others:
                _refuse(source, "rope_parameters", parameters, "one set of rope parameters for full attention only")
            parameters = parameters["full_attention"]
        key = "rope_parameters"
        theta = parameters.get("rope_theta", top_theta)
        if top_theta is not None and theta is not None and float(top_theta) != float(theta):
            _refuse(source, "rope_theta", top_theta, f"the rope_parameters' rope_theta {theta} or none")
        if legacy_scaling and legacy_scaling != parameters:
            _refuse(source, "rope_scaling", legacy_scaling, "null beside rope_parameters (transformers 5 reads one)")
        scaling = parameters
    else:
        key, theta, scaling = "rope_scaling", top_theta, legacy_scaling or {}
        if not isinstance(scaling, dict):
            _refuse(source, "rope_scaling", scaling, "null or a JSON object with rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    supported = SUPPORTED_ROPE_TYPES + (("yarn",) if yarn else ())
    if kind not in supported:
        _refuse(source, f"{key}.rope_type", kind, ", ".join(supported))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(source, f"{key}.partial_rotary_factor", scaling["partial_rotary_factor"], "1.0 (every dimension rotated)")
    needed = ROPE_TYPE_KEYS[kind]
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise UsageError(f"model_name_or_path: {source}: {key} has no {missing[0]!r} "
                         f"(rope_type {kind!r} needs {', '.join(needed)})")
    optional = set(YARN_OPTIONAL) | set(YARN_IF_GIVEN) if kind == "yarn" else set()
    if kind == "yarn" and scaling.get("truncate", True) is not True:  # transformers 5's switch (default true)
        _refuse(source, f"{key}.truncate", scaling["truncate"], "true (the correction range in whole dimensions)")
    unread = sorted(set(scaling) - set(needed) - optional - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if unread:
        _refuse(source, f"{key}.{unread[0]}", scaling[unread[0]],
                f"for rope_type {kind!r} only {', '.join(('rope_theta',) + needed) or 'rope_theta'}")
    if kind == "default" or (kind == "linear" and float(scaling["factor"]) == 1.0):
        return theta, None
    if kind == "yarn":
        return theta, {"rope_type": kind, **{k: scaling[k] for k in needed},
                       **{k: scaling.get(k) or default for k, default in YARN_OPTIONAL.items()},
                       **({"attention_factor": scaling["attention_factor"]} if scaling.get("attention_factor") else {})}
    return theta, {"rope_type": kind, **{k: scaling[k] for k in needed}}


def scaled_inv_freq(inv_freq: np.ndarray, scaling: dict | None, theta: float = 10000.0) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] after `scaling` (ours: rope_type linear, llama3 or yarn)."""
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(2 * len(inv_freq), theta, scaling)
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if scaling["rope_type"] == "llama3":
        return llama3_scaled_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling {scaling!r}: unknown rope_type")  # read_rope_config admits no other


def llama3_scaled_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2] after Llama 3.1's scaling (float32 in and out)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor 0.1 mscale ln(scale) + 1 (1 for scale <= 1; PaddleFormers' yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_cos_sin_factor(scaling: dict | None) -> float:
    """What YaRN multiplies the cos/sin tables by: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    (1.0 for DeepSeek-V3, whose two are equal; their product enters the softmax scale instead, models/mla.py)."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    if scaling["mscale"] and scaling["mscale_all_dim"]:
        return yarn_mscale(scaling["factor"], scaling["mscale"]) / yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return yarn_mscale(scaling["factor"])


def yarn_inv_freq(dim: int, base: float, scaling: dict) -> np.ndarray:
    """YaRN's inverse frequencies [dim / 2], as PaddleFormers 0.4.1 _compute_yarn_parameters
    (paddleformers/transformers/deepseek_v2/modeling.py; truncate true), in float32."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001  # as theirs: no division by zero
    pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation).astype(np.float32)
