"""The model families, one record each.

Everything that makes a family lives in models/families/<name>.py, which defines `FAMILY`, a
`Family` record (models/families/base.py):

    switches            the ModelConfig fields that make it (norm, positions, MLP, biases, head)
    scaled_output_init  its initialization rule (models/weights.py)
    architectures       its registry entries: hub names with published sizes, tiny CPU presets
    model_types, read_config   which config.json files it reads, and how (models/registry.py)
    paddlenlp           the PaddleNLP/HF class: parameter-name tables, config.json, what it can express
    hugging_face        the Hugging Face transformers class for export (names, config.json), or None
    reference_cases     the reference implementation the tests compare against

A new dense family is one file here plus its name in FAMILY_MODULES; the registry, the weight
interchange and the tests (reference parity, interop, every parallel layout) iterate over FAMILIES.
"""

from __future__ import annotations

import importlib

from models.families.base import Family, HuggingFaceClass, PaddleNLPClass, ReferenceCase

FAMILY_MODULES = ("llama", "baichuan", "qwen", "qwen2", "gpt3", "bloom", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe",
                  "ernie4_5", "ernie4_5_moe", "deepseek_v3")

FAMILIES: dict[str, Family] = {
    name: importlib.import_module(f"models.families.{name}").FAMILY for name in FAMILY_MODULES
}
FAMILY_NAMES = tuple(FAMILIES)


def get_family(name: str) -> Family:
    return FAMILIES[name]


def family_for_model_type(model_type: str) -> Family | None:
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    return None


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES.values() for t in family.model_types)


def reference_cases() -> dict[str, ReferenceCase]:
    """Every family's reference cases by name (tests/test_reference_parity.py)."""
    return {name: case for family in FAMILIES.values() for name, case in family.reference_cases.items()}


__all__ = ["FAMILIES", "FAMILY_NAMES", "Family", "HuggingFaceClass", "PaddleNLPClass", "ReferenceCase",
           "family_for_model_type",
           "get_family", "reference_cases", "supported_model_types"]
