"""What goes into a checkpoint: every tensor by its single-process name, stored as slices with offsets.

A checkpoint describes each logical tensor by the name it has in a single-process run, its
global shape and dtype:

    layers.0.mlp.up_proj.weight                 a parameter (canonical name, models/decoder.py)
    layers.0.mlp.up_proj.weight/moment1_0       its AdamW moments, beta-power accumulators
    layers.0.mlp.up_proj.weight/beta1_pow_acc_0 ("step counters"), fp32 master weight under
    layers.0.mlp.up_proj.weight/master_weight   AMP O2 (Paddle's accumulator suffixes)

Each rank writes the slices it holds to its own file `tensors.rankNNNNN.safetensors`, one
entry per slice, concurrently and without gathering anything; `tensors.index.json` maps each
tensor to its slices (global offsets and shape) and the file holding each, as PyTorch's DCP
and Megatron's dist-checkpointing do. A slice is a box of the global tensor:

    tensor parallel      the rank's rows/columns (a fused q|k|v or gate|up projection gives one
                         box per fused part, since each part is split on its own)
    sharding stage 3     the rank's range of the flattened parameter (Paddle slices parameters
                         above 2**20 elements, group_sharded_stage3.py _param_storage), cut into
                         at most a few boxes (`flat_boxes`)
    replicated copies    written once: data-parallel replicas, tensor-parallel replicas (norms,
                         GQA's replicated kv projections), sharding stage 1/2 weights (by the
                         rank that owns the parameter in Paddle's assignment), the pipeline's
                         copy of a tied embedding (by the first stage)

Loading reads, for each tensor a rank holds under its own layout, only the boxes that overlap
its part (safetensors reads slices of a memory-mapped file), whatever layout wrote them; the
optimizer gets only the states of the parameters Paddle assigns to this rank.

safetensors rather than Paddle's pickles: a file is a JSON header plus raw arrays, so partial
reads need no unpickling of the whole shard, and it is what PaddleNLP's unified checkpoint and
the Hugging Face ecosystem read.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass

import numpy as np
import paddle

from llm_pretrain.errors import UsageError
from models.dtypes import bfloat16_bits_to_float32

INDEX_FILE = "tensors.index.json"
FORMAT_VERSION = 1
SCALAR_STATES = ("beta1_pow_acc_0", "beta2_pow_acc_0")  # one value per parameter (shape [1])
MASTER_WEIGHT = "master_weight"
STAGE3_SLICE_PREFIX = "slice@"  # Paddle's name for a stage-3 slice of a parameter (group_sharded_stage3.py)


def data_file(rank: int) -> str:
    return f"tensors.rank{rank:05d}.safetensors"


def _fragment_file(rank: int) -> str:
    return f"tensors.rank{rank:05d}.index.json"


def is_layout_free(path: str) -> bool:
    """A checkpoint in this format (older checkpoints hold per-layout model_state/optimizer files)."""
    return os.path.isfile(os.path.join(path, INDEX_FILE))


# ----------------------------------------------------------------------------- where a rank's data sits
@dataclass
class Piece:
    """A box of a global tensor (offsets, shape) and where it sits in this rank's local array:
    a tuple of slices (tensor-parallel part) or a flat range (a stage-3 slice, 1-D storage)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    local: tuple | slice

    def take(self, local: np.ndarray) -> np.ndarray:
        if isinstance(self.local, slice):
            return local.reshape(-1)[self.local].reshape(self.shape)
        return local[self.local]

    def put(self, local: np.ndarray, value: np.ndarray) -> None:
        if isinstance(self.local, slice):
            local.reshape(-1)[self.local] = value.reshape(-1)
        else:
            local[self.local] = value


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (offsets, shape) covering the row-major flat range [start, stop) of a tensor of `shape`:
    a partial first row, whole rows, a partial last row (recursively for more dimensions)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    boxes = []
    if start % row:
        first = start // row
        end = min(stop, (first + 1) * row)
        boxes += [((first,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], start - first * row, end - first * row)]
        start = end
    whole = (stop - start) // row
    if whole:
        boxes.append(((start // row,) + (0,) * (len(shape) - 1), (whole,) + tuple(shape[1:])))
        start += whole * row
    if start < stop:
        last = start // row
        boxes += [((last,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], 0, stop - start)]
    return boxes


def tensor_parallel_pieces(param, tp_rank: int, tp_degree: int) -> list[Piece]:
    """The boxes of the full parameter that this tensor-parallel rank holds (models/weights.py local_slice)."""
    local_shape = tuple(param.shape)
    axis = getattr(param, "tp_split_axis", None)
    if axis is None or tp_degree == 1:
        return [Piece((0,) * len(local_shape), local_shape, (slice(None),) * len(local_shape))]
    full = local_shape[axis] * tp_degree
    pieces, global_start, local_start = [], 0, 0
    for size in (getattr(param, "tp_split_parts", None) or [full]):
        chunk = size // tp_degree
        offsets = [0] * len(local_shape)
        offsets[axis] = global_start + tp_rank * chunk
        shape = list(local_shape)
        shape[axis] = chunk
        index = [slice(None)] * len(local_shape)
        index[axis] = slice(local_start, local_start + chunk)
        pieces.append(Piece(tuple(offsets), tuple(shape), tuple(index)))
        global_start += size
        local_start += chunk
    return pieces


def stage3_pieces(global_shape: tuple[int, ...], sharding_rank: int, slice_length: int) -> list[Piece]:
    """The boxes of a stage-3 sliced parameter held by this rank: Paddle pads the flattened
    parameter to a multiple of the group size and gives rank r the range [r*L, (r+1)*L)
    (group_sharded_stage3.py _flatten_layer_params / _param_storage); the padding is not data."""
    start = sharding_rank * slice_length
    stop = min(start + slice_length, math.prod(global_shape))
    pieces = []
    for offsets, shape in flat_boxes(tuple(global_shape), start, stop):
        flat_start = int(np.ravel_multi_index(offsets, global_shape)) - start
        pieces.append(Piece(offsets, shape, slice(flat_start, flat_start + math.prod(shape))))
    return pieces


def _stage3_storage(param):
    """The rank's flat slice of a stage-3 sliced parameter (None when the parameter is held whole)."""
    return getattr(param, "fw_storage", None)


@dataclass
class Holding:
    """One parameter as this rank holds it."""

    name: str            # canonical (single-process) name
    param: object
    global_shape: tuple[int, ...]
    pieces: list[Piece]
    stage3_slice: bool   # held as Paddle's stage-3 flat slice (param.fw_storage)
    tp_replicated: bool  # the same on every tensor-parallel rank
    is_tied_copy: bool   # the pipeline's second copy of a tied embedding


def holdings(model, layout) -> list[Holding]:
    from models.pipeline import is_replica
    from models.weights import full_shape

    tp = layout.tensor_parallel_degree
    result = []
    for name, param in model.canonical_named_parameters():
        global_shape = tuple(full_shape(param, tp))
        storage = _stage3_storage(param)
        if storage is not None:  # stage 3 is refused with tensor parallelism, so the slice is of the full tensor
            pieces = stage3_pieces(global_shape, layout.sharding_rank, int(storage.shape[0]))
        else:
            pieces = tensor_parallel_pieces(param, layout.tensor_parallel_rank, tp)
        replicated = tp > 1 and getattr(param, "tp_split_axis", None) is None
        result.append(Holding(name, param, global_shape, pieces, storage is not None, replicated, is_replica(param)))
    return result


# ----------------------------------------------------------------------------- sharding ownership
def _sharding_optimizer(optimizer):
    """(parameter name -> the sharding rank that keeps its optimizer state, this sharding rank) under
    sharding stage 1 or 2; (None, None) otherwise (every rank keeps the state of what it holds)."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )

    inner, seen = optimizer, 0
    while inner is not None and seen < 8:
        # Stage 1: fleet's hybrid optimizer wraps DygraphShardingOptimizer, which gives each
        # sharding rank a greedy size-balanced part of the parameters (_partition_parameters).
        if isinstance(inner, DygraphShardingOptimizer):
            return dict(inner._param2rank), inner._sharding_rank
        # Stage 2: the same greedy balance in GroupShardedOptimizerStage2._segment_params.
        if isinstance(inner, GroupShardedOptimizerStage2):
            return dict(inner.param2rank), inner._rank
        inner = inner.__dict__.get("_inner_opt") or inner.__dict__.get("_optim")
        seen += 1
    return None, None


def _expert_optimizer(optimizer):
    """The experts' own optimizer path under expert parallelism over sharding ranks (None otherwise)."""
    from llm_pretrain.parallel.expert_optimizer import ExpertShardedOptimizer

    return optimizer if isinstance(optimizer, ExpertShardedOptimizer) else None


def _writes(name: str, layout, tp_replicated: bool, sharding_owner: int | None, expert: bool = False) -> bool:
    """Whether this rank writes a tensor that several ranks hold identically: replicas are spread
    over the ranks by a hash of the name, so that every rank writes a similar share. An expert under
    expert parallelism is held by one rank of each expert group (models/moe.py): the first group's writes it."""
    spread = zlib.crc32(name.encode())
    if not expert and layout.data_parallel_rank != spread % layout.data_parallel_degree:
        return False
    if tp_replicated and layout.tensor_parallel_rank != spread % layout.tensor_parallel_degree:
        return False
    if layout.sep_parallel_rank != spread % layout.sequence_group_degree:  # sep / cp ranks hold the same weights
        return False
    return sharding_owner is None or layout.sharding_rank == sharding_owner


def _split_state_key(key: str, by_internal: dict[str, Holding]) -> tuple[Holding, str]:
    """'slice@linear_3.w_0_moment1_0' -> (its parameter, 'moment1_0'); a master weight's key is the
    parameter's name itself."""
    bare = key[len(STAGE3_SLICE_PREFIX):] if key.startswith(STAGE3_SLICE_PREFIX) else key
    # Parameter names are prefixes of their state names; the longest match is the right one
    # ("linear_1.w_0" is a prefix of "linear_1.w_0_moment1_0", not of "linear_11.w_0_...").
    for length in range(len(bare), 0, -1):
        holding = by_internal.get(bare[:length])
        if holding is not None and (length == len(bare) or bare[length] == "_"):
            return holding, bare[length + 1:] or MASTER_WEIGHT
    raise ValueError(f"optimizer state {key!r} belongs to no parameter of the model")


# ----------------------------------------------------------------------------- save
def _dtype_name(tensor) -> str:
    """The logical dtype ("float32", "bfloat16"); bfloat16 has no numpy dtype: numpy() gives its raw uint16 bits."""
    return str(tensor.dtype).replace("paddle.", "")


@dataclass
class HeldTensor:
    """One tensor of the checkpoint (a parameter or one of its optimizer states) as this rank holds it."""

    name: str            # "<parameter>" or "<parameter>/<state suffix>"
    holding: Holding
    suffix: str | None   # the optimizer state's suffix, None for the parameter itself
    tensor: object       # the local tensor (a stage-3 slice's flat storage)
    global_shape: tuple[int, ...]
    pieces: list[Piece]

    @property
    def is_scalar_state(self) -> bool:
        return self.suffix in SCALAR_STATES


def held_tensors(model, optimizer, layout) -> list[HeldTensor]:
    """Every parameter and optimizer state this rank holds, with the boxes of the global tensor it
    holds: what save_state writes (minus the copies another rank writes) and what
    llm_pretrain/checkpoint/replica_check.py compares across ranks."""
    held = holdings(model, layout)
    by_internal = {h.param.name: h for h in held}
    result = [HeldTensor(h.name, h, None, _stage3_storage(h.param) if h.stage3_slice else h.param,
                         h.global_shape, h.pieces) for h in held]
    state = dict(optimizer.state_dict())
    state.pop("LR_Scheduler", None)
    master = state.pop("master_weights", None) or {}
    for key, value in list(state.items()) + list(master.items()):
        h, suffix = _split_state_key(key, by_internal)
        scalar = suffix in SCALAR_STATES
        result.append(HeldTensor(f"{h.name}/{suffix}", h, suffix, value, (1,) if scalar else h.global_shape,
                                 [Piece((0,), (1,), (slice(None),))] if scalar else h.pieces))
    return result


def save_state(directory: str, model, optimizer, layout) -> list[str]:
    """Write this rank's slices of the weights and optimizer state (every rank calls this); returns
    the names of the files written (the checkpointer lists them in its manifest)."""
    return write_snapshot(directory, layout, snapshot_state(model, optimizer, layout, copy=False))


def snapshot_state(model, optimizer, layout, copy: bool = True) -> tuple[list, dict | None]:
    """What save_state writes: (tensor name, local tensor, global shape, pieces, dtype) of each tensor
    this rank writes, and the LR schedule's state. copy: every tensor copied to host memory now (the
    asynchronous save writes the copy while training changes the originals): NumPy on CPU, pinned
    host memory on GPU (Tensor.pin_memory, paddle/base/dygraph/tensor_patch_methods.py:1198)."""
    owners, _ = _sharding_optimizer(optimizer)
    experts = _expert_optimizer(optimizer)
    to_write: list[tuple[str, object, tuple, list[Piece], str]] = []  # (name, local tensor, global shape, pieces, dtype)

    def sharding_owner(holding: Holding) -> int | None:
        if experts is not None and getattr(holding.param, "expert_parallel", False):
            return None  # not in the dense sharding: the expert's replicas decide (below)
        if layout.sharding_stage in (1, 2) and owners is not None:
            return owners[holding.param.name]
        if layout.sharding_stage == 3 and not holding.stage3_slice:  # held whole on every sharding rank
            return zlib.crc32(holding.name.encode()) % layout.sharding_degree
        return None

    lr_scheduler = optimizer.state_dict().get("LR_Scheduler")
    for t in held_tensors(model, optimizer, layout):
        h = t.holding
        if t.suffix is None:
            owner, replicated = sharding_owner(h), h.tp_replicated
        else:
            # Stage 1/2 states exist only on the owning rank; stage-3 states of whole parameters on all.
            # A scalar state (beta powers) is the same on every rank that holds a part of the parameter.
            owner = sharding_owner(h) if layout.sharding_stage == 3 else None
            if t.is_scalar_state and h.stage3_slice:
                owner = zlib.crc32(h.name.encode()) % layout.sharding_degree
            replicated = h.tp_replicated or t.is_scalar_state
        expert = getattr(h.param, "expert_parallel", False)
        # A copy of an expert another expert group's rank writes; but the expert's optimizer states, when
        # sharded over its replicas (the moe_sharding group), exist only on the rank keeping them.
        states_sharded = t.suffix is not None and experts is not None and experts.sharded
        if expert and h.param.expert_replica and not states_sharded:
            continue
        if h.is_tied_copy or not _writes(h.name, layout, replicated, owner, expert):
            continue
        tensor = t.tensor
        dtype = _dtype_name(tensor)
        if copy and not isinstance(tensor, np.ndarray):
            tensor = tensor.pin_memory() if tensor.place.is_gpu_place() else tensor.numpy()  # numpy() copies
        to_write.append((t.name, tensor, t.global_shape, t.pieces, dtype))
    return to_write, lr_scheduler


def host_state_bytes(snapshot: tuple[list, dict | None]) -> int:
    """The host memory a snapshot holds."""
    return sum(_nbytes(tensor) for _, tensor, _, _, _ in snapshot[0])


def _nbytes(tensor) -> int:
    if isinstance(tensor, np.ndarray):
        return tensor.nbytes
    return int(np.prod(tensor.shape)) * np.dtype(_storage_dtype(_dtype_name(tensor))).itemsize


def write_snapshot(directory: str, layout, snapshot: tuple[list, dict | None]) -> list[str]:
    """Write a snapshot_state as this rank's files (any thread); returns their names."""
    to_write, lr_scheduler = snapshot
    entries = _write_safetensors(directory, layout.rank, to_write)
    fragment = {"tensors": entries}
    if layout.rank == 0 and lr_scheduler is not None:
        fragment["lr_scheduler"] = {k: (v.item() if hasattr(v, "item") else v) for k, v in lr_scheduler.items()}
    with open(os.path.join(directory, _fragment_file(layout.rank)), "w") as f:
        json.dump(fragment, f)
    return [name for name in (data_file(layout.rank), _fragment_file(layout.rank))
            if os.path.exists(os.path.join(directory, name))]


# safetensors' names of the numpy dtypes a checkpoint holds (bfloat16 travels as its uint16 bits)
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "uint16": "U16", "int64": "I64",
                      "int32": "I32", "uint8": "U8", "bool": "BOOL"}


def _write_safetensors(directory: str, rank: int, to_write) -> dict[str, dict]:
    """Write the pieces as one safetensors file, streaming one tensor at a time (safetensors'
    own save_file first copies every array into one bytes object: twice the rank's state in
    memory). Returns the index entries of this rank."""
    entries: dict[str, dict] = {}
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor, global_shape, pieces, dtype in to_write:
        numpy_dtype = np.dtype(_storage_dtype(dtype))
        entry = entries.setdefault(name, {"shape": list(global_shape), "dtype": dtype, "slices": []})
        for piece in pieces:
            key = f"{name}@{','.join(map(str, piece.offsets))}"
            size = math.prod(piece.shape) * numpy_dtype.itemsize
            header[key] = {"dtype": SAFETENSORS_DTYPES[numpy_dtype.name], "shape": list(piece.shape),
                           "data_offsets": [offset, offset + size]}
            offset += size
            entry["slices"].append({"file": data_file(rank), "key": key, "offsets": list(piece.offsets),
                                    "shape": list(piece.shape)})
    if not header:
        return entries
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(os.path.join(directory, data_file(rank)), "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for _, tensor, _, pieces, _ in to_write:
            # A state loaded before the optimizer's first step is still the NumPy array set_state_dict
            # keeps until the accumulator exists (a resume whose first steps are skipped data).
            local = tensor if isinstance(tensor, np.ndarray) else tensor.numpy()
            for piece in pieces:
                f.write(np.ascontiguousarray(piece.take(local)).data)
    return entries


def finish_save(directory: str, world_size: int, layout_summary: dict) -> None:
    """On one rank after every rank's save_state: merge the ranks' lists into the index and
    check that the slices cover every tensor exactly (a gap would be a bug in the writers)."""
    tensors: dict[str, dict] = {}
    lr_scheduler = None
    for rank in range(world_size):
        path = os.path.join(directory, _fragment_file(rank))
        with open(path) as f:
            fragment = json.load(f)
        os.remove(path)
        lr_scheduler = fragment.get("lr_scheduler", lr_scheduler)
        for name, entry in fragment["tensors"].items():
            merged = tensors.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "slices": []})
            merged["slices"] += entry["slices"]
    for name, entry in tensors.items():
        covered = sum(math.prod(s["shape"]) for s in entry["slices"])
        if covered != math.prod(entry["shape"]):
            raise RuntimeError(f"checkpoint {directory}: the slices of {name} cover {covered} of "
                               f"{math.prod(entry['shape'])} elements")
    index = {"format": FORMAT_VERSION, "saved_with_layout": layout_summary, "lr_scheduler": lr_scheduler,
             "tensors": dict(sorted(tensors.items()))}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=1)


