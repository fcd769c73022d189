"""core/ has no import cycle, its roles (contracts at its top, ``engine/``, ``entrypoints/``)
import in one direction, and it never imports a plugin module; imports under ``TYPE_CHECKING`` and inside functions
count too."""

from __future__ import annotations

import ast
import pathlib

CORE = pathlib.Path(__file__).resolve().parents[2] / "core"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every servelab module ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("servelab"):
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("servelab")}
    return names


def core_imports(path: pathlib.Path) -> set[str]:
    """The core modules ``path`` imports, anywhere in the file, as dotted names under
    ``servelab.core`` (``engine.registry``, ``scheduler``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "servelab.core":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("servelab.core."):
            names.add(node.module.removeprefix("servelab.core."))
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("servelab.core.") for a in node.names if a.name.startswith("servelab.core.")}
    return names


def core_modules() -> dict[str, pathlib.Path]:
    """Every core module by its dotted name under ``servelab.core`` (packages left out)."""
    return {".".join(path.relative_to(CORE).with_suffix("").parts): path
            for path in sorted(CORE.rglob("*.py")) if path.stem != "__init__"}


ROLES = ("entrypoints", "engine", "contracts")
"""core/'s roles, each importing only itself and the roles after it."""


def role(module: str) -> str:
    """``engine`` or ``entrypoints`` for a module in those folders, else ``contracts``."""
    folder = module.split(".")[0]
    return folder if folder in ROLES else "contracts"


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module] & graph.keys()):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_core_has_no_import_cycle():
    graph = {module: core_imports(path) for module, path in core_modules().items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_core_imports_go_from_entry_points_to_engine_to_contracts():
    backwards = {module: sorted(imported for imported in core_imports(path)
                                if ROLES.index(role(imported)) < ROLES.index(role(module)))
                 for module, path in core_modules().items()}
    assert not {module: imported for module, imported in backwards.items() if imported}


def test_core_has_a_folder_per_role():
    assert {role(module) for module in core_modules()} == set(ROLES)
    assert role("engine.llm_engine") == "engine" and role("scheduler") == "contracts"


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_core_never_imports_a_plugin_module():
    offenders = {path.name: sorted(m for m in imported_modules(path) if m.startswith("servelab.plugins"))
                 for path in CORE.rglob("*.py")}
    assert not {name: modules for name, modules in offenders.items() if modules}
