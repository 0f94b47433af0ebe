"""The import graph of ``src/kiln`` against the layer table of docs/design.md.

Every module is parsed with ``ast``; every import counts (module level, inside functions,
under ``if TYPE_CHECKING:``), as docs/design.md ("Layers") says. The checker fails on a
module no row of the table claims, on an import the table does not allow, and on any
cycle. It runs on the real tree and on small planted packages, to show it can fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
ALL = "all"


@dataclass(frozen=True, slots=True)
class Import:
    """One edge of the graph: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    lazy: bool
    type_only: bool


@dataclass(frozen=True, slots=True)
class Layer:
    name: str
    #: Exact module names, and package prefixes (``kiln.store`` for ``kiln.store.*``).
    modules: frozenset[str]
    packages: frozenset[str]
    may_import: frozenset[str]
    imported_by: frozenset[str]


# The modules and their imports ------------------------------------------------------------


def find_modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package at ``package_dir``, by dotted name."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, lazy: bool = False, type_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import under ``node``, with whether it runs later (inside a function) and
    whether only a type checker sees it (under ``if TYPE_CHECKING:``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy, type_only
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
        else:
            yield from _walk(child, lazy, type_only)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` stands for: itself, or the longest known prefix of it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(
    name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> set[str]:
    """The modules of the package an import statement reaches (a name imported from a
    package is its submodule when there is one, else the package itself)."""
    if isinstance(node, ast.Import):
        found = {_known(alias.name, modules) for alias in node.names}
    else:
        base = _from_base(name, path, node)
        found = {
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
            for alias in node.names
        }
    return {target for target in found if target is not None and target != name}


def find_imports(modules: dict[str, Path]) -> list[Import]:
    """Every import between the modules, each statement's target once."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, lazy, type_only in _walk(tree):
            for target in sorted(_targets(name, path, node, modules)):
                edges.append(Import(name, target, node.lineno, lazy, type_only))
    return edges


# The layer table ---------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _names(cell: str) -> frozenset[str]:
    return frozenset(part.strip().strip("`") for part in cell.split(",") if part.strip())


def read_layers(markdown: str) -> dict[str, Layer]:
    """The table of the ``## Layers`` section: one row per layer."""
    section = markdown.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.lower() for cell in _cells(rows[0])]
    layers = {}
    for row in rows[2:]:
        cell = dict(zip(header, _cells(row), strict=True))
        listed = re.findall(r"`([^`]+)`", cell["modules"])
        layers[cell["layer"]] = Layer(
            name=cell["layer"],
            modules=frozenset(m for m in listed if not m.endswith(".*")),
            packages=frozenset(m.removesuffix(".*") for m in listed if m.endswith(".*")),
            may_import=_names(cell["may import"]),
            imported_by=_names(cell["imported by"]),
        )
    return layers


def layer_of(module: str, layers: dict[str, Layer]) -> str | None:
    """The layer whose row names ``module`` exactly, else the one whose package holds it
    (the innermost); None when no row claims it."""
    for layer in layers.values():
        if module in layer.modules:
            return layer.name
    holders = [
        (len(package), layer.name)
        for layer in layers.values()
        for package in layer.packages
        if module == package or module.startswith(package + ".")
    ]
    return max(holders)[1] if holders else None


def allowed(source: str, target: str, layers: dict[str, Layer]) -> bool:
    may = layers[source].may_import
    return source == target or ALL in may or target in may


# The checks --------------------------------------------------------------------------------


def table_problems(layers: dict[str, Layer], package_dir: Path) -> list[str]:
    """Rows that name an unknown layer, a module that is not there, or whose "imported by"
    is not what the other rows' "may import" say."""
    problems = []
    for layer in layers.values():
        for name in layer.may_import - {ALL} - set(layers):
            problems.append(f"layer {layer.name} may import an unknown layer {name!r}")
        expected = {
            other.name for other in layers.values() if allowed(other.name, layer.name, layers)
        }
        if layer.imported_by != expected:
            problems.append(
                f"layer {layer.name}: 'imported by' says {sorted(layer.imported_by)}, the "
                f"'may import' column says {sorted(expected)}"
            )
        for module in layer.modules | layer.packages:
            relative = Path(*module.split(".")[1:])
            where = package_dir / relative
            if not (where.with_suffix(".py").is_file() or where.is_dir()):
                problems.append(f"layer {layer.name} names {module}, which is not in the tree")
    return problems


def layering_problems(
    modules: dict[str, Path], edges: list[Import], layers: dict[str, Layer]
) -> list[str]:
    """Modules no row claims, and imports the table does not allow."""
    problems = [f"{m} is in no layer of the table" for m in modules if not layer_of(m, layers)]
    for edge in edges:
        source, target = layer_of(edge.source, layers), layer_of(edge.target, layers)
        if source and target and not allowed(source, target, layers):
            how = "a type-only" if edge.type_only else "a lazy" if edge.lazy else "an"
            problems.append(
                f"{edge.source}:{edge.line} ({source}) has {how} import of "
                f"{edge.target} ({target}), which layer {source} may not import"
            )
    return problems


