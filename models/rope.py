"""Llama 3.1's rotary frequency scaling (config.json "rope_scaling" with rope_type "llama3").

Frequencies whose wavelength is shorter than original_max_position_embeddings / high_freq_factor
stay; those longer than original_max_position_embeddings / low_freq_factor are divided by
`factor`; the band between is interpolated smoothly. As Hugging Face transformers'
`_compute_llama3_parameters` (modeling_rope_utils.py) and Meta's llama3 reference
(`apply_scaling` in llama/model.py) compute it.
"""

from __future__ import annotations

import math

import numpy as np


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
