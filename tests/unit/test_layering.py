"""The package layering of docs/architecture.md, read from the source (no import runs).

Every ``import`` and ``from … import`` of every module counts, including those inside
functions (an import deferred for start-up time is still an arrow). Two checks:

- between packages, only the allowed arrows: the kernel (``sidecar_common``) imports nothing
  of ours; the sidecar server the kernel; the engine packages the kernel and the server; the
  frontend and the testkit the kernel only; the umbrella ``sidecar`` command anything;
- inside each package, the module graph has no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

_ROOT: Final = Path(__file__).resolve().parents[2]

# Import name -> its source folder.
_PACKAGES: Final[Mapping[str, Path]] = {
    "sidecar_common": _ROOT / "sidecar_common",
    "sidecar_server": _ROOT / "sidecar_server",
    "sidecar_vllm": _ROOT / "sidecar_vllm",
    "sidecar_sglang": _ROOT / "sidecar_sglang",
    "sidecar_frontend": _ROOT / "sidecar_frontend",
    "sidecar_command": _ROOT / "sidecar_command",
    "testkit": _ROOT / "testkit" / "src" / "testkit",
}

# Package -> the other packages of ours it may import. Anything else of ours is an arrow
# that runs up or sideways.
_ALLOWED: Final[Mapping[str, frozenset[str]]] = {
    "sidecar_common": frozenset(),
    "sidecar_server": frozenset({"sidecar_common"}),
    "sidecar_vllm": frozenset({"sidecar_common", "sidecar_server"}),
    "sidecar_sglang": frozenset({"sidecar_common", "sidecar_server"}),
    "sidecar_frontend": frozenset({"sidecar_common"}),
    "sidecar_command": frozenset(_PACKAGES) - {"sidecar_command"},
    "testkit": frozenset({"sidecar_common"}),
}


@dataclass(frozen=True)
class _Import:
    source: str  # the importing module, dotted
    line: int
    target: str  # the imported module, dotted (for ``from p import name``: ``p.name`` when
    # that is a module of ours, else ``p``)


def _module_name(package: str, path: Path) -> str:
    parts = path.relative_to(_PACKAGES[package]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(package, path): path for path in sorted(_PACKAGES[package].rglob("*.py"))}


_ALL_MODULES: Final = {name: path for package in _PACKAGES for name, path in _modules(package).items()}


def _is_package(module: str) -> bool:
    return _ALL_MODULES[module].name == "__init__.py"


def _resolve_relative(source: str, level: int, module: str | None) -> str:
    base = source.split(".")
    if not _is_package(source):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(module: str) -> Iterator[_Import]:
    tree = ast.parse(_ALL_MODULES[module].read_text(encoding="utf-8"), str(_ALL_MODULES[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _Import(module, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield _Import(module, node.lineno, child if child in _ALL_MODULES else base)


def _package_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in _PACKAGES else None


def _owning_module(target: str) -> str | None:
    """The module of ours ``target`` names (a dotted name inside a module counts as it)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in _ALL_MODULES:
            return name
        parts.pop()
    return None


def test_every_package_is_found() -> None:
    for package, folder in _PACKAGES.items():
        assert (folder / "__init__.py").is_file(), package


@pytest.mark.parametrize("package", sorted(_PACKAGES))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    upward = [
        f"{_ALL_MODULES[imp.source].relative_to(_ROOT)}:{imp.line} imports {imp.target}"
        for module in _modules(package)
        for imp in _imports(module)
        if (target := _package_of(imp.target)) not in (None, package) and target not in _ALLOWED[package]
    ]
    assert upward == [], f"{package} may import only {sorted(_ALLOWED[package]) or 'nothing of ours'}"


def _cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _package_graph(package: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in _modules(package)}
    for module in graph:
        for imp in _imports(module):
            target = _owning_module(imp.target)
            # A package's __init__ runs before its modules: ``from p import m`` inside p is
            # an arrow to m, not back to p itself.
            if target is not None and target != module and _package_of(target) == package:
                graph[module].add(target)
    return graph


@pytest.mark.parametrize("package", sorted(_PACKAGES))
def test_no_import_cycle_inside_a_package(package: str) -> None:
    assert _cycle(_package_graph(package)) is None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
