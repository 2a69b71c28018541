"""Whether this run asked for the CPU stand-ins of the GPU-only kernels (no Paddle imported here).

`LLM_PRETRAIN_KERNEL_STANDINS=1` is a testing aid (docs/gpu-verification.md): on CPU the preflight then
keeps use_flash_attention, use_fused_rope, use_fused_rms_norm and use_fast_layer_norm (instead of
dropping them with a warning) and turns on the swiglu kernel as a GPU run does, and
llm_pretrain/cpu/kernel_standins.py puts a CPU implementation behind each kernel those branches call.
So the branches a GPU run takes execute in the CPU parity tests. bf16/fp16 stay GPU-only (Paddle's CPU
build has no half-precision kernels). The preflight reads the switch before Paddle is imported, so this
module imports nothing but `os`.
"""

from __future__ import annotations

import os

KERNEL_STANDINS_ENV = "LLM_PRETRAIN_KERNEL_STANDINS"

# The run options whose GPU branch runs on CPU through a stand-in while the switch is set.
STANDIN_OPTIONS = ("use_flash_attention", "use_fused_rope", "use_fused_rms_norm", "use_fast_layer_norm")


def kernel_standins_requested(device: str) -> bool:
    """True on CPU when LLM_PRETRAIN_KERNEL_STANDINS is "1" (never on a GPU: there the real kernels run)."""
    return device == "cpu" and os.environ.get(KERNEL_STANDINS_ENV) == "1"
