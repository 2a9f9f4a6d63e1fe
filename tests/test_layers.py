"""The package's layers, as a newcomer reads them in docs/development.md: no import cycle between modules, and
no import upward (the edge library and the accounting import nothing of fairgate; policies are pure and see
only accounting; the engine model and its emulated server see only accounting; the simulator runs the
policies, the engine model and the quota meters (replayed limits) and never the gateway, and the gateway never imports the simulator; inside ``proxy/`` the control plane
does not reach into the request pipeline, and neither reaches back into the composition root). Imports under
``if TYPE_CHECKING:`` are annotations, not dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fairgate"

ALLOWED = {  # package → the fairgate packages it may import (besides itself)
    "http": set(),
    "accounting": set(),
    "printable": set(),
    "logs": {"printable"},
    "periodic": set(),
    "policies": {"accounting"},
    "storage": {"accounting", "periodic"},
    "quota": {"accounting", "storage"},
    "engine": {"accounting"},
    "sim": {"policies", "accounting", "engine", "quota"},  # (quota: the meters, for replayed limits)
    "migrations": {"storage"},
    "proxy": {"http", "storage", "quota", "policies", "accounting", "engine", "logs", "periodic", "printable"},
    "cli": {"proxy", "sim", "engine", "storage", "quota", "policies", "accounting", "logs", "http", "periodic",
            "printable", ""},
}


def _module(path: Path) -> str:
    parts = ("fairgate",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, known: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fairgate"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fairgate"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known}


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    known = set(paths)
    return {m: _imports(ast.parse(p.read_text()), known) - {m} for m, p in paths.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_module_imports_itself_back_through_others():
    graph, state, cycles = _graph(), {}, []

    def walk(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                walk(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not cycles, cycles


def test_no_package_imports_upward():
    wrong = sorted((m, d) for m, deps in _graph().items() for d in deps
                   if _package(d) != _package(m) and _package(d) not in ALLOWED[_package(m)])
    assert not wrong, wrong


def test_inside_proxy_the_control_plane_does_not_reach_into_the_pipeline_nor_either_into_the_root():
    graph = _graph()
    wrong = []
    for m, deps in graph.items():
        for d in deps:
            if m.startswith("fairgate.proxy.control") and d.startswith("fairgate.proxy.pipeline"):
                wrong.append((m, d))
            if m.startswith(("fairgate.proxy.control", "fairgate.proxy.pipeline")) and d in (
                    "fairgate.proxy.app", "fairgate.proxy.listener"):
                wrong.append((m, d))
    assert not wrong, wrong


def test_no_two_modules_share_a_name():
    """One home per concept, named for it: a module's name says which (``accounting/tally.py`` and
    ``cli/usage.py``, not two ``usage.py``)."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py" and "migrations" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}


def test_the_gateway_imports_nothing_of_the_simulator():
    """What ``fairgate serve`` runs (``fairgate.proxy.app`` and all it imports, at any depth, emulated backends
    included) holds no module of ``fairgate.sim``: the engine model it shares with the simulator is
    ``fairgate.engine``."""
    graph, seen, todo = _graph(), set(), ["fairgate.proxy.app"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert not sorted(m for m in seen if m.startswith("fairgate.sim")), sorted(seen)
