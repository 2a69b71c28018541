"""Training straight from a Hugging Face model directory: its safetensors read one tensor at a time.

    config.json                         transformers 4.x or 5.x form (models/registry.py config_from_dict)
    model.safetensors                   or model-0000N-of-0000M.safetensors + model.safetensors.index.json
    tokenizer files                     read by the run's tokenizer (tokenizer_name_or_path defaults to the directory)

`stream_hf_weights` maps Hugging Face's names to ours with the family's import
table (models/families/<family>.py; the same table `llm-import-hf` and scripts/import_paddlenlp.py use)
as it reads: each Hugging Face tensor is read from its file (seek + read: nothing else of the file is
touched), split / transposed into our tensors, and each rank copies its slice of them into its
parameters (models/weights.py load_weights_file) before the next tensor is read. Peak host memory is therefore a few times the largest
tensor, never a shard or the model (benchmarks/checkpoint_io.md).

Before any tensor is read, the file headers are checked against the model: a tensor the model needs
and no file holds, or one the files hold and the model has no place for, is one line naming it;
a tensor of the wrong shape names itself and both shapes when it is read (before any training).
safetensors holds no code: a header is JSON, the rest raw numbers.

FP8 files (deepseek-ai/DeepSeek-V3's: config.json quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128]}, checked by models/families/hf_config_keys.py) are dequantized as they are
read, as DeepSeek's own inference/fp8_cast_bf16.py does (github.com/deepseek-ai/DeepSeek-V3): every F8_E4M3
tensor W has a float32 W_scale_inv of one value per 128 x 128 block, and W = W_fp8 * scale_inv block by
block (inference/kernel.py weight_dequant; transformers' integrations/finegrained_fp8.py Fp8Dequantize is the
same float32 product but needs whole blocks, whereas DeepSeek's kernel takes partial ones, as here:
kv_a_proj_with_mqa's 576 rows are 4.5 blocks). The result is float32 (exact: an e4m3 code times a float32 scale rounded once),
cast to the run's dtype by the load as every other tensor; a _scale_inv is part of its weight, not a tensor
of its own.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from models.dtypes import bfloat16_bits_to_float32, float8_e4m3fn_to_float32
from models.errors import UsageError

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# safetensors dtypes -> numpy (BF16: its bits, widened to float32 exactly on reading)
NUMPY_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
               "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
               "F8_E4M3": np.uint8}  # numpy has no float8: its codes, decoded and scaled on reading
# DeepSeek-V3's FP8 blocks, the only size allowed (hf_config_keys.py quantization_config refuses others)
FP8_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# Buffers older transformers versions saved that are no weights (recomputed from config.json here).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def hf_weights_file(directory: str) -> str | None:
    """The safetensors a Hugging Face directory trains from: the sharded index, else model.safetensors."""
    for name in (INDEX_FILE, SINGLE_FILE):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


class SafetensorsFiles:
    """The tensors of model.safetensors or a sharded index: names, dtypes and shapes from the headers
    alone; `read(name)` reads one tensor (float32 for BF16) and nothing else."""

    def __init__(self, weights_file: str):
        self.directory = os.path.dirname(weights_file)
        if weights_file.endswith(".index.json"):
            try:
                with open(weights_file, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise UsageError(f"{weights_file} is not a safetensors index (a JSON object with weight_map): "
                                 f"{error}") from None
        else:
            files = [os.path.basename(weights_file)]
        self.entries: dict[str, tuple[str, int, dict]] = {}  # name -> (file, data start, header entry)
        for file in files:
            path = os.path.join(self.directory, file)
            header, start = _read_header(path)
            for name, entry in header.items():
                self.entries[name] = (path, start, entry)
        self.scales = {name + SCALE_SUFFIX: name for name, (_, _, e) in self.entries.items() if e["dtype"] == "F8_E4M3"}
        for scale, name in self.scales.items():  # checked from the headers, before anything is read
            shape = self.shape(name)
            blocks = [-(-n // b) for n, b in zip(shape, FP8_BLOCK)]
            if scale not in self.entries:
                raise UsageError(f"{weights_file}: FP8 tensor {name} has no {scale} (its per-block scales)")
            if len(shape) != 2 or self.entries[scale][2]["dtype"] != "F32" or list(self.shape(scale)) != blocks:
                raise UsageError(f"{weights_file}: {scale} is {self.entries[scale][2]['dtype']} "
                                 f"{list(self.shape(scale))}; the FP8 matrix {name} {list(shape)} needs F32 {blocks} "
                                 f"(one scale per {FP8_BLOCK[0]} x {FP8_BLOCK[1]} block)")

    def names(self) -> list[str]:
        """The tensors (an FP8 weight's _scale_inv is part of that weight, not one of them)."""
        return [name for name in self.entries if name not in self.scales]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][2]["shape"])

    def read(self, name: str) -> np.ndarray:
        path, start, entry = self.entries[name]
        begin, end = entry["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + begin)
            data = f.read(end - begin)
        array = np.frombuffer(data, dtype=NUMPY_TYPES[entry["dtype"]]).reshape(entry["shape"])
        if entry["dtype"] == "F8_E4M3":
            weight = float8_e4m3fn_to_float32(array)
            if np.isnan(weight).any():  # e4m3fn's only non-finite code: a quantizer never writes it
                raise UsageError(f"{path}: FP8 tensor {name} holds the NaN code (0x7f/0xff) at "
                                 f"{np.argwhere(np.isnan(weight))[0].tolist()}")
            return dequantize_fp8_blocks(weight, self.read(name + SCALE_SUFFIX))
        return bfloat16_bits_to_float32(array) if entry["dtype"] == "BF16" else array.copy()


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block=FP8_BLOCK) -> np.ndarray:
    """weight (the decoded e4m3 values, float32 [M, N]) times its block's scale, in place: block (i, j) of
    block[0] x block[1] values (the last ones partial) by scale_inv[i, j] (DeepSeek-V3 inference/kernel.py
    weight_dequant_kernel: y = x * s, s = s_ptr[pid_m * cdiv(N, BLOCK) + pid_n])."""
    rows, columns = block
    for i in range(scale_inv.shape[0]):  # a block row at a time: no scale array as large as the weight
        weight[i * rows:(i + 1) * rows] *= np.repeat(scale_inv[i], columns)[: weight.shape[1]]
    return weight