# ----------------------------------------------------------------------------- load
class CheckpointReader:
    """Reads boxes of a checkpoint's tensors, opening each file once (memory-mapped by safetensors)."""

    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, INDEX_FILE)) as f:
            self.index = json.load(f)
        self.tensors: dict[str, dict] = self.index["tensors"]
        self._open: dict[str, object] = {}

    def _file(self, name: str, file: str):
        if file not in self._open:
            path = os.path.join(self.directory, file)
            if not os.path.isfile(path):
                raise UsageError(f"checkpoint {self.directory}: tensor {name} has a slice in {file}, which is missing")
            from safetensors import safe_open

            self._open[file] = safe_open(path, framework="np")
        return self._open[file]

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise UsageError(f"checkpoint {self.directory} has no tensor {name} ({INDEX_FILE})")
        return self.tensors[name]

    def read(self, name: str, offsets, shape) -> np.ndarray:
        """The box (offsets, shape) of a tensor, assembled from the slices that overlap it."""
        entry = self.entry(name)
        for s in entry["slices"]:  # the common case, the same layout: one slice is exactly the box
            if list(s["offsets"]) == list(offsets) and list(s["shape"]) == list(shape):
                return self._file(name, s["file"]).get_slice(s["key"])[tuple(slice(None) for _ in shape)]
        out = np.empty(tuple(shape), dtype=_storage_dtype(entry["dtype"]))
        covered = 0
        for s in entry["slices"]:
            low = [max(a, b) for a, b in zip(offsets, s["offsets"])]
            high = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, s["offsets"], s["shape"])]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            source = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, s["offsets"]))
            target = tuple(slice(lo - a, hi - a) for lo, hi, a in zip(low, high, offsets))
            out[target] = self._file(name, s["file"]).get_slice(s["key"])[source]
            covered += math.prod(hi - lo for lo, hi in zip(low, high))
        if covered != math.prod(shape):
            files = sorted({s["file"] for s in entry["slices"]})
            raise UsageError(f"checkpoint {self.directory}: tensor {name} is missing slices at offsets "
                             f"{list(offsets)} shape {list(shape)} (the index lists files {', '.join(files)})")
        return out

    def read_full(self, name: str) -> np.ndarray:
        shape = self.entry(name)["shape"]
        return self.read(name, (0,) * len(shape), shape)

    def parameter_names(self) -> list[str]:
        return [name for name in self.tensors if "/" not in name]

    def states_of(self, name: str) -> list[str]:
        prefix = name + "/"
        return [t[len(prefix):] for t in self.tensors if t.startswith(prefix)]


