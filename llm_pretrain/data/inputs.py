"""What `input_dir` and `split` mean, checked cheaply before any expensive work.

input_dir is one of (tried in this order):
  * a directory: every prefix.bin/prefix.idx pair directly inside it, blended by
    token count (a prefix with twice the tokens is sampled twice as often, so the
    blend behaves like one concatenated corpus; PaddleNLP gives every file weight
    1.0 instead -- write a blend string to get that);
  * a prefix path: prefix.bin + prefix.idx (".bin"/".idx" on the end is tolerated);
  * a blend string "0.7 dir/a 0.3 dir/b": weights and prefixes, relative paths
    relative to the current directory; weights are normalized to sum to 1.
split is 1-3 non-negative numbers separated by commas ("949,50,1"; PaddleNLP's
"/" separator works too), missing ones are 0; they are the train/valid/test
shares of each prefix's documents.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from llm_pretrain.data.indexed import IndexedDataset, bin_path, idx_path
from llm_pretrain.errors import UsageError

BLEND_HELP = "a directory of prefix.bin/prefix.idx files, a prefix, or a blend 'w1 prefix1 w2 prefix2 ...'"


@dataclass(frozen=True)
class Source:
    """One prefix and its blend weight (None: weight it by its token count)."""

    prefix: str
    weight: float | None = None


# ----------------------------------------------------------------------------- split
def parse_split(split: str) -> list[float]:
    """'949,50,1' -> [0.949, 0.05, 0.001] (three shares summing to 1)."""
    text = str(split).strip()
    parts = text.replace("/", ",").split(",") if text else []
    allowed = "must be 1-3 non-negative numbers separated by commas, not all zero (e.g. '949,50,1')"
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise UsageError(f"split: '{split}' {allowed}") from None
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise UsageError(f"split: '{split}' {allowed}")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """[start, end) document ranges of train/valid/test, rounded as PaddleNLP's get_train_valid_test_split_."""
    bounds = [0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    excess = bounds[-1] - num_documents  # rounding may overshoot by one: take it from every boundary
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


# ----------------------------------------------------------------------------- input_dir
def _strip_extension(path: str) -> str:
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def _check_pair(prefix: str) -> None:
    has_bin, has_idx = os.path.isfile(bin_path(prefix)), os.path.isfile(idx_path(prefix))
    if has_bin and not has_idx:
        raise UsageError(f"input_dir: {bin_path(prefix)} has no index {idx_path(prefix)} "
                         "(prepare both with scripts/prepare_data.py)")
    if has_idx and not has_bin:
        raise UsageError(f"input_dir: {idx_path(prefix)} has no data file {bin_path(prefix)}")
    if not has_bin:
        raise UsageError(f"input_dir: no data at prefix {prefix} (expected {bin_path(prefix)} and {idx_path(prefix)})")


def _prefixes_in_directory(directory: str) -> list[str]:
    names = sorted(os.listdir(directory))
    stems = sorted({name[:-4] for name in names if name.endswith((".bin", ".idx"))
                    and os.path.isfile(os.path.join(directory, name))})
    if not stems:
        raise UsageError(f"input_dir: no prefix.bin + prefix.idx pair in directory {directory} "
                         "(prepare data with scripts/prepare_data.py)")
    prefixes = [os.path.join(directory, stem) for stem in stems]
    for prefix in prefixes:
        _check_pair(prefix)
    return prefixes


def _parse_blend(text: str) -> list[Source]:
    words = text.split()
    if len(words) % 2:
        raise UsageError(f"input_dir: '{text}' is not {BLEND_HELP} (a blend needs weight/prefix pairs)")
    sources = []
    for weight_text, prefix in zip(words[0::2], words[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            weight = float("nan")
        if not (math.isfinite(weight) and weight > 0):
            raise UsageError(f"input_dir: blend weight '{weight_text}' before {prefix} is not a positive number "
                             "(expected 'w1 prefix1 w2 prefix2 ...')")
        prefix = _strip_extension(prefix)
        if os.path.isdir(prefix):
            raise UsageError(f"input_dir: blend entry {prefix} is a directory; blend entries are prefixes "
                             "(path/name for path/name.bin + path/name.idx)")
        _check_pair(prefix)
        sources.append(Source(prefix, weight))
    return sources


def resolve_sources(input_dir: str) -> list[Source]:
    """The prefixes input_dir names, with their weights (see the module docstring)."""
    if not input_dir or not str(input_dir).strip():
        raise UsageError(f"input_dir: required; {BLEND_HELP}")
    input_dir = str(input_dir)
    if os.path.isdir(input_dir):
        return [Source(prefix) for prefix in _prefixes_in_directory(input_dir)]
    prefix = _strip_extension(input_dir)
    if os.path.exists(bin_path(prefix)) or os.path.exists(idx_path(prefix)):
        _check_pair(prefix)
        return [Source(prefix)]
    if len(input_dir.split()) > 1:
        return _parse_blend(input_dir)
    raise UsageError(f"input_dir: {input_dir} does not exist; expected {BLEND_HELP}")


def _check_not_empty(prefix: str) -> IndexedDataset:
    dataset = IndexedDataset(prefix)
    if dataset.num_documents == 0 or dataset.num_tokens == 0:
        raise UsageError(f"input_dir: empty data in {prefix}.bin/.idx "
                         f"({dataset.num_documents} documents, {dataset.num_tokens} tokens)")
    return dataset


def open_sources(input_dir: str) -> list[tuple[Source, IndexedDataset]]:
    """Every source with its opened data; weights filled in and normalized to sum to 1."""
    sources = resolve_sources(input_dir)
    opened = [(source, _check_not_empty(source.prefix)) for source in sources]
    raw = [source.weight if source.weight is not None else float(data.num_tokens) for source, data in opened]
    total = sum(raw)
    return [(Source(source.prefix, weight / total), data) for (source, data), weight in zip(opened, raw)]


def check_data_inputs(input_dir: str, split: str) -> None:
    """Raise UsageError for anything wrong with input_dir or split. Reads only the .idx headers and sizes."""
    parse_split(split)
    open_sources(input_dir)
