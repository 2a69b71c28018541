"""The repository's structure: no import circles, models/ never imports llm_pretrain/, nothing outside the clone.

The import graph is built from the source with `ast` (nothing is imported): every `import` and
`from ... import` anywhere in a file -- at module level and inside functions -- of llm_pretrain/,
models/ and scripts/, relative or absolute. `from package import name` counts as an import of
package.name when that is one of the project's modules (a submodule), else of the package. An
edge goes to the module named, not to the packages above it (Python has those already
initialized, or initializing, when a submodule runs: `models/families/llama.py` importing
`models.families.base` is no circle with `models/families/__init__.py`).
Scripts import each other by bare name (scripts/ is on sys.path when one runs): `benchmark` is
scripts/benchmark.py. Imports of anything else (paddle, numpy, tests/ helpers) are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("llm_pretrain", "models", "scripts")


# ----------------------------------------------------------------------------- the graph
def project_modules(root: Path = REPO_ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under PACKAGES (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an absolute dotted name refers to (the longest known prefix), or None."""
    if name.split(".")[0] not in PACKAGES and f"scripts.{name.split('.')[0]}" in modules:
        name = f"scripts.{name}"  # a script importing another by its bare name
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in the file, function-level ones included."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                names.append((submodule if _resolve(submodule, modules) == submodule else source, node.lineno))
    return names


