"""Export a checkpoint as a Hugging Face model directory, reading it one tensor at a time.

    python scripts/export_hf.py output/checkpoint-1000 hf_model [--max-shard-size 5GB] [--dtype bfloat16]
    (console command `llm-export-hf`: llm_pretrain.checkpoint.hf_export:main)

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf_model")

CHECKPOINT is output_dir/checkpoint-N (any step; the layout-free format of
llm_pretrain/checkpoint/dist_checkpoint.py, written under any parallel layout). OUT_DIR gets what
transformers' save_pretrained writes:

    config.json                     the class's keys (architectures, model_type, torch_dtype,
                                    rope_scaling, tie_word_embeddings, ...)
    generation_config.json
    model.safetensors               or, above --max-shard-size (default 5 GB, transformers' default),
                                    model-0000N-of-0000M.safetensors + model.safetensors.index.json
    tokenizer files                 when the run's tokenizer is a sentencepiece model, a tokenizer.json
                                    or vocab.json + merges.txt (with a tokenizer_config.json)

Which class, parameter names and config.json each family gets is in its record
(models/families/<family>.py, `hugging_face`): LLaMA / Llama 3 / 3.1 -> LlamaForCausalLM,
Qwen2 -> Qwen2ForCausalLM, GPT-3 -> GPT2LMHeadModel, Bloom -> BloomForCausalLM, Baichuan ->
Baichuan's remote-code BaichuanForCausalLM (W_pack), Mixtral -> MixtralForCausalLM, Qwen2-MoE ->
Qwen2MoeForCausalLM (experts one tensor each, as the hub's files). Qwen v1 has no Hugging Face class
(its published models run remote code with tiktoken) and is refused. A new family exports once its
record has a `hugging_face` entry.

Memory: the file headers are computed from the checkpoint index alone; then each Hugging Face
tensor is read (the slices of its parts, memory-mapped), converted and written before the next
is read, so peak memory is a few times the largest tensor (benchmarks/checkpoint_io.md).

Bad input (one line `error: ...`, exit code 2, before anything is written): a checkpoint that
is incomplete or damaged (named file missing, of the wrong size or checksum), a family without
a Hugging Face class or a model its class cannot express, an OUT_DIR that exists and is not empty.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time

import numpy as np

from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained max_shard_size "5GB" (decimal units)
SAFETENSORS_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
INDEX_NAME, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


# ----------------------------------------------------------------------------- checks before any work
def check_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        what = "is not a directory" if not os.path.isdir(out_dir) else "is not empty"
        raise UsageError(f"output directory {out_dir} exists and {what}; give a new or empty directory")


def hugging_face_class(config):
    """The family's Hugging Face class, if it can express this model (else UsageError)."""
    from models.families import FAMILIES, get_family

    target = get_family(config.family).hugging_face
    if target is None:
        have = ", ".join(f"{n} ({f.hugging_face.class_name})" for n, f in FAMILIES.items() if f.hugging_face)
        raise UsageError(f"family {config.family!r} has no Hugging Face class to export to; families with one: {have}")
    for key, allowed in target.requires.items():
        value = getattr(config, key)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise UsageError(f"Hugging Face's {target.class_name} cannot express {key}={value!r} "
                             f"(it needs {allowed!r})")
    problem = target.check(config)
    if problem:
        raise UsageError(f"Hugging Face's {target.class_name} cannot express {problem}")
    return target


check_exportable = hugging_face_class


def open_checkpoint(path: str, verify_checksums: bool = True):
    """(ModelConfig, trainer_state) of a complete, undamaged layout-free checkpoint (else UsageError)."""
    from llm_pretrain.checkpoint import checkpointer as ckpt
    from llm_pretrain.checkpoint import dist_checkpoint
    from models.registry import config_from_dict

    if not os.path.isdir(path):
        raise UsageError(f"checkpoint {path} is not a directory (expected output_dir/checkpoint-N)")
    problem = ckpt.verify_checkpoint(path, None if verify_checksums else (lambda entry: False))
    if problem:
        raise UsageError(f"checkpoint cannot be exported: {problem}")
    index = os.path.join(path, dist_checkpoint.INDEX_FILE)
    if not os.path.isfile(index):
        raise UsageError(f"checkpoint {path} has no {dist_checkpoint.INDEX_FILE} (written before the layout-free "
                         "format); resume it for one step to rewrite it, or use scripts/export_paddlenlp.py")
    try:
        with open(index) as f:
            json.load(f)["tensors"]
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{index} is damaged (not a valid tensor index)")
    state = ckpt.read_trainer_state(path)
    if not isinstance(state.get("model_config"), dict):
        raise UsageError(f"{os.path.join(path, ckpt.TRAINER_STATE)} has no model_config")
    return config_from_dict(state["model_config"], source=os.path.join(path, ckpt.TRAINER_STATE)), state


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes (transformers' convert_file_size_to_int units)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*(|B|KB|MB|GB|KIB|MIB|GIB)\s*", str(text).upper())
    if not match or not float(match.group(1)) > 0:
        raise UsageError(f"--max-shard-size: {text!r} is not a size; use e.g. 5GB, 500MB or a number of bytes")
    unit = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(float(match.group(1)) * unit[match.group(2)])


# ----------------------------------------------------------------------------- dtypes
def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # stored as its uint16 bits: float32's upper half
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32, copy=False)


