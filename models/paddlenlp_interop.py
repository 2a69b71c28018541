"""Weight and config interchange with PaddleNLP 2.8 (and Hugging Face Baichuan) model directories.

    export_to_paddlenlp(source, out_dir, config=None)   ours -> PaddleNLP (config.json + model_state.pdparams)
    import_from_paddlenlp(paddlenlp_dir, out_dir)       PaddleNLP / HF Baichuan -> ours (trainable directory)
    to_paddlenlp_state(config, state) / from_paddlenlp_state(config, raw_config, state)   the mappings alone

Which PaddleNLP class runs each family, its parameter-name tables and its config.json are in
the family's record (models/families/<family>.py, `paddlenlp`):

    llama, baichuan   LlamaForCausalLM   (Baichuan-13B / Baichuan2-13B: config "alibi": true)
    qwen              QWenForCausalLM
    qwen2             Qwen2ForCausalLM   (PaddleNLP 3 names; Hugging Face's read too)
    gpt3              GPTForCausalLM
    bloom             BloomForCausalLM

Ours are the canonical names of models/decoder.py with unfused projections
(q_proj/k_proj/v_proj, gate_proj/up_proj); a model or checkpoint with fused
qkv_proj / gate_up_proj (ours: parts concatenated in order) is unfused first
and fused back on import. Paddle's Linear stores [in, out] in both code bases,
so no weight is transposed -- except Hugging Face Baichuan's (PyTorch [out, in]).
The fused projections of the other side are laid out differently per class:

    Qwen c_attn                 [q | k | v]                      (plain concatenation)
    Bloom query_key_value,
    GPT qkv_proj (fused)        per head [heads, 3, head_dim]    (q, k, v of head 0, then head 1, ...)
    LLaMA qkv_proj (fused)      per kv head [kv_heads, groups + 2, head_dim]  (the group's q heads, k, v)
    LLaMA gate_up_fused_proj    [gate | up]
    HF Baichuan W_pack          [q | k | v] along PyTorch's output axis (rows)

Things PaddleNLP 2.8 has no switch for are folded into the weights on export:
Baichuan2's NormHead (the head is written already normalized; normalizing it again on
import changes nothing, so config.json keeps "norm_head": true for the way back), and a
tied head for LLaMA/Qwen classes (written as an explicit lm_head). GPT's config gets
"ignore_index": -100 (PaddleNLP's GPT default 0 would drop token id 0 from its loss;
ours, like LLaMA's, ignores -100). Qwen's dynamic-NTK and log-n attention only act
beyond config "seq_length" at inference; export sets seq_length to the model's
max_position_embeddings so that within it PaddleNLP computes what we train.
Hugging Face's Llama/Qwen2 weights (model.safetensors, "model." names, PyTorch's [out, in]
matrices) and GPT-2 weights (Conv1D: [in, out]) are imported too.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

from llm_pretrain.errors import UsageError
from models.config import ModelConfig

# ----------------------------------------------------------------------------- mapping tables
JOINS = ("same", "transpose", "concat", "concat_transpose", "per_head", "kv_groups")
# Any join + "_transpose" is that join followed by a transpose: PyTorch's [out, in] matrices (Hugging Face).


@dataclass(frozen=True)
class Rule:
    """One PaddleNLP tensor made of one or more of ours. "{i}" stands for the layer index.

    join: how our tensors become theirs (see JOINS and _join). export_only: a tied copy that
    PaddleNLP saves (GPT's lm_head.weight) but that carries no information of its own.
    """

    theirs: str
    ours: tuple[str, ...]
    join: str = "same"
    export_only: bool = False


def R(theirs: str, ours, join: str = "same", export_only: bool = False) -> Rule:
    return Rule(theirs, (ours,) if isinstance(ours, str) else tuple(ours), join, export_only)


def _attn(name: str) -> str:
    return "layers.{i}.self_attn." + name


def _mlp(name: str) -> str:
    return "layers.{i}.mlp." + name


QKV_WEIGHTS = tuple(_attn(p + ".weight") for p in ("q_proj", "k_proj", "v_proj"))
QKV_BIASES = tuple(_attn(p + ".bias") for p in ("q_proj", "k_proj", "v_proj"))
INPUT_NORM, POST_ATTENTION_NORM = "layers.{i}.input_layernorm", "layers.{i}.post_attention_layernorm"


def weight_and_bias(theirs: str, ours: str) -> list[Rule]:
    return [R(f"{theirs}.weight", f"{ours}.weight"), R(f"{theirs}.bias", f"{ours}.bias")]


def _record(config: ModelConfig):
    from models.families import get_family

    return get_family(config.family)


def export_table(config: ModelConfig) -> list[Rule]:
    return _record(config).paddlenlp.export_table(config)


def import_table(raw: dict, config: ModelConfig, names=()) -> list[Rule]:
    """The table for a PaddleNLP/HF config.json: its model_type's family reads it (names: the weights')."""
    from models.families import family_for_model_type, supported_model_types

    model_type = str(raw.get("model_type", "llama")).lower()
    record = family_for_model_type(model_type)
    if record is None:
        raise UsageError(f"model_type {model_type!r} has no weight mapping; supported: "
                         f"{', '.join(supported_model_types())}")
    return record.paddlenlp.import_table(raw, config, names)


def _expand(table: list[Rule], num_layers: int) -> list[Rule]:
    rules = []
    for rule in table:
        layers = range(num_layers) if "{i}" in rule.theirs else [None]
        for i in layers:
            rules.append(Rule(rule.theirs.format(i=i), tuple(o.format(i=i) for o in rule.ours), rule.join,
                              rule.export_only))
    return rules


# ----------------------------------------------------------------------------- joins
def _heads(config: ModelConfig) -> tuple[int, int, int]:
    return config.num_attention_heads, config.num_key_value_heads, config.head_dim


def _join(join: str, parts: list[np.ndarray], config: ModelConfig) -> np.ndarray:
    """Our tensors -> theirs. Fused parts are along the last (output) axis of [in, out] / [out] tensors."""
    heads, kv_heads, d = _heads(config)
    if join.endswith("_transpose"):
        return _join(join[: -len("_transpose")], parts, config).T
    if join == "same":
        return parts[0]
    if join == "transpose":
        return parts[0].T
    if join == "concat":
        return np.concatenate(parts, axis=-1)
    prefix = parts[0].shape[:-1]
    if join == "per_head":  # [..., h*d] x 3 -> [..., h, 3, d]
        q, k, v = (p.reshape(prefix + (heads, d)) for p in parts)
        return np.stack([q, k, v], axis=-2).reshape(prefix + (3 * heads * d,))
    if join == "kv_groups":  # [..., kv, (groups + 2) * d]: each kv head's q heads, then its k and v
        groups = heads // kv_heads
        q = parts[0].reshape(prefix + (kv_heads, groups * d))
        k, v = (p.reshape(prefix + (kv_heads, d)) for p in parts[1:])
        return np.concatenate([q, k, v], axis=-1).reshape(prefix + (kv_heads * (groups + 2) * d,))
    raise ValueError(f"unknown join {join!r}")


def _split(join: str, x: np.ndarray, sizes: list[int], config: ModelConfig) -> list[np.ndarray]:
    """Theirs -> our tensors; `sizes` are the last-axis sizes of our parts (the inverse of _join)."""
    heads, kv_heads, d = _heads(config)
    if join.endswith("_transpose"):
        return _split(join[: -len("_transpose")], x.T, sizes, config)
    if join == "same":
        return [x]
    if join == "transpose":
        return [x.T]
    if join == "concat":
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)
    prefix = x.shape[:-1]
    if join == "per_head":
        x = x.reshape(prefix + (heads, 3, d))
        return [x[..., j, :].reshape(prefix + (heads * d,)) for j in range(3)]
    if join == "kv_groups":
        groups = heads // kv_heads
        x = x.reshape(prefix + (kv_heads, groups + 2, d))
        q = x[..., :groups, :].reshape(prefix + (heads * d,))
        return [q] + [x[..., groups + j, :].reshape(prefix + (kv_heads * d,)) for j in range(2)]
    raise ValueError(f"unknown join {join!r}")


# ----------------------------------------------------------------------------- our fused layouts
def canonical_shapes(config: ModelConfig) -> dict[str, list[int]]:
    """Every parameter name of our single-process model with its shape, without allocating it."""
    import paddle

    from models.decoder import CausalLM

    with paddle.LazyGuard():
        model = CausalLM(config.replace(tensor_parallel_degree=1, sequence_parallel=False))
    return {name: list(param.shape) for name, param in model.named_parameters()}


def _fused_parts(config: ModelConfig) -> dict[str, tuple[list[str], list[int]]]:
    """Our fused name -> (its unfused parts, their sizes), for the fused projections the config has."""
    q, kv, inner = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    fused = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        if config.fuse_attention_qkv:
            for leaf in ("weight", "bias"):
                fused[f"{attn}qkv_proj.{leaf}"] = ([f"{attn}{p}_proj.{leaf}" for p in "qkv"], [q, kv, kv])
        if config.fuse_attention_ffn and config.uses_swiglu:
            for leaf in ("weight", "bias"):
                parts = [f"{mlp}gate_proj.{leaf}", f"{mlp}up_proj.{leaf}"]
                fused[f"{mlp}gate_up_proj.{leaf}"] = (parts, [inner, inner])
    return fused


def unfuse(config: ModelConfig, state: dict) -> dict:
    """Our weights with fused qkv_proj / gate_up_proj split into their parts (others unchanged)."""
    fused = _fused_parts(config)
    out = {}
    for name, value in state.items():
        if name in fused:
            parts, sizes = fused[name]
            out.update(zip(parts, np.split(value, np.cumsum(sizes)[:-1], axis=-1)))
        else:
            out[name] = value
    return out


def fuse(config: ModelConfig, state: dict) -> dict:
    """Unfused weights in the config's layout (the inverse of `unfuse`)."""
    out = dict(state)
    for name, (parts, _) in _fused_parts(config).items():
        if all(p in out for p in parts):
            out[name] = np.concatenate([out.pop(p) for p in parts], axis=-1)
    return out