def _storage_dtype(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def _read_local(reader: CheckpointReader, name: str, pieces: list[Piece], local_shape, flat: bool) -> np.ndarray:
    """This rank's local array of a tensor, assembled from the boxes of its pieces."""
    if len(pieces) == 1 and not flat and tuple(pieces[0].shape) == tuple(local_shape):
        return reader.read(name, pieces[0].offsets, pieces[0].shape)  # one box: no assembling copy
    dtype = _storage_dtype(reader.entry(name)["dtype"])
    local = np.zeros(local_shape, dtype) if flat else np.empty(local_shape, dtype)  # stage-3 padding stays 0
    for piece in pieces:
        piece.put(local, reader.read(name, piece.offsets, piece.shape))
    return local


def _value(array: np.ndarray, saved_dtype: str, dtype: str):
    """The stored array as `dtype`: a numpy array (Tensor.set_value copies it once) or, for
    bfloat16 (stored as its uint16 bits), a Paddle tensor."""
    if saved_dtype == dtype:
        return array if dtype != "bfloat16" else paddle.to_tensor(array).view(paddle.bfloat16)
    if "bfloat16" not in (saved_dtype, dtype):
        return array.astype(dtype)
    tensor = paddle.to_tensor(array)
    if saved_dtype == "bfloat16":
        tensor = tensor.view(paddle.bfloat16)
    return tensor.astype(dtype)


def check_shapes(reader: CheckpointReader, model, layout) -> None:
    for h in holdings(model, layout):
        saved = tuple(reader.entry(h.name)["shape"])
        if saved != h.global_shape:
            raise UsageError(f"checkpoint {reader.directory}: {h.name} has shape {list(saved)}, the model needs "
                             f"{list(h.global_shape)}")


@paddle.no_grad()
def load_state(directory: str, model, optimizer, layout) -> None:
    """Give this rank's parameters and optimizer the values of the checkpoint, whatever layout wrote it."""
    with CheckpointReader(directory) as reader:
        _load_state(reader, model, optimizer, layout)


def _load_state(reader: CheckpointReader, model, optimizer, layout) -> None:
    held = holdings(model, layout)
    check_shapes(reader, model, layout)
    for h in held:
        target = _stage3_storage(h.param) if h.stage3_slice else h.param
        local = _read_local(reader, h.name, h.pieces, tuple(target.shape), flat=h.stage3_slice)
        target.set_value(_value(local, reader.entry(h.name)["dtype"], _dtype_name(target)))

    owners, sharding_rank = _sharding_optimizer(optimizer)
    experts = _expert_optimizer(optimizer)
    state: dict = {}
    master: dict = {}
    for h in held:
        if experts is not None and getattr(h.param, "expert_parallel", False):
            if not experts.owns_expert_state(h.param):
                continue  # another rank of the expert's moe_sharding group keeps its optimizer state
        elif owners is not None and owners.get(h.param.name) != sharding_rank:
            continue  # stage 1/2: another sharding rank keeps this parameter's optimizer state
        prefix = STAGE3_SLICE_PREFIX if h.stage3_slice else ""
        local_shape = tuple((_stage3_storage(h.param) if h.stage3_slice else h.param).shape)
        for suffix in reader.states_of(h.name):
            name = f"{h.name}/{suffix}"
            saved_dtype = reader.entry(name)["dtype"]
            if suffix in SCALAR_STATES:
                local = reader.read(name, (0,), (1,))
            else:
                local = _read_local(reader, name, h.pieces, local_shape, flat=h.stage3_slice)
            key = prefix + h.param.name
            if suffix == MASTER_WEIGHT:  # used as the variable itself (Optimizer._create_master_weight)
                value = paddle.to_tensor(_value(local, saved_dtype, "float32"))
                value.name = key + "_fp32_master_0"
                master[key] = value
            else:  # copied into the accumulator by Tensor.set_value (Optimizer.set_state_dict/_add_accumulator)
                state[f"{key}_{suffix}"] = _value(local, saved_dtype, saved_dtype)
    if master:
        state["master_weights"] = master
    if reader.index.get("lr_scheduler") is not None:
        state["LR_Scheduler"] = dict(reader.index["lr_scheduler"])
    optimizer.set_state_dict(state)


def read_full_weights(directory: str) -> dict[str, np.ndarray]:
    """Every parameter whole (canonical names): the single-process view, for export and tests."""
    weights = {}
    with CheckpointReader(directory) as reader:
        for name in reader.parameter_names():
            array = reader.read_full(name)
            if reader.entry(name)["dtype"] == "bfloat16":  # raw bits -> float32
                array = bfloat16_bits_to_float32(array)
            weights[name] = array
    return weights


# ----------------------------------------------------------------------------- what may resume what
# Architecture keys that change no tensor: a run may resume with other values of these.
NOT_IN_TENSORS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range")


def check_resumable(path: str, trainer_state: dict, architecture: dict, max_seq_length: int,
                    layout_summary: dict) -> None:
    """Before any process group exists: the checkpoint must be of the same model (architecture,
    vocabulary, sequence length); its layout may differ, except for checkpoints written before
    this format, which load only under the layout that wrote them."""
    saved = trainer_state.get("model_config") or {}
    differences = [f"{key} {saved.get(key)!r} in the checkpoint, {architecture.get(key)!r} now"
                   for key in sorted(set(saved) | set(architecture))
                   if key not in NOT_IN_TENSORS and saved.get(key) != architecture.get(key)]
    saved_seq = (trainer_state.get("args") or {}).get("max_seq_length")
    if saved_seq is not None and saved_seq != max_seq_length:
        differences.append(f"max_seq_length {saved_seq} in the checkpoint, {max_seq_length} now")
    if differences:
        raise UsageError(f"checkpoint {path} is of another model: {'; '.join(differences)} "
                         "(set overwrite_output_dir to start over)")
    saved_layout = trainer_state.get("layout")
    if not is_layout_free(path) and saved_layout != layout_summary:
        raise UsageError(f"checkpoint {path} is in the per-layout format of earlier versions and loads only under "
                         f"the layout that wrote it ({saved_layout}); to convert it, resume it under that layout "
                         "until its next save (which writes the layout-free format), then change the layout")