def float32_to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """Round to nearest even, as Paddle's and PyTorch's casts do (NaN stays NaN)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


def convert(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """A stored array (bfloat16 as uint16 bits) of dtype `source` as `target` (same storage convention)."""
    if source == target:
        return array
    wide = to_float32(array, source)
    return float32_to_bfloat16_bits(wide) if target == "bfloat16" else wide.astype(target)


def _storage(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


# ----------------------------------------------------------------------------- the plan: names, shapes, files
class _Source:
    """Our tensors, read one at a time from a checkpoint: canonical names, fused parts split on the fly."""

    def __init__(self, reader, config):
        from models.paddlenlp_interop import _fused_parts

        self.reader, self.config = reader, config
        self.part_of = {}  # unfused part -> (fused tensor, its index, part sizes)
        for fused, (parts, sizes) in _fused_parts(config).items():
            if fused in reader.tensors:
                for i, part in enumerate(parts):
                    self.part_of[part] = (fused, i, sizes)
        self._cached = (None, None)

    def names(self) -> set[str]:
        return set(self.reader.parameter_names())

    def entry(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of one of our unfused tensors, from the index alone."""
        if name in self.part_of:
            fused, i, sizes = self.part_of[name]
            entry = self.reader.entry(fused)
            return tuple(entry["shape"][:-1]) + (sizes[i],), entry["dtype"]
        entry = self.reader.entry(name)
        return tuple(entry["shape"]), entry["dtype"]

    def read(self, name: str) -> np.ndarray:
        if name in self.part_of:
            fused, i, sizes = self.part_of[name]
            if self._cached[0] != fused:  # q, k, v (gate, up) are read in a row: one read of the fused tensor
                self._cached = (fused, self.reader.read_full(fused))
            return np.split(self._cached[1], np.cumsum(sizes)[:-1], axis=-1)[i]
        array = self.reader.read_full(name)
        if name == "lm_head.weight" and self.config.norm_head:
            # Baichuan2's NormHead, folded in: each vocab column of our [hidden, vocab] head has unit norm
            # (its code normalizes again at run time, which changes nothing), as export_to_paddlenlp does.
            # Computed in float64, then rounded: normalizing an already normalized head then gives the same
            # bits, so export -> import -> export writes the same file (tests/test_hf_directory.py).
            dtype = self.reader.entry(name)["dtype"]
            head = to_float32(array, dtype).astype(np.float64)
            head = head / np.maximum(np.linalg.norm(head, axis=0, keepdims=True), 1e-12)
            array = convert(head.astype(np.float32), "float32", dtype)
        return array


