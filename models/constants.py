"""Constant tensors that every decoder layer of a forward needs alike (the causal mask, the ALiBi bias, the
flash kernel's additive mask): built once for the run's shapes on the current device and shared by every
layer and every forward, instead of once per layer. The layers' attention inputs differ; these do not, and
the flash kernel keeps its mask for the backward: per layer, Bloom-7b1's [batch, 16, 2048, 2048] bf16 mask
under tp2 is 128 MB per sample, 30 layers of identical copies (issue 33, finding 5). PaddleNLP 2.8.1 builds
the causal mask and the ALiBi tensor once per forward too (paddlenlp/transformers/llama/modeling.py
LlamaModel.forward: build_alibi_tensor, _prepare_decoder_attention_mask; bloom/modeling.py BloomModel.forward),
though it adds the two in every layer (llama/modeling.py scaled_dot_product_attention).

`BUILDS` counts the constructions by kind (tests/test_attention_masks.py)."""

from __future__ import annotations

import threading
from collections import Counter

import paddle

_CONSTANTS: dict = {}
BUILDS: Counter = Counter()
_LOCK = threading.RLock()  # the ring's tests run ranks as threads of one process; builds may nest
# A run uses a few shapes (training and evaluation batch sizes, the ring's ranks); beyond this many the oldest go.
MAX_CONSTANTS = 64


def shared_constant(kind: str, key: tuple, build):
    """`build()` (a tensor without gradient) for (kind, key) on the current device, made once outside
    autocast (the masks are float32 or cast explicitly) and returned to every later caller."""
    full_key = (kind, *key, paddle.get_device())
    with _LOCK:
        if full_key not in _CONSTANTS:
            with paddle.no_grad(), paddle.amp.auto_cast(False):
                value = build()
            value.stop_gradient = True
            if len(_CONSTANTS) >= MAX_CONSTANTS:
                del _CONSTANTS[next(iter(_CONSTANTS))]
            _CONSTANTS[full_key] = value
            BUILDS[kind] += 1
        return _CONSTANTS[full_key]


def release() -> None:
    """Drop every constant (a new model: another run in the same process must not keep the last one's masks)."""
    with _LOCK:
        _CONSTANTS.clear()


def clear() -> None:
    with _LOCK:
        _CONSTANTS.clear()
        BUILDS.clear()