# ----------------------------------------------------------------------------- state conversion
def to_paddlenlp_state(config: ModelConfig, state: dict) -> dict[str, np.ndarray]:
    """Our full weights (canonical names, any fused layout) -> PaddleNLP names and layouts."""
    check_exportable(config)
    ours = unfuse(config, {k: _to_numpy(v) for k, v in state.items()})
    check_state(config, fuse(config, dict(ours)), "the weights to export")
    if "lm_head.weight" not in ours and _record(config).paddlenlp.explicit_head:
        ours["lm_head.weight"] = ours["embeddings.word_embeddings.weight"].T  # tied: an explicit head
    elif config.norm_head:
        head = ours["lm_head.weight"]  # [hidden, vocab]: each vocab column has unit norm (as F.normalize(axis=0))
        ours["lm_head.weight"] = head / np.maximum(np.linalg.norm(head, axis=0, keepdims=True), 1e-12)
    theirs = {}
    for rule in _expand(export_table(config), config.num_hidden_layers):
        theirs[rule.theirs] = _join(rule.join, [_ours_or_zero_bias(ours, name) for name in rule.ours], config)
    return theirs


def _ours_or_zero_bias(ours: dict, name: str) -> np.ndarray:
    # PaddleNLP always has some biases our config may leave out (Qwen's c_attn bias): zeros are exact.
    if name not in ours and name.endswith(".bias"):
        weight = ours[name[: -len("bias")] + "weight"]
        return np.zeros(weight.shape[-1], dtype=weight.dtype)
    return ours[name]