def _exempt(edge: Import, modules: dict[str, Path]) -> bool:
    """A package's ``__init__`` importing its own module when called (a backend factory)."""
    return (
        edge.lazy
        and modules[edge.source].name == "__init__.py"
        and edge.target.startswith(edge.source + ".")
    )


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each group of modules that reach each other, with one cycle through the group."""
    reach = {node: _reachable(node, graph) for node in graph}
    groups: list[tuple[list[str], list[str]]] = []
    placed: set[str] = set()
    for node in sorted(graph):
        if node in placed or node not in reach[node]:
            continue
        group = sorted(m for m in reach[node] if node in reach[m])
        placed.update(group)
        groups.append((_cycle_in(group, graph), group))
    return groups


def _cycle_in(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, set()) & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return group  # unreachable for a strongly connected group


def check(package_dir: Path, design: str) -> list[str]:
    """Every problem of the package at ``package_dir`` against the layer table in
    ``design`` (markdown); an empty list when the graph is as the table says."""
    layers = read_layers(design)
    modules = find_modules(package_dir)
    edges = find_imports(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for edge in edges:
        if not _exempt(edge, modules):
            graph[edge.source].add(edge.target)
    cycles = []
    for cycle, group in find_cycles(graph):
        more = (
            f" (a knot of {len(group)}: {', '.join(group)})" if len(group) > len(cycle) - 1 else ""
        )
        cycles.append(f"import cycle: {' -> '.join(cycle)}{more}")
    return [*table_problems(layers, package_dir), *layering_problems(modules, edges, layers),
            *cycles]  # fmt: skip


# The real tree -----------------------------------------------------------------------------


def test_kiln_imports_follow_the_layer_table() -> None:
    # Given the source tree and the layer table of docs/design.md
    # When the import graph is checked against it
    problems = check(ROOT / "src" / "kiln", DESIGN.read_text(encoding="utf-8"))

    # Then every module has a layer, every import is allowed, and nothing is a cycle
    assert problems == []


def test_only_the_faces_import_the_app() -> None:
    # Given every import of the source tree
    modules = find_modules(ROOT / "src" / "kiln")

    # When the importers of kiln.app are listed
    importers = {e.source for e in find_imports(modules) if e.target == "kiln.app"}

    # Then they are the package itself, the command line and the HTTP API
    assert importers
    assert all(m in ("kiln", "kiln.cli") or m.startswith("kiln.api.") for m in importers)


# Planted packages: the checker can fail ------------------------------------------------------

TABLE = """# pkg

## Layers

| layer | modules | holds | may import | imported by |
|---|---|---|---|---|
| low | `pkg.base`, `pkg.more` | the base | low | low, high |
| high | `pkg`, `pkg.top` | the top | all | high |

## After
"""


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` with these modules (name → source)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""pkg."""\n')
    for name, source in files.items():
        (package / f"{name}.py").write_text(source)
    return package


def test_a_planted_package_that_follows_its_table_passes(tmp_path: Path) -> None:
    # Given a package whose high module imports the low ones, lazily and for types too
    package = plant(tmp_path, {
        "base": "X = 1\n",
        "more": "from pkg.base import X\n",
        "top": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import more\n"
               "def f():\n    from pkg.base import X\n    return X\n",
    })  # fmt: skip

    # When it is checked, Then nothing is wrong
    assert check(package, TABLE) == []


@pytest.mark.parametrize(
    ("base", "more"),
    [
        ("from pkg.more import Y\nX = 1\n", "from pkg.base import X\nY = 2\n"),
        ("def f():\n    from pkg import more\n", "from pkg.base import X\n"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.more import Y\n",
            "from pkg.base import X\n",
        ),
    ],
    ids=["module-level", "lazy", "type-only"],
)
def test_a_planted_cycle_fails(tmp_path: Path, base: str, more: str) -> None:
    # Given two modules of one layer that import each other
    package = plant(tmp_path, {"base": base, "more": more, "top": ""})

    # When the package is checked
    problems = check(package, TABLE)

    # Then the cycle is reported
    assert problems == ["import cycle: pkg.base -> pkg.more -> pkg.base"]


def test_a_forbidden_arrow_fails(tmp_path: Path) -> None:
    # Given a low module that imports a high one, inside a function
    package = plant(tmp_path, {
        "base": "def f():\n    from pkg.top import Z\n    return Z\n", "more": "", "top": "Z = 3\n",
    })  # fmt: skip

    # When the package is checked
    problems = check(package, TABLE)

    # Then the arrow is reported with its line
    assert problems == [
        "pkg.base:2 (low) has a lazy import of pkg.top (high), which layer low may not import"
    ]


def test_a_module_in_no_layer_fails(tmp_path: Path) -> None:
    # Given a module the table does not name
    package = plant(tmp_path, {"base": "", "more": "", "top": "", "stray": ""})

    # When the package is checked, Then it is reported
    assert check(package, TABLE) == ["pkg.stray is in no layer of the table"]


def test_a_package_factory_may_import_its_backend_lazily(tmp_path: Path) -> None:
    # Given a subpackage whose __init__ picks a backend when called, and the backend
    # imports the protocol from the subpackage
    package = plant(tmp_path, {"base": "", "more": "", "top": ""})
    sub = package / "sub"
    sub.mkdir()
    (sub / "__init__.py").write_text("class P: ...\ndef open_p():\n    from pkg.sub.fast import F\n"
                                     "    return F()\n")  # fmt: skip
    (sub / "fast.py").write_text("from pkg.sub import P\nclass F(P): ...\n")
    table = TABLE.replace("| low | `pkg.base`,", "| low | `pkg.sub.*`, `pkg.base`,")

    # When it is checked, Then that is no cycle; the same import at module level would be
    assert check(package, table) == []
    (sub / "__init__.py").write_text("from pkg.sub.fast import F\nclass P: ...\n")
    assert check(package, table) == ["import cycle: pkg.sub -> pkg.sub.fast -> pkg.sub"]


def test_an_imported_by_column_that_disagrees_fails(tmp_path: Path) -> None:
    # Given a table whose "imported by" forgets that high may import low
    package = plant(tmp_path, {"base": "", "more": "", "top": ""})
    table = TABLE.replace("| low | low, high |", "| low | low |")

    # When it is checked, Then the row is reported
    assert check(package, table) == [
        "layer low: 'imported by' says ['low'], the 'may import' column says ['high', 'low']"
    ]
