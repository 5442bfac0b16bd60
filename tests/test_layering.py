"""The layer table (`docs/layers.toml`) checked against the imports in src/sits's source.

Every module is parsed with `ast` (nothing is imported), so imports inside functions and under
`TYPE_CHECKING` count as much as those at the top. A failure names the file, the line and the
two layers (or the rule and the chain of imports that breaks it).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TABLE = tomllib.loads((ROOT / "docs" / "layers.toml").read_text())
LAYERS: dict[str, int] = {name: row[0] for name, row in TABLE["layers"].items()}


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target.

    Attributes:
        importer: the dotted module holding the statement ("sits.layers.moe").
        target: a sits module ("sits.models.loader") or a library's top name ("torch").
        lineno: the statement's line.
    """

    importer: str
    target: str
    lineno: int

    @property
    def where(self) -> str:
        return f"{source_files()[self.importer].relative_to(ROOT)}:{self.lineno}"


@cache
def source_files() -> dict[str, Path]:
    """Every module of src/sits by dotted name (a package by its __init__.py)."""
    files = {}
    for path in sorted((SRC / "sits").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module of a `from ... import`, relative levels resolved."""
    if not node.level:
        return node.module or ""
    is_package = source_files()[importer].name == "__init__.py"
    base = importer.split(".")[: len(importer.split(".")) + is_package - node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(importer: str, node: ast.AST) -> Iterator[str]:
    modules = source_files()
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        module = _resolve(importer, node)
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            yield submodule if submodule in modules else module


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The imports of one module, each sits target closed to a module of src/sits."""
    modules = source_files()
    tree = ast.parse(modules[module].read_text(), filename=str(modules[module]))
    found = {}
    for node in ast.walk(tree):
        for target in _targets(module, node):
            if target.split(".")[0] != "sits":
                target = target.split(".")[0]
            else:
                while target not in modules:  # `import sits.x.y` of a name: its module
                    target = target.rsplit(".", 1)[0]
            found.setdefault(target, Import(module, target, node.lineno))
    return tuple(found.values())


def package_of(module: str) -> str:
    """The package of a module: sits.layers.moe -> layers, sits.demo -> demo, torch -> torch."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sits" and len(parts) > 1 else parts[0]


def _is_exception(imp: Import) -> bool:
    return any(
        (row["module"], row["imports"]) == (imp.importer, imp.target) for row in TABLE["exceptions"]
    )


@cache
def sits_edges() -> tuple[Import, ...]:
    """Every import from one sits module to another, the table's exceptions left out."""
    return tuple(
        imp
        for module in source_files()
        for imp in imports_of(module)
        if imp.target.startswith("sits") and not _is_exception(imp)
    )


def _ancestors(module: str) -> list[str]:
    """The packages Python runs before `module` ("sits", "sits.layers" for sits.layers.moe)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach_chain(start: str, goal: set[str]) -> list[Import] | None:
    """The shortest chain of imports from module `start` to a module or library whose package
    is in `goal`, through sits modules (and the packages each import runs); None if none."""
    queue, seen, parent = [start], {start}, {}
    while queue:
        module = queue.pop(0)
        for imp in imports_of(module):
            if _is_exception(imp):
                continue
            if package_of(imp.target) in goal:
                chain = [imp]
                while chain[0].importer != start:
                    chain.insert(0, parent[chain[0].importer])
                return chain
            for nxt in [*_ancestors(imp.target), imp.target]:
                if nxt in source_files() and nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = imp
                    queue.append(nxt)
    return None


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module) for module in source_files()} | {"sits"}
    assert sorted(packages - LAYERS.keys()) == []
    assert sorted(LAYERS.keys() - packages) == []


def test_no_package_imports_a_higher_layer() -> None:
    upward = [
        f"{imp.where}: {imp.importer} (L{LAYERS[package_of(imp.importer)]} "
        f"{package_of(imp.importer)}) imports {imp.target} (L{LAYERS[package_of(imp.target)]} "
        f"{package_of(imp.target)})"
        for imp in sits_edges()
        if LAYERS[package_of(imp.target)] > LAYERS[package_of(imp.importer)]
    ]
    assert not upward, "\n" + "\n".join(upward)


def test_no_import_circle_between_packages() -> None:
    edges: dict[tuple[str, str], Import] = {}
    for imp in sits_edges():
        pair = (package_of(imp.importer), package_of(imp.target))
        if pair[0] != pair[1]:
            edges.setdefault(pair, imp)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def path(a: str, b: str, seen: set[str]) -> list[str] | None:
        if a == b:
            return [b]
        for nxt in sorted(graph.get(a, ())):
            if nxt not in seen:
                seen.add(nxt)
                rest = path(nxt, b, seen)
                if rest is not None:
                    return [a, *rest]
        return None

    circles = []
    for (a, b), imp in sorted(edges.items()):
        back = path(b, a, {b})
        if back is not None:
            steps = [edges[pair].where for pair in zip(back, back[1:])]
            circles.append(f"{imp.where}: {a} -> {' -> '.join(back)} (back: {', '.join(steps)})")
    assert not circles, "\n" + "\n".join(circles)


def test_forbidden_imports() -> None:
    broken = []
    for rule in TABLE["forbidden"]:
        assert set(rule["from"]) <= LAYERS.keys() | source_files().keys(), rule["from"]
        for module in source_files():
            if package_of(module) not in rule["from"] and module not in rule["from"]:
                continue
            chain = reach_chain(module, set(rule["imports"]))
            if chain is not None:
                hops = " -> ".join(f"{imp.target} ({imp.where})" for imp in chain)
                rule_name = f"{', '.join(rule['from'])} never import {', '.join(rule['imports'])}"
                broken.append(f"{module} -> {hops}: breaks '{rule_name}' ({rule['why']})")
    assert not broken, "\n" + "\n".join(broken)


def test_model_families_do_not_import_each_other() -> None:
    families = set(TABLE["model_families"]["modules"])
    assert families <= source_files().keys()
    crossing = [
        f"{imp.where}: {imp.importer} imports {imp.target}"
        for family in sorted(families)
        for imp in imports_of(family)
        if imp.target in families
    ]
    assert not crossing, "\n" + "\n".join(crossing)


def test_environment_is_read_in_config_only() -> None:
    reads = []
    for module, path in source_files().items():
        if module == "sits.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_os_attr = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "environb", "putenv", "unsetenv")
            )
            is_from_os = isinstance(node, ast.ImportFrom) and node.module == "os"
            if is_os_attr or is_from_os:
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not reads, "\n" + "\n".join(reads)


def test_the_architecture_page_shows_the_table() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("## Layers", 1)[1].split("```")[1]
    shown = {}
    for line in block.strip().splitlines():
        match = re.match(r"L(\d+) (\S+(?:, \S+)*)\s{2,}", line)
        assert match, f"not a layer row: {line!r}"
        shown.update({name: int(match[1]) for name in match[2].split(", ")})
    assert shown == LAYERS


def test_the_walker_sees_lazy_relative_and_indirect_imports() -> None:
    """The checks above only hold if function-level, `from .` and indirect imports are found."""
    lazy = {imp.target: imp.lineno for imp in imports_of("sits.demo")}
    assert "sits.testing.tiny" in lazy  # imported inside `_build_random_demo`
    relative = ast.parse("from . import moe\nfrom ..core import errors\n").body
    assert [_resolve("sits.layers.moe_stats", node) for node in relative] == [
        "sits.layers",
        "sits.core",
    ]
    assert _resolve("sits.layers", relative[0]) == "sits.layers"
    assert list(_targets("sits.layers.moe_stats", relative[0])) == ["sits.layers.moe"]
    assert list(_targets("sits.layers.moe_stats", relative[1])) == ["sits.core.errors"]
    chain = reach_chain("sits.demo", {"torch"})  # demo -> testing.tiny -> torch
    assert [imp.target for imp in chain] == ["sits.testing.tiny", "torch"]