def from_paddlenlp_state(config: ModelConfig, raw: dict, state: dict, source: str = "weights") -> dict[str, np.ndarray]:
    """PaddleNLP/HF weights (of the class `raw` config.json describes) -> ours, in the config's layout."""
    theirs = {k: _to_numpy(v) for k, v in state.items()}
    expected = canonical_shapes(config)
    part_sizes = {name: shape[-1] for name, shape in expected.items()}
    for parts, sizes in _fused_parts(config).values():
        part_sizes.update(zip(parts, sizes))

    def size(name: str) -> int:  # a bias our config lacks is as wide as its weight's output
        return part_sizes.get(name) or part_sizes[name[: -len("bias")] + "weight"]

    ours = {}
    for rule in _expand(import_table(raw, config, theirs), config.num_hidden_layers):
        if rule.export_only:
            continue
        if rule.theirs not in theirs:
            raise UsageError(f"{source}: no tensor {rule.theirs!r}, which a {raw.get('model_type', 'llama')} model "
                             f"with this config.json needs")
        sizes = [size(o) for o in rule.ours] if rule.join.startswith("concat") else []
        ours.update(zip(rule.ours, _split(rule.join, theirs[rule.theirs], sizes, config)))
    ours = fuse(config, ours)
    for name in [n for n in ours if n not in expected]:
        if np.any(ours[name]):  # a bias PaddleNLP has and our config lacks must be zero to be dropped
            raise UsageError(f"{source}: {name} is not zero, but the model config has no such parameter")
        del ours[name]
    check_state(config, ours, source)
    return ours


