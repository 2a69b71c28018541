"""Initial weights, and moving between full weights and a tensor-parallel rank's slice.

Initialization is independent of the parallel layout: every parameter is
drawn whole from a generator seeded by (seed, parameter name) and each rank
keeps its slice. A tp2 or pp2 run therefore starts from exactly the weights of
a single-process run with the same seed, which is what the parity tests
compare against, and what users expect when they change strategy mid-project.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import paddle

from models import parallel_layers as pl


def full_shape(param, tp_degree: int) -> list[int]:
    shape = list(param.shape)
    axis = getattr(param, "tp_split_axis", None)
    if axis is not None:
        shape[axis] *= tp_degree
    return shape


def _part_sizes(param, full_size: int) -> list[int]:
    parts = getattr(param, "tp_split_parts", None)
    return list(parts) if parts else [full_size]


def local_slice(full, param, tp_rank: int, tp_degree: int):
    """This rank's slice of a full weight (numpy array or paddle tensor)."""
    axis = getattr(param, "tp_split_axis", None)
    if axis is None or tp_degree == 1:
        return full
    pieces, start = [], 0
    for size in _part_sizes(param, full.shape[axis]):
        chunk = size // tp_degree
        index = [slice(None)] * full.ndim
        index[axis] = slice(start + tp_rank * chunk, start + (tp_rank + 1) * chunk)
        pieces.append(full[tuple(index)])
        start += size
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces, axis=axis) if isinstance(full, np.ndarray) else paddle.concat(pieces, axis=axis)


def merge_slices(slices: list[np.ndarray], param) -> np.ndarray:
    """The full weight from every tensor-parallel rank's slice, in rank order."""
    axis = getattr(param, "tp_split_axis", None)
    if axis is None or len(slices) == 1:
        return slices[0]
    tp_degree = len(slices)
    full_size = slices[0].shape[axis] * tp_degree
    parts = []
    offset = 0
    for size in _part_sizes(param, full_size):
        chunk = size // tp_degree
        index = [slice(None)] * slices[0].ndim
        index[axis] = slice(offset, offset + chunk)
        parts.append(np.concatenate([s[tuple(index)] for s in slices], axis=axis))
        offset += chunk
    return np.concatenate(parts, axis=axis)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


# PaddleNLP draws the output projection of each residual branch (attention o_proj, MLP down_proj)
# with std initializer_range / sqrt(2 * layers) in the families whose record says scaled_output_init
# (LLaMA/Baichuan: LlamaPretrainedModel._init_weights, Qwen: c_proj, Qwen2, GPT-3: out_proj, linear2,
# as GPT-2 does); Bloom draws them like every other weight.
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def weight_std(name: str, config) -> float:
    from models.families import get_family

    if get_family(config.family).scaled_output_init and name.endswith(OUTPUT_PROJECTIONS):
        return config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    return config.initializer_range


def initial_value(name: str, shape: list[int], std: float, seed: int):
    """Biases 0, norm weights 1, every other weight ~ N(0, std) (see `weight_std`)."""
    leaf = name.rsplit(".", 1)
    owner = leaf[0].rsplit(".", 1)[-1] if len(leaf) == 2 else ""
    if name.endswith("bias"):
        return paddle.zeros(shape, dtype="float32")
    if "norm" in owner:
        return paddle.ones(shape, dtype="float32")
    saved = paddle.get_rng_state()
    paddle.seed(_param_seed(seed, name))
    value = paddle.normal(mean=0.0, std=std, shape=shape)
    paddle.set_rng_state(saved)
    return value


@paddle.no_grad()
def init_weights(model, config, seed: int) -> None:
    """Give every parameter its layout-independent initial value."""
    tp_rank, tp_degree = pl.tensor_parallel_rank_and_degree(config)
    for name, param in model.canonical_named_parameters():
        value = initial_value(name, full_shape(param, tp_degree), weight_std(name, config), seed)
        param.set_value(local_slice(value, param, tp_rank, tp_degree).astype(param.dtype))


def host_tensor(array: np.ndarray, dtype):
    """A host array as a tensor of `dtype`. numpy has no bfloat16: Paddle gives bfloat16 weights to
    numpy (paddle.load(return_numpy=True), Tensor.numpy()) as their uint16 bit patterns, which must
    be reinterpreted, not converted as integers."""
    if array.dtype == np.uint16:
        return paddle.to_tensor(array).astype(dtype)  # uint16 -> bfloat16 bits -> dtype
    return paddle.to_tensor(array, dtype=dtype)


@paddle.no_grad()
def load_full_weights(model, config, full_state: dict, source: str) -> None:
    """Load full (unsharded) weights by canonical name; each rank keeps its slice.

    `full_state` should hold host (numpy) arrays (paddle.load(..., return_numpy=True)): only this
    rank's slice is copied to the device, never the whole checkpoint."""
    from models.errors import UsageError

    tp_rank, tp_degree = pl.tensor_parallel_rank_and_degree(config)
    for name, param in model.canonical_named_parameters():
        if name not in full_state:
            raise UsageError(f"weights {source} have no parameter {name!r}")
        value = full_state[name]
        value = value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)
        expected = full_shape(param, tp_degree)
        if list(value.shape) != expected:
            raise UsageError(f"weights {source}: {name} has shape {list(value.shape)}, the model needs {expected}")
        param.set_value(host_tensor(np.ascontiguousarray(local_slice(value, param, tp_rank, tp_degree)), param.dtype))


def load_weights_file(model, config, path: str) -> None:
    """continue_training: full weights from a file, read on the host (return_numpy=True); each rank
    copies only its slice to the device, never the whole checkpoint (26 GB for a 13B fp16 model)."""
    load_full_weights(model, config, paddle.load(path, return_numpy=True), path)
