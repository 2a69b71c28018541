"""Initial weights, and moving between full weights and a tensor-parallel rank's slice.

Initialization is independent of the parallel layout: every parameter is
drawn whole from a generator seeded by (seed, parameter name) and each rank
keeps its slice. A tp2 or pp2 run therefore starts from exactly the weights of
a single-process run with the same seed, which is what the parity tests
compare against, and what users expect when they change strategy mid-project.
"""

from __future__ import annotations

import math
import os
import pickle
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
    """continue_training: full weights from a file, read on the host (as numpy); each rank copies only
    its slice to the device, never the whole checkpoint (26 GB for a 13B fp16 model). A Hugging Face
    directory's safetensors (models/hf_directory.py) are read and mapped one tensor at a time."""
    if path.endswith((".safetensors", ".safetensors.index.json")):
        from models.hf_directory import SafetensorsFiles, stream_hf_weights
        from models.registry import read_config_json

        raw = read_config_json(os.path.join(os.path.dirname(path), "config.json"))
        params = dict(model.canonical_named_parameters())
        load_weight_stream(model, config, stream_hf_weights(config, raw, SafetensorsFiles(path), path,
                                                            wanted=params.__contains__), path)
        return
    load_full_weights(model, config, read_paddle_pickle(path), path)


@paddle.no_grad()
def load_weight_stream(model, config, weights, source: str) -> None:
    """Full weights given one at a time as (canonical name, host array) (a Hugging Face directory,
    models/hf_directory.py): each rank copies its slice of each before the next is made; every parameter
    this rank holds must come (else one UsageError naming the first missing)."""
    from models.errors import UsageError

    params = dict(model.canonical_named_parameters())
    tp_rank, tp_degree = pl.tensor_parallel_rank_and_degree(config)
    loaded = set()
    for name, value in weights:
        param = params[name]
        if list(value.shape) != full_shape(param, tp_degree):  # the stream checked config.json's shapes: a bug
            raise RuntimeError(f"{name}: given {list(value.shape)}, the parameter needs {full_shape(param, tp_degree)}")
        param.set_value(host_tensor(np.ascontiguousarray(local_slice(value, param, tp_rank, tp_degree)), param.dtype))
        loaded.add(name)
    missing = [name for name in params if name not in loaded]
    if missing:
        raise UsageError(f"{source}: nothing gives parameter {missing[0]!r} ({len(missing)} missing)")


# ----------------------------------------------------------------------------- pickles someone else wrote
# paddle.load is pickle.load: a .pdparams from elsewhere could run any code while it is read. Every
# pickle this toolkit reads (PaddleNLP's .pdparams, checkpoints of the per-layout format, their RNG
# files) goes through `read_paddle_pickle`, whose unpickler builds only what a weights file holds.
# What a real paddle.save pickle contains (paddle/framework/io.py in Paddle 3.3.1, _pickle_save):
# a Tensor/parameter is reduced to (tuple, ((name, ndarray),)) (reduce_varbase, line 432), a
# DenseTensor to (eval, ("data", {"data": ndarray})) (reduce_DenseTensor, line 445); arrays are
# numpy's own reduce (_reconstruct, ndarray, dtype; scalars: multiarray.scalar); containers are
# dict, list, tuple and collections.OrderedDict (PaddleNLP's state dicts); under pickle protocol 2
# (paddle.save's protocol argument) bytes are written as _codecs.encode(text, "latin1").
_NUMPY_CORE = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")
_ADMITTED_NUMPY = {"_reconstruct", "scalar", "_frombuffer"}


def _dense_tensor_as_saved(expression, namespace):
    """Stands for `eval` in reduce_DenseTensor's (eval, ("data", {"data": array})): gives the array, evaluates nothing."""
    if expression != "data" or not isinstance(namespace, dict) or set(namespace) != {"data"}:
        raise pickle.UnpicklingError(f"eval({expression!r}) is not paddle.save's DenseTensor form")
    return namespace["data"]


