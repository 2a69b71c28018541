"""Numeric formats numpy lacks, shared by the checkpoint format and the weight interchange."""

from __future__ import annotations

import numpy as np


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bit patterns -> float32 (bfloat16 is float32's upper half)."""
    wide = bits.astype(np.uint32)
    wide <<= 16  # in place: one float32-sized array, not two (loading an embedding of a 7B model: 2 GB less)
    return wide.view(np.float32)


def _float8_e4m3fn_values() -> np.ndarray:
    """The 256 codes of float8 e4m3fn (OCP FP8 spec; torch.float8_e4m3fn, safetensors "F8_E4M3") as float32:
    sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal; no infinities, S.1111.111 NaN."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


FLOAT8_E4M3FN_VALUES = _float8_e4m3fn_values()


def float8_e4m3fn_to_float32(codes: np.ndarray) -> np.ndarray:
    """float8 e4m3fn values given as their uint8 codes -> float32, exactly (every code is a float32)."""
    return FLOAT8_E4M3FN_VALUES[codes]
