"""Numeric formats numpy lacks, shared by the checkpoint format and the weight interchange."""

from __future__ import annotations

import numpy as np


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bit patterns -> float32 (bfloat16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
