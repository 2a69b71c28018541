"""What the families' parameter-name tables are made of (models/families/<family>.py, `paddlenlp`).

A table is a list of `Rule`s: one PaddleNLP (or Hugging Face) tensor made of one or more of
ours. models/paddlenlp_interop.py applies the tables; this module only describes them, so that
the families can write theirs without importing the interchange (which looks the families up).
"""

from __future__ import annotations

from dataclasses import dataclass

JOINS = ("same", "transpose", "concat", "concat_transpose", "per_head", "kv_groups", "rope_pairs", "swap_halves", "row")
# Any join + "_transpose" is that join followed by a transpose: PyTorch's [out, in] matrices (Hugging Face).


@dataclass(frozen=True)
class Rule:
    """One PaddleNLP tensor made of one or more of ours. "{i}" stands for the layer index.

    join: how our tensors become theirs (see JOINS and paddlenlp_interop._join). export_only: a tied
    copy that PaddleNLP saves (GPT's lm_head.weight) but that carries no information of its own.
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
