"""Weight and config mapping between our models and PaddleNLP 2.8 (and Hugging Face) classes.

    to_paddlenlp_state(config, state)                  our full weights -> PaddleNLP names and layouts
    from_paddlenlp_state(config, raw_config, state)    theirs -> ours, in the config's fused layout
    paddlenlp_config(config)                           the PaddleNLP class's config.json
    canonical_shapes(config), check_state, check_exportable

Arrays in, arrays out: reading checkpoints and model directories and writing PaddleNLP ones is
llm_pretrain/checkpoint/interchange.py's (export_to_paddlenlp, import_from_paddlenlp).

Which PaddleNLP class runs each family, its parameter-name tables (models/weight_names.Rule) and
its config.json are in the family's record (models/families/<family>.py, `paddlenlp`):

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

import numpy as np

from models.config import ModelConfig
from models.dtypes import bfloat16_bits_to_float32
from models.errors import UsageError
from models.weight_names import Rule


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
    if join == "swap_halves":  # the two halves of the input axis exchanged (DeepSeek's MTP eh_proj)
        return np.concatenate(np.split(parts[0], 2, axis=0)[::-1], axis=0)
    if join == "row":  # our [E] as their [1, E] (ERNIE 4.5's e_score_correction_bias)
        return parts[0].reshape(1, -1)
    prefix = parts[0].shape[:-1]
    if join == "rope_pairs":  # each head's dims from rotate-half order to interleaved pairs (ERNIE 4.5)
        return _rope_pairs(parts[0], d, to_pairs=True)
    if join == "per_head":  # [..., h*d] x 3 -> [..., h, 3, d]
        q, k, v = (p.reshape(prefix + (heads, d)) for p in parts)
        return np.stack([q, k, v], axis=-2).reshape(prefix + (3 * heads * d,))
    if join == "kv_groups":  # [..., kv, (groups + 2) * d]: each kv head's q heads, then its k and v
        groups = heads // kv_heads
        q = parts[0].reshape(prefix + (kv_heads, groups * d))
        k, v = (p.reshape(prefix + (kv_heads, d)) for p in parts[1:])
        return np.concatenate([q, k, v], axis=-1).reshape(prefix + (kv_heads * (groups + 2) * d,))
    raise ValueError(f"unknown join {join!r}")


def _rope_pairs(x: np.ndarray, d: int, to_pairs: bool) -> np.ndarray:
    """The output columns of q_proj / k_proj ([..., heads x d]) between two rotary layouts of a head.

    Ours rotates halves: dim j pairs with j + d/2 at frequency j (models/decoder.py apply_rotary). ERNIE 4.5
    rotates interleaved pairs: dim 2j with 2j + 1 at frequency j (PaddleFormers 0.4.1
    transformers/ernie4_5/modeling.py rotate_half / apply_rotary_pos_emb, the tables repeat_interleave'd).
    Their column 2j is our j, their 2j + 1 our j + d/2; q and k permuted alike leave every q.k unchanged,
    so our decoder computes their attention with the columns reordered (v, o_proj untouched)."""
    prefix = x.shape[:-1]
    if to_pairs:  # [h, 2, d/2] -> [h, d/2, 2]
        return x.reshape(prefix + (-1, 2, d // 2)).swapaxes(-1, -2).reshape(x.shape)
    return x.reshape(prefix + (-1, d // 2, 2)).swapaxes(-1, -2).reshape(x.shape)


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
    if join == "swap_halves":
        return [np.concatenate(np.split(x, 2, axis=0)[::-1], axis=0)]
    if join == "row":
        return [x.reshape(-1)]
    prefix = x.shape[:-1]
    if join == "rope_pairs":
        return [_rope_pairs(x, d, to_pairs=False)]
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


# ----------------------------------------------------------------------------- config.json
def paddlenlp_config(config: ModelConfig) -> dict:
    """config.json of the PaddleNLP class that computes what `config` does (see the module docstring)."""
    return _record(config).paddlenlp.config_json(config)
