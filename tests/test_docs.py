"""The documentation names only tests and benchmarks that exist.

Every claim in README.md, docs/*.md and configs/README.md is backed by the test or benchmark file it
names; this checks that each named file exists and, for `file::name`, that the file defines that
test function. Forms recognised: `tests/x.py`, `tests/x.py::name`, `test_x::name` (= tests/test_x.py),
`mech::name` (= tests/test_mechanisms.py; also `parity::`, `lc::`, `ep::`, `uneven::`: ABBREVIATIONS),
`benchmarks/...`, and a bare `test_x` in backticks (a test module tests/test_x.py or a test function of
some tests/*.py). docs/_pending/ holds text waiting to be folded in and is not checked.

The README's "What works" table has a mark in every cell, and docs/parallel-layouts.md's table "Which
test proves each mark" has the same rows, columns and marks, each naming a test (except "n/a").
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ABBREVIATIONS = {"mech": "tests/test_mechanisms.py", "parity": "tests/test_parallel_parity.py",
                 "lc": "tests/test_long_context.py", "ep": "tests/test_expert_parallel.py",
                 "uneven": "tests/test_uneven_pipeline.py"}

TEST_FILE = re.compile(r"(?<![\w/.])(tests/[\w/]+\.py)(?:::(\w+))?")
TEST_MODULE = re.compile(r"(?<![\w/.:])(test_\w+|" + "|".join(ABBREVIATIONS) + r")::(\w+)")
BARE_TEST = re.compile(r"`(test_\w+)`")
BENCHMARK = re.compile(r"(?<![\w/.])(?:\.\./)?(benchmarks/[\w./-]*)")  # ../ from docs/


def documentation_files() -> list[Path]:
    docs = sorted(p for p in (REPO_ROOT / "docs").glob("*.md"))  # not docs/_pending/
    return [REPO_ROOT / "README.md", REPO_ROOT / "configs" / "README.md", *docs]


def references(text: str) -> list[tuple[str, str | None]]:
    """(repository path, function name or None) of every test or benchmark the text names."""
    found = [(path, name) for path, name in TEST_FILE.findall(text)]
    for module, name in TEST_MODULE.findall(text):
        found.append((ABBREVIATIONS.get(module, f"tests/{module}.py"), name))
    found += [(path.rstrip("."), None) for path in BENCHMARK.findall(text)]
    return [(path, name or None) for path, name in found]


def bare_test_names(text: str) -> set[str]:
    return set(BARE_TEST.findall(text))


@cache
def all_test_functions() -> frozenset[str]:
    return frozenset().union(*(functions_in(path) for path in (REPO_ROOT / "tests").rglob("*.py")))


@cache
def functions_in(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_the_reference_forms_are_recognised():
    text = ("see `tests/test_training.py`, `tests/test_precision.py::test_fp16_x`, `mech::test_y`, "
            "`test_parallel_parity::test_dp2`, `ep::test_z` and [b](../benchmarks/cpu_speed.md). "
            "(`benchmarks/data_pipeline.md`).")
    assert references(text) == [
        ("tests/test_training.py", None), ("tests/test_precision.py", "test_fp16_x"),
        ("tests/test_mechanisms.py", "test_y"), ("tests/test_parallel_parity.py", "test_dp2"),
        ("tests/test_expert_parallel.py", "test_z"),
        ("benchmarks/cpu_speed.md", None), ("benchmarks/data_pipeline.md", None),
    ]
    assert bare_test_names("`test_recompute` (module), `test_tensor_parallel` (function), `tests/test_x.py`") == {
        "test_recompute", "test_tensor_parallel"}


@pytest.mark.parametrize("doc", documentation_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_named_test_and_benchmark_exists(doc):
    missing = []
    for path, name in references(doc.read_text()):
        target = REPO_ROOT / path
        if not target.exists():
            missing.append(path)
        elif name is not None and name not in functions_in(target):
            missing.append(f"{path}::{name}")
    for name in bare_test_names(doc.read_text()):
        if not (REPO_ROOT / "tests" / f"{name}.py").exists() and name not in all_test_functions():
            missing.append(name)
    assert not missing, f"{doc.relative_to(REPO_ROOT)} names what does not exist: {sorted(set(missing))}"


def test_the_docs_pages_are_indexed_and_linked():
    index = (REPO_ROOT / "docs" / "README.md").read_text()
    pages = [p.name for p in (REPO_ROOT / "docs").glob("*.md") if p.name != "README.md"]
    assert pages and all(f"({name})" in index for name in pages), pages
    for doc in documentation_files():
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not link.startswith(("http://", "https://")):
                assert (doc.parent / link).exists(), f"{doc.relative_to(REPO_ROOT)}: broken link {link}"


def markdown_table(text: str, heading: str) -> tuple[list[str], dict[str, list[str]]]:
    """The first table after `heading`: its column names (the first one, empty, left out) and its rows
    by their first cell."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rows = table[0], table[2:]
    return header[1:], {row[0]: row[1:] for row in rows}


MARKS = ("✓", "import", "refused", "n/a", "GPU", "untested")  # what a cell of the README's table may say


def test_the_what_works_table_has_a_mark_everywhere_and_each_names_its_test():
    """No blank cell (a reader takes a blank for "not supported"); every mark of every family is the
    same in the per-family table of docs/parallel-layouts.md, which names the tests that prove it."""
    readme_columns, readme = markdown_table((REPO_ROOT / "README.md").read_text(), "## What works")
    proofs_text = (REPO_ROOT / "docs" / "parallel-layouts.md").read_text()
    columns, proofs = markdown_table(proofs_text, "### Which test proves each mark")
    assert readme_columns[-1] == "details" and readme_columns[:-1] == columns, (readme_columns, columns)
    assert list(readme) == list(proofs), (list(readme), list(proofs))
    for row, cells in readme.items():
        for family, mark, proof in zip(columns, cells[:-1], proofs[row], strict=True):  # (not "details")
            where = f"{row} / {family}"
            assert mark in MARKS, f"README's What works, {where}: {mark!r} is not a mark ({MARKS})"
            assert proof.split(" ")[0] == mark, f"{where}: README says {mark!r}, parallel-layouts.md {proof!r}"
            if mark != "n/a":
                assert references(proof) or bare_test_names(proof), f"{where}: {proof!r} names no test"


def test_the_readme_stays_a_short_guide():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "`error: ...`" in readme and "exit code 2" in readme
