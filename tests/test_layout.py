"""The package's shape: layers, sizes and the README's layout section match the tree.

Every import in src/kvtier (module level and inside functions) is an arrow; an arrow may only
point to the same layer or below, and the graph has no cycle. Classes stay under 30 methods
and modules under 700 lines, so no coordinator grows back into a god object.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
README = Path(__file__).resolve().parents[1] / "README.md"
MAX_METHODS = 30
MAX_LINES = 700

# Low to high. A module belongs to the first prefix that matches it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("basics", ("kvtier.errors", "kvtier.lru", "kvtier.text", "kvtier.keys", "kvtier.codec",
                "kvtier.settings", "kvtier.namespace_settings", "kvtier.files",
                "kvtier.ops.metrics", "kvtier.ops.logs", "kvtier.ops")),
    ("storage", ("kvtier.backends", "kvtier.primary", "kvtier.policies")),
    ("inventory", ("kvtier.inventory",)),
    ("lookup", ("kvtier.lookup",)),
    ("tiering", ("kvtier.tiering",)),
    ("config", ("kvtier.config", "kvtier.factory")),
    ("engines", ("kvtier.integrations", "kvtier.replay")),
    ("commands", ("kvtier.cli", "kvtier.bench")),
)
# ops/inventory.py works on the storage layer (usage, purge, manifests of every backend kind).
# config (the loader and open_manager) sits on top of the core layers; the engines and commands
# build their stacks from it, and nothing in the core imports it.
_OVERRIDES = {"kvtier.ops.inventory": "inventory"}
_RANK = {name: rank for rank, (name, _prefixes) in enumerate(LAYERS)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str | None:
    if module in _OVERRIDES:
        return _OVERRIDES[module]
    best: tuple[int, str] | None = None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                    best is None or len(prefix) > best[0]):
                best = (len(prefix), name)
    return None if best is None else best[1]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        if name == "kvtier":  # the facade re-exports the public API lazily
            continue
        # a package __init__ re-exports its own submodules: not an arrow of the layer graph
        graph[name] = {t for t in _imports(path, known)
                       if t != name and t != "kvtier" and not t.startswith(name + ".")}
    return graph


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in _modules() if m != "kvtier" and _layer(m) is None)
    assert missing == []


def test_no_arrow_points_up() -> None:
    upward = []
    for source, targets in _graph().items():
        for target in targets:
            s, t = _layer(source), _layer(target)
            if s and t and _RANK[t] > _RANK[s]:
                upward.append(f"{source} ({s}) -> {target} ({t})")
    assert upward == []


def test_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_modules_and_classes_stay_small() -> None:
    too_big = []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_METHODS:
                    too_big.append(f"{name}.{node.name}: {len(methods)} methods")
    assert too_big == []


def _readme_layout() -> dict[str, str]:
    text = README.read_text()
    match = re.search(r"<!-- layout -->\n(.*?)<!-- /layout -->", text, re.S)
    if match is None:
        pytest.fail("README has no <!-- layout --> section")
    rows = re.findall(r"^\| `(kvtier/[^`]*)` \| (\w+) \|", match.group(1), re.M)
    return dict(rows)


def test_readme_layout_names_every_package_and_module() -> None:
    """The README's layout table lists each top-level module and package with its layer."""
    listed = _readme_layout()
    actual = {}
    for path in sorted(SRC.iterdir()):
        if path.name.startswith("_") or path.name in {"data", "py.typed"}:
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            actual[f"kvtier/{path.name}/"] = path
        elif path.suffix == ".py":
            actual[f"kvtier/{path.name}"] = path
    assert sorted(listed) == sorted(actual)
    for entry, layer in listed.items():
        module = "kvtier." + entry.removeprefix("kvtier/").removesuffix("/").removesuffix(".py")
        expected = _layer(module)
        assert layer == expected, f"{entry}: README says {layer}, the layer map says {expected}"
