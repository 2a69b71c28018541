"""Weight interchange with PaddleNLP 2.8 (and Hugging Face) model directories.

    export_to_paddlenlp(source, out_dir, config=None)   ours -> PaddleNLP (config.json + model_state.pdparams)
    import_from_paddlenlp(paddlenlp_dir, out_dir)       PaddleNLP / HF -> ours (a directory the trainer trains from)

This module reads and writes directories: our checkpoints (output_dir/checkpoint-N, merged across
their shards by llm_pretrain/checkpoint/checkpointer.py), our model directories, PaddleNLP/HF directories
(.pdparams, sharded or safetensors weights) and the tokenizer files beside them. The mapping of
names, layouts and config.json is models/paddlenlp_interop.py's (see its docstring for what each
family exports as and what is folded into the weights).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from llm_pretrain.errors import UsageError
from models.config import ModelConfig
from models.dtypes import bfloat16_bits_to_float32
from models.paddlenlp_interop import export_table, from_paddlenlp_state, paddlenlp_config, to_paddlenlp_state

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "sentencepiece.bpe.model",
                   "qwen.tiktoken")


def export_to_paddlenlp(source, out_dir: str, config: ModelConfig | None = None, overwrite: bool = False) -> dict:
    """Write a directory PaddleNLP's AutoModelForCausalLM.from_pretrained loads.

    source: a checkpoint directory (output_dir/checkpoint-N, merged across its shards), a
    model directory of ours (config.json with "family" + model_state.pdparams, as written
    by import_from_paddlenlp), or a dict of full weights in canonical names (config given).
    Returns {"out_dir", "config" (the PaddleNLP config.json), "tensors", "parameters"}.
    """
    tokenizer_dir = None
    _check_out_dir(out_dir, overwrite)
    if isinstance(source, (str, os.PathLike)):
        if config is not None:
            raise UsageError("export_to_paddlenlp: config is taken from the directory; pass it only with weights")
        config, state, tokenizer_dir = _read_our_weights(os.fspath(source))
    elif config is None:
        raise UsageError("export_to_paddlenlp: full weights need their ModelConfig")
    else:
        state = source
    theirs = to_paddlenlp_state(config, state)
    paddle_config = paddlenlp_config(config)
    _save(out_dir, paddle_config, theirs)
    if tokenizer_dir:
        _copy_tokenizer(tokenizer_dir, out_dir)
    copies = {r.theirs for r in export_table(config) if r.export_only}  # tied copies (GPT's lm_head)
    parameters = sum(v.size for k, v in theirs.items() if k not in copies)
    return {"out_dir": out_dir, "config": paddle_config, "tensors": len(theirs), "parameters": int(parameters)}


def import_from_paddlenlp(paddlenlp_dir: str, out_dir: str, overwrite: bool = False) -> dict:
    """Convert a PaddleNLP (or Hugging Face Baichuan) model directory into one this toolkit trains from.

    out_dir gets config.json (ours, with "family") and model_state.pdparams in canonical names,
    plus the tokenizer files found next to the weights; use it as model_name_or_path with
    continue_training true. Returns {"out_dir", "config" (ours), "tensors", "parameters"}.
    """
    from models.hf_directory import hf_config_for_weights
    from models.registry import config_from_dict, read_config_json

    config_file = os.path.join(paddlenlp_dir, "config.json")
    if not os.path.isdir(paddlenlp_dir):
        raise UsageError(f"{paddlenlp_dir} is not a directory")
    if not os.path.isfile(config_file):
        raise UsageError(f"{paddlenlp_dir} has no config.json")
    raw = read_config_json(config_file)
    if "family" in raw:
        raise UsageError(f"{paddlenlp_dir} is already in this toolkit's format (its config.json has 'family')")
    config = config_from_dict(raw, source=config_file)
    _check_out_dir(out_dir, overwrite)
    weights, source = _load_foreign_weights(paddlenlp_dir)
    config = hf_config_for_weights(config, weights)  # DeepSeek-V3 without its MTP layer: transformers' files
    ours = from_paddlenlp_state(config, raw, weights, source)
    our_config = config.architecture_dict()
    _save(out_dir, our_config, ours)
    _copy_tokenizer(paddlenlp_dir, out_dir)
    return {"out_dir": out_dir, "config": our_config, "tensors": len(ours),
            "parameters": int(sum(v.size for v in ours.values()))}


def _read_our_weights(path: str) -> tuple[ModelConfig, dict, str | None]:
    """(config, full weights, a local tokenizer directory or None) of a checkpoint or model directory."""
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory (expected output_dir/checkpoint-N or a model directory)")
    from llm_pretrain.checkpoint import checkpointer as ckpt  # imports paddle: after the cheap checks
    from models.registry import config_from_dict, find_weights_file, read_config_json

    if os.path.isfile(os.path.join(path, ckpt.TRAINER_STATE)):
        trainer_state = ckpt.read_trainer_state(path)
        if "model_config" not in trainer_state:
            raise UsageError(f"{path}/{ckpt.TRAINER_STATE} has no model_config")
        if not ckpt.has_weights(path):
            raise UsageError(f"{path} has no weights ({ckpt.dist_checkpoint.INDEX_FILE} or model_state.*.pdparams)")
        config = config_from_dict(trainer_state["model_config"], source=f"{path}/{ckpt.TRAINER_STATE}")
        args = trainer_state.get("args") or {}
        tokenizer = args.get("tokenizer_name_or_path") or args.get("model_name_or_path")
        tokenizer_dir = tokenizer if tokenizer and os.path.isdir(tokenizer) else None
        return config, ckpt.merge_checkpoint(path), tokenizer_dir
    config_file = os.path.join(path, "config.json")
    weights_file = find_weights_file(path)
    if os.path.isfile(config_file) and weights_file:
        raw = read_config_json(config_file)
        if "family" not in raw:
            raise UsageError(f"{path} looks like a PaddleNLP directory already (its config.json has no 'family')")
        from models.weights import read_paddle_pickle

        return config_from_dict(raw, source=config_file), read_paddle_pickle(weights_file), path
    raise UsageError(f"{path} is neither a checkpoint (no {ckpt.TRAINER_STATE}) nor a model directory "
                     "(config.json + model_state.pdparams)")


def _load_foreign_weights(directory: str) -> tuple[dict, str]:
    """Full weights of a PaddleNLP/HF directory: model_state.pdparams, sharded .pdparams or safetensors
    (pickles read by models/weights.py read_paddle_pickle: no code runs)."""
    from models.weights import read_paddle_pickle

    def path(name):
        return os.path.join(directory, name)

    if any(f.startswith("model_state.tp") for f in os.listdir(directory)):
        raise UsageError(f"{directory} holds tensor-parallel shards (model_state.tpXX.pdparams); merge them with "
                         "PaddleNLP first (save_pretrained with merge_tensor_parallel, or a unified checkpoint)")
    if os.path.isfile(path("model_state.pdparams")):
        return read_paddle_pickle(path("model_state.pdparams")), path("model_state.pdparams")
    for index, loader in (("model_state.pdparams.index.json", read_paddle_pickle),
                          ("model.safetensors.index.json", _load_safetensors)):
        if os.path.isfile(path(index)):
            with open(path(index), encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(loader(path(shard)))
            return state, path(index)
    if os.path.isfile(path("model.safetensors")):
        return _load_safetensors(path("model.safetensors")), path("model.safetensors")
    if os.path.isfile(path("pytorch_model.bin")) or os.path.isfile(path("pytorch_model.bin.index.json")):
        raise UsageError(f"{directory} has PyTorch weights (pytorch_model.bin); PyTorch is not installed here -- "
                         "convert them to safetensors or use PaddleNLP's converted model")
    raise UsageError(f"{directory} has no weights (model_state.pdparams, model.safetensors or a sharded index)")


def _load_safetensors(file: str) -> dict:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise UsageError(f"{file}: reading safetensors needs the safetensors package")
    try:
        return load_file(file)
    except Exception as e:  # e.g. bfloat16, which numpy cannot hold: widened to float32 (exactly)
        try:
            return _load_safetensors_widening_bfloat16(file)
        except Exception:
            raise UsageError(f"{file} could not be read with numpy: {e}")


def _load_safetensors_widening_bfloat16(file: str) -> dict:
    """A safetensors file whose BF16 tensors become float32 (numpy has no bfloat16), read one tensor at a time."""
    numpy_types = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16, "I64": np.int64,
                   "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        state = {}
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            f.seek(8 + length + begin)
            array = np.frombuffer(f.read(end - begin), dtype=numpy_types[entry["dtype"]]).reshape(entry["shape"])
            state[name] = bfloat16_bits_to_float32(array) if entry["dtype"] == "BF16" else array.copy()
    return state


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    # Checked before any weights are read; created only when everything converted.
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir} exists and is not a directory")
    existing = [n for n in ("config.json", "model_state.pdparams") if os.path.exists(os.path.join(out_dir, n))]
    if existing and not overwrite:
        raise UsageError(f"{out_dir} already holds a model ({', '.join(existing)}); choose another directory "
                         "or pass --overwrite")


def _save(out_dir: str, config_json: dict, state: dict) -> None:
    import paddle

    os.makedirs(out_dir, exist_ok=True)

    # Tensors, not numpy arrays: what PaddleNLP's save_pretrained writes and from_pretrained expects.
    paddle.save({name: paddle.to_tensor(np.ascontiguousarray(value)) for name, value in state.items()},
                os.path.join(out_dir, "model_state.pdparams"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_json, f, indent=2)
        f.write("\n")


def _copy_tokenizer(src_dir: str, out_dir: str) -> None:
    if os.path.abspath(src_dir) == os.path.abspath(out_dir):
        return
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(out_dir, name))