def import_graph(root: Path = REPO_ROOT) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(project module -> the project modules it imports, [(module, absolute name, line)] of every import)."""
    modules = project_modules(root)
    graph: dict[str, set[str]] = {module: set() for module in modules}
    every_import = []
    for module, path in modules.items():
        for name, line in imported_names(module, path, modules):
            every_import.append((module, name, line))
            target = _resolve(name, modules)
            if target is not None and target != module:
                graph[module].add(target)
    return graph, every_import


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) through each strongly connected component of more than one module
    (Tarjan's algorithm), or of one module that imports itself."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest circle from the component's first module back to it (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a component always has one


# ----------------------------------------------------------------------------- the tests
def test_no_import_circles_among_the_projects_modules():
    graph, _ = import_graph()
    assert len(graph) > 60 and graph["llm_pretrain.checkpoint.checkpointer"]  # the whole tree was read
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_models_never_import_llm_pretrain():
    _, every_import = import_graph()
    offending = [f"{module} (line {line}) imports {name}" for module, name, line in every_import
                 if module.split(".")[0] == "models" and name.split(".")[0] == "llm_pretrain"]
    assert not offending, "models/ must not import llm_pretrain/:\n" + "\n".join(offending)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The checker itself, on a small tree: each kind of import is an edge, and circles are found."""
    files = {
        "llm_pretrain/__init__.py": "",
        "llm_pretrain/a.py": "from llm_pretrain import b\n",  # `from package import submodule`
        "llm_pretrain/b.py": "def f():\n    from . import c\n",  # relative, inside a function
        "llm_pretrain/c.py": "import llm_pretrain.a as again\nimport numpy\n",  # absolute; numpy is no edge
        "llm_pretrain/sub/__init__.py": "from .d import x\n",  # relative from a package's __init__
        "llm_pretrain/sub/d.py": "from ..a import thing\nx = 1\n",  # two levels: llm_pretrain.a
        "models/__init__.py": "",
        "models/m.py": "def g():\n    from llm_pretrain.errors import E\n",
        "scripts/s1.py": "import s2\n",  # scripts by bare name
        "scripts/s2.py": "from s1 import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph, every_import = import_graph(tmp_path)
    assert graph["llm_pretrain.a"] == {"llm_pretrain.b"} and graph["llm_pretrain.b"] == {"llm_pretrain.c"}
    assert graph["llm_pretrain.c"] == {"llm_pretrain.a"}
    assert graph["llm_pretrain.sub"] == {"llm_pretrain.sub.d"} and graph["llm_pretrain.sub.d"] == {"llm_pretrain.a"}
    assert graph["scripts.s1"] == {"scripts.s2"} and graph["scripts.s2"] == {"scripts.s1"}
    cycles = sorted(find_cycles(graph))
    assert cycles == [["llm_pretrain.a", "llm_pretrain.b", "llm_pretrain.c", "llm_pretrain.a"],
                      ["scripts.s1", "scripts.s2", "scripts.s1"]]
    assert ("models.m", "llm_pretrain.errors", 2) in every_import


# ----------------------------------------------------------------------------- nothing outside the clone
def test_no_source_file_names_a_path_outside_the_repository():
    # Spelled in two pieces so that this file does not match itself.
    forbidden = ("/" + "work/", "shared" + "/data")
    offending = []
    for folder in ("llm_pretrain", "models", "scripts", "tests"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            offending += [f"{path.relative_to(REPO_ROOT)}: {pattern!r}" for pattern in forbidden if pattern in text]
    assert not offending, "paths outside the clone:\n" + "\n".join(offending)


# ----------------------------------------------------------------------------- the direction between packages
# Which package of llm_pretrain may import which (each package's __init__ says the same in words).
# "base" is llm_pretrain.arguments and llm_pretrain.errors, which every package uses; "entry" the two entry
# points at the top of the package; "models" the model package beside it (it never imports llm_pretrain).
BASE = {"base", "models"}
MAY_IMPORT = {
    "base": {"models"},
    "cpu": BASE,
    "data": BASE,
    "parallel": BASE | {"cpu", "data"},
    "checkpoint": BASE | {"cpu", "data", "parallel"},
    "observe": BASE | {"cpu", "parallel"},
    "planner": BASE | {"parallel", "observe"},
    "run": BASE | {"cpu", "data", "parallel", "checkpoint", "observe", "planner"},
    "entry": BASE | {"run"},
    "selfcheck": BASE | {"cpu", "data", "parallel", "checkpoint", "observe", "planner", "run", "entry"},
    "cli": BASE | {"cpu", "data", "parallel", "checkpoint", "observe", "planner", "run", "entry", "selfcheck"},
}


def package_of(module: str) -> str | None:
    """The package a module of llm_pretrain/ or models/ belongs to in MAY_IMPORT (None: neither)."""
    parts = module.split(".")
    if parts[0] == "models":
        return "models"
    if parts[0] != "llm_pretrain":
        return None
    if len(parts) == 1 or parts[1] in ("arguments", "errors"):
        return "base"
    if parts[1] in ("run_pretrain", "launch"):
        return "entry"
    return parts[1]


def arrows_against_the_table(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        source = package_of(module)
        if source is None or source == "models":
            continue
        for target in sorted(targets):
            to = package_of(target)
            if to is not None and to != source and to not in MAY_IMPORT[source]:
                wrong.append(f"{module} ({source}) imports {target} ({to})")
    return wrong


def test_packages_import_only_downwards():
    graph, _ = import_graph()
    packages = {package_of(module) for module in graph if module.startswith("llm_pretrain.")}
    assert packages == set(MAY_IMPORT), f"a package missing from MAY_IMPORT: {packages ^ set(MAY_IMPORT)}"
    wrong = arrows_against_the_table(graph)
    assert not wrong, "imports against the direction table:\n" + "\n".join(wrong)


def test_the_direction_table_has_no_circle_and_catches_an_upward_arrow():
    table = {package: targets - {package} for package, targets in MAY_IMPORT.items()}
    table["models"] = set()
    assert not find_cycles(table)
    graph, _ = import_graph()
    graph = {module: set(targets) for module, targets in graph.items()}
    graph["llm_pretrain.parallel.layout"].add("llm_pretrain.run.preflight")  # the arrow this move removed
    assert arrows_against_the_table(graph) == [
        "llm_pretrain.parallel.layout (parallel) imports llm_pretrain.run.preflight (run)"]


def test_every_package_says_what_it_holds_and_may_import():
    for package in sorted(set(MAY_IMPORT) - {"base", "entry"}):
        doc = ast.get_docstring(ast.parse((REPO_ROOT / "llm_pretrain" / package / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"llm_pretrain/{package}/__init__.py: no docstring naming its imports"
    top_level = sorted(p.name for p in (REPO_ROOT / "llm_pretrain").glob("*.py"))
    assert top_level == ["__init__.py", "arguments.py", "errors.py", "launch.py", "run_pretrain.py"], top_level
