"""The package: every command of pyproject.toml names a function, scripts/<name>.py runs the same one,
and no script or worker edits sys.path (the package is installed; tests pass PYTHONPATH)."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
COMMANDS = PYPROJECT["project"]["scripts"]


def test_the_commands_are_installed():
    assert sorted(COMMANDS) == ["llm-benchmark", "llm-export-hf", "llm-import-hf", "llm-perf-table", "llm-plan",
                                "llm-prepare-data", "llm-pretrain"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_names_a_function_and_its_script_runs_the_same(command):
    module_name, function_name = COMMANDS[command].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    assert callable(function)
    if module_name.startswith("llm_pretrain.cli."):  # scripts/<name>.py is a thin wrapper around it
        script = REPO_ROOT / "scripts" / f"{module_name.rsplit('.', 1)[1]}.py"
        tree = ast.parse(script.read_text())
        imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   for alias in node.names]
        assert (module_name, function_name) in imports, script


def test_the_packages_hold_llm_pretrain_and_models_only():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.split(".")[0] for name in include} == {"llm_pretrain", "models"}
    assert "paddlepaddle" not in " ".join(PYPROJECT["project"]["dependencies"])  # the GPU build keeps its own


def edits_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys"):
            return True
    return False


def test_no_script_or_worker_edits_sys_path():
    files = [*(REPO_ROOT / "scripts").glob("*.py"), *(REPO_ROOT / "llm_pretrain").rglob("*.py"),
             *(REPO_ROOT / "models").rglob("*.py"), *(REPO_ROOT / "tests" / "workers").glob("*.py")]
    offenders = {str(p.relative_to(REPO_ROOT)) for p in files if edits_sys_path(p)}
    assert not offenders, offenders