def check_state(config: ModelConfig, state: dict, source: str) -> None:
    """Names and shapes of full weights against the model the config builds."""
    expected = canonical_shapes(config)
    missing = [n for n in expected if n not in state]
    if missing:
        raise UsageError(f"{source}: no parameter {missing[0]!r} ({len(missing)} missing) for this model config")
    for name, shape in expected.items():
        if list(state[name].shape) != shape:
            raise UsageError(f"{source}: {name} has shape {list(state[name].shape)}, the model config needs {shape}")


def check_exportable(config: ModelConfig) -> None:
    target = _record(config).paddlenlp
    for key, allowed in target.requires.items():
        value = getattr(config, key)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise UsageError(f"PaddleNLP's {target.class_name} cannot express {key}={value!r} (it needs {allowed!r})")
    problem = target.check(config)
    if problem:
        raise UsageError(f"PaddleNLP's {target.class_name} cannot express {problem}")


def _to_numpy(value) -> np.ndarray:
    """A weight as a numpy array, half precision widened to float32 (exactly)."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.uint16:
            # A bfloat16 weight read into numpy (paddle.load(return_numpy=True), as checkpoints are merged):
            # its bit patterns as uint16. Widen to float32 before any arithmetic (the NormHead below).
            return bfloat16_bits_to_float32(value)
        return value
    import paddle

    if isinstance(value, paddle.Tensor):
        if value.dtype in (paddle.float16, paddle.bfloat16):
            value = value.astype("float32")  # numpy has no bfloat16
        return value.numpy()
    return np.asarray(value)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bit patterns -> float32 (bfloat16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- config.json
def paddlenlp_config(config: ModelConfig) -> dict:
    """config.json of the PaddleNLP class that computes what `config` does (see the module docstring)."""
    return _record(config).paddlenlp.config_json(config)


# ----------------------------------------------------------------------------- directories
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
    from llm_pretrain import checkpoint as ckpt  # imports paddle: after the cheap checks
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
        import paddle

        return config_from_dict(raw, source=config_file), paddle.load(weights_file), path
    raise UsageError(f"{path} is neither a checkpoint (no {ckpt.TRAINER_STATE}) nor a model directory "
                     "(config.json + model_state.pdparams)")


def _load_foreign_weights(directory: str) -> tuple[dict, str]:
    """Full weights of a PaddleNLP/HF directory: model_state.pdparams, sharded .pdparams or safetensors."""
    import paddle

    def path(name):
        return os.path.join(directory, name)

    if any(f.startswith("model_state.tp") for f in os.listdir(directory)):
        raise UsageError(f"{directory} holds tensor-parallel shards (model_state.tpXX.pdparams); merge them with "
                         "PaddleNLP first (save_pretrained with merge_tensor_parallel, or a unified checkpoint)")
    if os.path.isfile(path("model_state.pdparams")):
        return paddle.load(path("model_state.pdparams")), path("model_state.pdparams")
    for index, loader in (("model_state.pdparams.index.json", paddle.load),
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