def _their_shape(join: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of `join` of our parts (models/paddlenlp_interop._join) without computing it."""
    transpose = join == "transpose" or join.endswith("_transpose")
    base = join[: -len("_transpose")] if join.endswith("_transpose") else join
    if base in ("same", "transpose"):
        shape = shapes[0]
    elif base == "row":  # [E] written as [1, E] (ERNIE 4.5 MoE's correction bias)
        shape = (1,) + shapes[0]
    else:  # concat, per_head, kv_groups: the parts side by side along the last (output) axis
        shape = shapes[0][:-1] + (sum(s[-1] for s in shapes),)
    return tuple(reversed(shape)) if transpose else shape


def plan_tensors(source: _Source, config, target, dtype: str | None) -> list[dict]:
    """Every Hugging Face tensor: name, the rule making it, shape, dtype, bytes. Checks that every
    tensor of the checkpoint goes somewhere (a table that forgot one would drop weights silently)."""
    from models.paddlenlp_interop import _expand

    planned, used = [], set()
    for rule in _expand(target.table(config), config.num_hidden_layers):
        if rule.export_only:
            continue
        missing = [name for name in rule.ours if name not in source.part_of and name not in source.reader.tensors]
        if missing:
            raise UsageError(f"checkpoint {source.reader.directory} has no tensor {missing[0]} "
                             f"({target.class_name}'s {rule.theirs} needs it)")
        entries = [source.entry(name) for name in rule.ours]
        stored = entries[0][1]
        out_dtype = dtype or stored
        if out_dtype not in SAFETENSORS_CODES or stored not in SAFETENSORS_CODES:
            raise UsageError(f"checkpoint tensor {rule.ours[0]} has dtype {stored}; export writes "
                             f"{', '.join(SAFETENSORS_CODES)}")
        shape = _their_shape(rule.join, [shape for shape, _ in entries])
        planned.append({"name": rule.theirs, "rule": rule, "shape": shape, "stored": stored, "dtype": out_dtype,
                        "bytes": math.prod(shape) * np.dtype(_storage(out_dtype)).itemsize})
        used.update(source.part_of[n][0] if n in source.part_of else n for n in rule.ours)
    left_out = sorted(source.names() - used)
    if left_out:
        raise UsageError(f"{target.class_name} has no place for {left_out[0]} ({len(left_out)} tensors of the "
                         "checkpoint); this model cannot be exported to it")
    return planned


def shard(planned: list[dict], max_shard_bytes: int) -> list[list[dict]]:
    """transformers' rule (modeling_utils shard_checkpoint): a new file when the next tensor would pass the
    limit; a tensor larger than the limit gets a file of its own."""
    shards, size = [[]], 0
    for tensor in planned:
        if shards[-1] and size + tensor["bytes"] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor["bytes"]
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ----------------------------------------------------------------------------- writing
def write_safetensors_file(path: str, tensors: list[dict], produce) -> None:
    """One safetensors file, its header first (from the plan), then each tensor as `produce` makes it."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": transformers reads it as PyTorch's
    for t in tensors:
        header[t["name"]] = {"dtype": SAFETENSORS_CODES[t["dtype"]], "shape": list(t["shape"]),
                             "data_offsets": [offset, offset + t["bytes"]]}
        offset += t["bytes"]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors:
            array = np.ascontiguousarray(produce(t))
            if array.shape != tuple(t["shape"]) or array.nbytes != t["bytes"]:
                raise RuntimeError(f"{t['name']}: made {array.shape}, planned {t['shape']}")  # a bug, not input
            f.write(array.data)
            del array


def _make_tensor(source: _Source, config, tensor: dict) -> np.ndarray:
    from models.paddlenlp_interop import _join

    rule = tensor["rule"]
    parts = [source.read(name) for name in rule.ours]
    return convert(_join(rule.join, parts, config), tensor["stored"], tensor["dtype"])


# ----------------------------------------------------------------------------- tokenizer and configs
TOKENIZER_CLASSES = {"sentencepiece": "LlamaTokenizer", "tokenizer.json": "PreTrainedTokenizerFast",
                     "bpe": "GPT2Tokenizer"}
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def run_tokenizer(trainer_state: dict) -> str | None:
    """The run's tokenizer (tokenizer_name_or_path, else model_name_or_path) when it is a local tokenizer
    here: a built-in architecture name, or a directory without tokenizer files, has none to copy."""
    from llm_pretrain.data.tokenizer import _find_files

    args = trainer_state.get("args") or {}
    path = args.get("tokenizer_name_or_path") or args.get("model_name_or_path")
    if not path or not os.path.exists(path):
        return None
    try:
        _find_files(path, "tokenizer")
    except UsageError:
        return None
    return path


def copy_tokenizer(path: str, out_dir: str) -> dict:
    """The tokenizer files (and a tokenizer_config.json naming the class when none is there); returns
    {"files", "eos_token_id", "kind"}."""
    from llm_pretrain.data.tokenizer import _find_files, load_tokenizer

    kind, files = _find_files(path, "tokenizer")
    directory = os.path.dirname(files[0])
    copied = []
    for file in files:
        name = "tokenizer.model" if kind == "sentencepiece" else os.path.basename(file)
        shutil.copy2(file, os.path.join(out_dir, name))
        copied.append(name)
    for name in TOKENIZER_EXTRAS:
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copy2(os.path.join(directory, name), os.path.join(out_dir, name))
            copied.append(name)
    eos = load_tokenizer(path, "tokenizer").eos_token_id
    if "tokenizer_config.json" not in copied:
        config = {"tokenizer_class": TOKENIZER_CLASSES[kind]}
        if kind == "sentencepiece":
            config.update(add_bos_token=False, add_eos_token=False)  # as our data: no BOS, EOS appended by prepare
        _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        copied.append("tokenizer_config.json")
    return {"files": copied, "eos_token_id": eos, "kind": kind}


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- the export
def export_hf(checkpoint: str, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              dtype: str | None = None, verify_checksums: bool = True, replace: bool = False) -> dict:
    """Write the Hugging Face directory of `checkpoint` into out_dir (see the module docstring).

    dtype: None keeps the checkpoint's dtype; "float32", "bfloat16" or "float16" converts.
    replace: out_dir may exist and is replaced (the trainer's own final export); otherwise it must
    be new or empty. Returns {"out_dir", "class", "files", "tensors", "parameters", "bytes", "seconds"}.
    """
    from llm_pretrain.checkpoint.dist_checkpoint import CheckpointReader

    started = time.perf_counter()
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise UsageError(f"--dtype: {dtype!r} is not allowed; allowed: {', '.join(OUTPUT_DTYPES)}")
    if not replace:
        check_out_dir(out_dir)
    config, trainer_state = open_checkpoint(checkpoint, verify_checksums)
    target = hugging_face_class(config)
    tokenizer = run_tokenizer(trainer_state)
    with CheckpointReader(checkpoint) as reader:
        source = _Source(reader, config)
        planned = plan_tensors(source, config, target, dtype)
        shards = shard(planned, max_shard_bytes)
        names = shard_names(len(shards))
        if replace and os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        for name, tensors in zip(names, shards):
            write_safetensors_file(os.path.join(out_dir, name), tensors,
                                   lambda t: _make_tensor(source, config, t))
    if len(shards) > 1:
        _write_json(os.path.join(out_dir, INDEX_NAME), {
            "metadata": {"total_size": sum(t["bytes"] for t in planned)},
            "weight_map": {t["name"]: name for name, tensors in zip(names, shards) for t in tensors}})

    copied = copy_tokenizer(tokenizer, out_dir) if tokenizer else {"files": [], "eos_token_id": None}
    tokens = {"eos_token_id": copied["eos_token_id"]} if copied["eos_token_id"] is not None else {}
    torch_dtype = dtype or max((t["dtype"] for t in planned), key=lambda d: sum(
        t["bytes"] for t in planned if t["dtype"] == d))  # the dtype of most weights
    _write_json(os.path.join(out_dir, "config.json"), {**target.config_json(config), **tokens,
                                                        "torch_dtype": torch_dtype})
    _write_json(os.path.join(out_dir, "generation_config.json"), {"_from_model_config": True, **tokens})
    files = names + ([INDEX_NAME] if len(shards) > 1 else []) + ["config.json", "generation_config.json"]
    return {"out_dir": out_dir, "class": target.class_name, "remote_code": target.remote_code,
            "files": files + copied["files"], "tensors": len(planned),
            "parameters": int(sum(math.prod(t["shape"]) for t in planned)),
            "bytes": int(sum(t["bytes"] for t in planned)), "seconds": time.perf_counter() - started,
            "tokenizer": tokenizer}


def export_final_checkpoint(output_dir: str, step: int) -> str:
    """last_save_in_hf: the final checkpoint-<step> as output_dir/checkpoint-<step>-hf (the trainer, rank 0)."""
    result = export_hf(os.path.join(output_dir, f"checkpoint-{step}"),
                       os.path.join(output_dir, f"checkpoint-{step}-hf"), replace=True, verify_checksums=False)
    return f"checkpoint-{step} exported for Hugging Face: {result['out_dir']} ({result['class']})"


def main(argv=None) -> int:
    parser = UsageArgumentParser(prog="export_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="output_dir/checkpoint-N")
    parser.add_argument("out_dir", help="a new (or empty) directory for the Hugging Face model")
    parser.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this (default 5GB)")
    parser.add_argument("--dtype", default=None, help="write float32, bfloat16 or float16 (default: as saved)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = export_hf(args.checkpoint, args.out_dir, parse_size(args.max_shard_size), args.dtype)
    except UsageError as error:
        exit_with_usage_error(error)
    remote = " (the model repository's own code: trust_remote_code)" if result["remote_code"] else ""
    print(f"{result['out_dir']}: {result['class']}{remote}, {result['parameters']:,} parameters in "
          f"{result['tensors']} tensors, {len([f for f in result['files'] if f.endswith('.safetensors')])} "
          f"safetensors file(s), {result['seconds']:.1f} s; tokenizer: "
          f"{result['tokenizer'] or 'none copied (the run named no local tokenizer found from here)'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