def _read_header(path: str) -> tuple[dict, int]:
    """(the tensors' entries, where the data begins) of one safetensors file, checked."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= min(size - 8, 100 << 20):
                raise ValueError(f"header length {length} in a file of {size} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as error:
        raise UsageError(f"{path} is not a safetensors file: {error}") from None
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in NUMPY_TYPES:
            raise UsageError(f"{path}: tensor {name} has dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r}; "
                             f"readable: {', '.join(NUMPY_TYPES)}")
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(entry["shape"]) * np.dtype(NUMPY_TYPES[entry["dtype"]]).itemsize \
                or 8 + length + end > size:
            raise UsageError(f"{path}: tensor {name} does not fit its header (shape {entry['shape']}, bytes "
                             f"{begin}-{end}, file {size} bytes): the file is damaged or truncated")
    return header, 8 + length


def plan_hf_tensors(config, raw: dict, files: SafetensorsFiles, source: str) -> list:
    """The import table's rules for this model, every tensor they need present and every tensor of the
    files used (else one UsageError naming the tensor). Rules in file order of their tensors."""
    from models.paddlenlp_interop import _expand, import_table

    names = files.names()
    rules = [r for r in _expand(import_table(raw, config, names), config.num_hidden_layers) if not r.export_only]
    missing = [r.theirs for r in rules if r.theirs not in files.entries]
    if missing:
        raise UsageError(f"{source}: no tensor {missing[0]!r} ({len(missing)} missing), which a "
                         f"{raw.get('model_type')} model with this config.json needs")
    needed = {r.theirs for r in rules}
    for copy, main in _published_copies(config).items():  # the same values twice: checked, not read
        if copy in files.entries and main in files.entries and files.shape(copy) != files.shape(main):
            raise UsageError(f"{source}: {copy} has shape {list(files.shape(copy))}; as a copy of {main} it "
                             f"needs {list(files.shape(main))}")
        needed.add(copy)
    unused = [n for n in names if n not in needed and not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        raise UsageError(f"{source}: tensor {unused[0]!r} ({len(unused)} such) has no place in a "
                         f"{raw.get('model_type')} model with this config.json (is config.json the weights' own?)")
    return rules


def _published_copies(config) -> dict:
    from models.families import get_family

    hugging_face = get_family(config.family).hugging_face
    return hugging_face.published_copies(config) if hugging_face else {}


def hf_config_for_weights(config, names):
    """DeepSeek-V3's MTP module only when the files hold its layer (model.layers.<num_hidden_layers>, as the
    published files do): transformers' DeepseekV3ForCausalLM has none, and the directories it writes hold none
    though 5.x writes num_nextn_predict_layers 1. The run says so (llm_pretrain/parallel/layout.py
    build_model_config's note)."""
    if not config.num_nextn_predict_layers:
        return config
    prefix = f"model.layers.{config.num_hidden_layers}."
    if any(name.startswith(prefix) for name in names):  # the weights' tensor names
        return config
    return config.replace(num_nextn_predict_layers=0)


def check_hf_weights(config, raw: dict, weights_file: str) -> None:
    """Before Paddle is imported (the run's preflight): the safetensors headers hold every tensor the model
    (of config.json `raw`) needs and none it has no place for (else one UsageError naming the tensor).
    Nothing but headers is read."""
    plan_hf_tensors(config, raw, SafetensorsFiles(weights_file), weights_file)


def stream_hf_weights(config, raw: dict, files: SafetensorsFiles, source: str, wanted=None):
    """(our name, full array) of every tensor of our model (in the config's fused layout), read one Hugging
    Face tensor at a time. wanted(name) -> bool: only those of ours (a pipeline stage's); the others' Hugging
    Face tensors are not read."""
    from models.paddlenlp_interop import _fused_parts, _split, canonical_shapes

    expected = canonical_shapes(config)
    fused_of = {part: (fused, parts) for fused, (parts, _) in _fused_parts(config).items() for part in parts}
    part_sizes = {name: shape[-1] for name, shape in expected.items()}
    for parts, sizes in _fused_parts(config).values():
        part_sizes.update(zip(parts, sizes))
    wanted = wanted or (lambda name: True)
    pending: dict[str, dict] = {}  # fused name -> its parts read so far

    def size(name: str) -> int:  # a bias our config lacks is as wide as its weight's output
        return part_sizes.get(name) or part_sizes[name[: -len("bias")] + "weight"]

    for rule in plan_hf_tensors(config, raw, files, source):
        ours = [fused_of[o][0] if o in fused_of else o for o in rule.ours]
        if not any(wanted(o) for o in ours) and all(o in expected for o in ours):
            continue
        theirs = files.read(rule.theirs)
        sizes = [size(o) for o in rule.ours] if rule.join.startswith("concat") else []
        try:
            pieces = _split(rule.join, theirs, sizes, config)
        except ValueError:
            raise UsageError(f"{source}: {rule.theirs} has shape {list(theirs.shape)}, which does not split into "
                             f"{', '.join(rule.ours)} of this config.json") from None
        del theirs
        for name, piece in zip(rule.ours, pieces):
            if name in fused_of:  # our fused layout (fuse_attention_qkv / ffn): emitted once every part is read
                fused, parts = fused_of[name]
                pending.setdefault(fused, {})[name] = piece
                if len(pending[fused]) == len(parts):
                    piece = np.concatenate([pending.pop(fused)[p] for p in parts], axis=-1)
                    name = fused
                else:
                    continue
            if name not in expected:  # a bias the file has and our config lacks: dropped only when zero
                if np.any(piece):
                    raise UsageError(f"{source}: {rule.theirs} gives {name}, which is not zero, but this "
                                     "config.json has no such parameter")
                continue
            if list(piece.shape) != expected[name]:
                raise UsageError(f"{source}: {rule.theirs} has shape {list(files.shape(rule.theirs))}, which gives "
                                 f"{name} the shape {list(piece.shape)}; config.json needs {expected[name]}")
            if wanted(name):
                yield name, piece