def _latin1_bytes(text, encoding):
    """Stands for _codecs.encode, which pickle protocol 2 writes bytes (array data) with."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not how pickle protocol 2 writes bytes")
    return text.encode("latin1")


def _weights_dtype(*args):
    """numpy.dtype, refusing object arrays (their items would be arbitrary objects, never weights)."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"an array of dtype {dtype} (Python objects)")
    return dtype


class _WeightsUnpickler(pickle.Unpickler):
    """Builds only NumPy arrays, dtypes and scalars and plain containers; anything else is refused."""

    def __init__(self, file, extra: dict):
        super().__init__(file, encoding="latin1")  # as paddle.load (Python 2 era pickles)
        self.extra = extra

    def find_class(self, module, name):
        import builtins
        import collections

        if (module, name) in self.extra:
            return self.extra[(module, name)]
        if module in ("builtins", "__builtin__"):
            if name in ("tuple", "list", "dict", "set", "frozenset", "bytearray", "complex"):
                return getattr(builtins, name)
            if name == "eval":
                return _dense_tensor_as_saved
        if module == "_codecs" and name == "encode":
            return _latin1_bytes
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "numpy" and name == "ndarray":
            return np.ndarray
        if module == "numpy" and name == "dtype":
            return _weights_dtype
        if module in _NUMPY_CORE and name in _ADMITTED_NUMPY:
            # numpy 2 moved numpy.core to numpy._core; files written under either are read the same way
            core = getattr(np, "_core", None) or np.core
            return getattr(core.multiarray if name != "_frombuffer" else core.numeric, name)
        raise pickle.UnpicklingError(f"it would load {module}.{name}")


def _tensor_tuples_to_arrays(obj):
    """paddle.load(return_numpy=True)'s result: each (name, array) a saved Tensor became is its array."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], np.ndarray):
        return obj[1]
    if isinstance(obj, dict):
        for key in list(obj):
            obj[key] = _tensor_tuples_to_arrays(obj[key])
        return obj
    if isinstance(obj, list):
        return [_tensor_tuples_to_arrays(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_tensor_tuples_to_arrays(v) for v in obj)
    return obj


def read_paddle_pickle(path: str, allow: dict | None = None):
    """What paddle.load(path, return_numpy=True) gives for a paddle.save pickle (a .pdparams / .pdopt),
    read without running code: tensors as numpy arrays, the name table dropped, big parameters saved
    in slices joined again (paddle/framework/io_utils.py _pack_loaded_dict).

    allow: further {(module, name): callable} the caller's own files need (the old RNG files'
    paddle GeneratorState). A file that would build anything else is one UsageError naming it."""
    from models.errors import UsageError

    try:
        with open(path, "rb") as f:
            loaded = _WeightsUnpickler(f, allow or {}).load()
    except OSError as error:
        raise UsageError(f"{path} cannot be read: {error.strerror or error}") from None
    except pickle.UnpicklingError as error:
        if str(error).startswith("it would load"):
            raise UsageError(f"{path} refused: unpickling {error}, which a weights file never holds (only NumPy "
                             "arrays, dtypes and plain containers are read: the file could run code)") from None
        raise UsageError(f"{path} refused: not a Paddle weights pickle ({error})") from None
    except Exception as error:  # truncated or not a pickle at all
        raise UsageError(f"{path} is not a Paddle weights pickle ({type(error).__name__}: {error})") from None
    if isinstance(loaded, dict):
        loaded.pop("StructuredToParameterName@@", None)
        pieces = loaded.pop("UnpackBigParamInfor@@", None)  # (Paddle's spelling)
        for key, info in (pieces or {}).items():
            loaded[key] = np.concatenate([loaded.pop(part) for part in info["slices"]]).reshape(info["OriginShape"])
    return _tensor_tuples_to_arrays(loaded)
