"""Import layering ratchet: no new cycle, no new import against the layer order or inside a function.

Layers, lowest first (a module may import its own layer and the layers below it)::

    core (autoshard/*.py but the front doors, autoshard.models)
      → kernels
        → search  |  passes → runtime
          → API / CLI (``API_MODULES``)

``search`` and ``passes``/``runtime`` are parallel: neither side imports the other.

The graph is read from the source with ``ast`` (nothing is imported: about a second of CPU):
every ``import`` / ``from ... import`` of an ``autoshard`` module, at module level
(``"module"``), inside a function (``"function"``) or under ``if TYPE_CHECKING:`` (``"type"``).
Importing ``autoshard.a.b.c`` first runs ``autoshard/a/__init__`` and ``autoshard/a/b/__init__``,
so each import also adds an edge to those enclosing subpackages (``passes/__init__`` imports every
pass, so importing one pass runs them all). The root ``autoshard/__init__`` gets no such
edge: it is a facade over the core types, and counting it would join every module into one
component; its one upward import (the lazy ``compile``) is listed in ``KNOWN_VIOLATIONS``.

Cycles are the strongly connected components of the executed imports (``"module"`` and
``"function"``; a ``"type"`` import never runs). The layer rule checks every kind.

Imports inside functions (outside the front doors, ``API_MODULES``, which import lazily for start-up)
are listed with the dependency each keeps off an import path (``KNOWN_LAZY``).

The allowlists are the state when this test was written, spelled out: a new cycle, a component
that grows, or a new upward edge fails. When a cycle or violation goes away the test fails too,
with the smaller set to write down, so the lists only shrink.
"""

from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent
ROOT = "autoshard"

API_MODULES = frozenset(
    f"{ROOT}.{name}"
    for name in ("__main__", "api", "calibrate", "calibrate_probe", "check", "cli", "cli_args", "cli_ppo", "cli_search",
                 "demo", "report", "report_html", "report_model", "rl")
)
# layer → the layers it may import (itself included)
MAY_IMPORT = {
    "core": {"core"},
    "kernels": {"core", "kernels"},
    "search": {"core", "kernels", "search"},
    "passes": {"core", "kernels", "passes"},
    "runtime": {"core", "kernels", "passes", "runtime"},
    "api": {"core", "kernels", "search", "passes", "runtime", "api"},
}

KNOWN_CYCLES: set[frozenset[str]] = set()

KNOWN_VIOLATIONS = {
    ("autoshard", "autoshard.api"),  # the facade's lazy `autoshard.compile`
}

# Imports inside functions, outside the front doors (``API_MODULES`` import lazily so that `autoshard --help`
# and `inspect` start without torch): each keeps a heavy or optional dependency off an import path.
KNOWN_LAZY = {
    ("autoshard", "autoshard.api"): "the facade's `autoshard.compile`: torch and the whole pipeline",
    ("autoshard.cluster", "autoshard.cluster_detect"): "detecting the machine reads torch; the cluster types stay torch-free",
    ("autoshard.kernels.ops", "autoshard.kernels.triton_kernels"): "triton, optional",
    ("autoshard.runtime", "autoshard.runtime.program"): "the package's lazy names: importing any runtime module "
                                                         "would otherwise build the program stack (passes, export)",
}


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Module name → (source file, is a package ``__init__``), from pyproject's ``package-dir``."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    modules: dict[str, tuple[Path, bool]] = {}
    for package, folder in package_dir.items():
        nested = {Path(f) for p, f in package_dir.items() if p != package and p.startswith(package + ".")}
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder)
            if any((REPO / folder / rel).is_relative_to(REPO / n) for n in nested):
                continue
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *parts[:-1]] if is_package else [package, *parts])
            modules[name] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[tuple[str, ...]]:
    """Per imported name, the dotted names it may load, most specific first (``from p import x``: ``p.x``, ``p``)."""
    if isinstance(node, ast.Import):
        return [(alias.name,) for alias in node.names]
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    return [(f"{source}.{alias.name}", source) for alias in node.names]


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[tuple[str, ...], str]]:
    """(candidate dotted names, kind) of every imported name in ``tree``; kind is "module", "function" or "type"."""
    found: list[tuple[tuple[str, ...], str]] = []

    def visit(block: list[ast.stmt], kind: str) -> None:
        # imports are statements: walk statement blocks only, never into expressions
        for stmt in block:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.extend((names, kind) for names in _imported_names(stmt, module, is_package))
            elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
                visit(stmt.body, "type")
                visit(stmt.orelse, kind)
            else:
                is_function = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                inner = "function" if is_function and kind == "module" else kind
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for item in getattr(stmt, field, ()):
                        visit(item.body if isinstance(item, (ast.ExceptHandler, ast.match_case)) else [item], inner)

    visit(tree.body, "module")
    return found


_STRENGTH = {"module": 0, "function": 1, "type": 2}  # an edge keeps its strongest kind


@functools.cache
def import_graph() -> nx.DiGraph:
    """Module → module edges with ``kind`` and ``explicit`` (False: only an enclosing package, module docstring)."""
    modules = package_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, (path, is_package) in modules.items():
        for names, kind in _imports(ast.parse(path.read_text(), str(path)), module, is_package):
            if names[-1] != ROOT and not names[-1].startswith(ROOT + "."):
                continue
            target = next((name for name in names if name in modules), names[-1])
            while target not in modules:
                target = target.rsplit(".", 1)[0]
            parts = target.split(".")
            packages = (".".join(parts[:i]) for i in range(2, len(parts)))
            enclosing = [p for p in packages if not module.startswith(p + ".")]  # not the importer's own
            for dest, explicit in ((target, True), *((p, False) for p in enclosing)):
                if dest == module:
                    continue
                old = graph.edges[module, dest] if graph.has_edge(module, dest) else {"kind": "type", "explicit": False}
                graph.add_edge(module, dest, kind=min(old["kind"], kind, key=_STRENGTH.__getitem__),
                               explicit=old["explicit"] or explicit)
    return graph


def layer(module: str) -> str:
    """The layer of ``module`` (module docstring)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("kernels", "search", "passes", "runtime"):
        return parts[1]
    return "api" if module in API_MODULES else "core"


def import_cycles(graph: nx.DiGraph) -> set[frozenset[str]]:
    """Strongly connected components (more than one module) of the imports that run."""
    executed = graph.edge_subgraph([(a, b) for a, b, kind in graph.edges(data="kind") if kind != "type"])
    return {frozenset(c) for c in nx.strongly_connected_components(executed) if len(c) > 1}


def layer_violations(graph: nx.DiGraph) -> set[tuple[str, str]]:
    """Explicit imports of a module in a layer that the importer's layer may not import."""
    explicit = [(a, b) for a, b, is_explicit in graph.edges(data="explicit") if is_explicit]
    return {(a, b) for a, b in explicit if layer(b) not in MAY_IMPORT[layer(a)]}


def _ratchet_message(what: str, new: list, gone: list) -> str:
    lines = [f"{what} differ from the allowlist in tests/test_import_layers.py."]
    if new:
        lines.append("New (break the cycle or import from the layer the code belongs to):")
        lines += [f"  {item}" for item in new]
    if gone:
        lines.append("Gone or smaller (good: write the current set into the allowlist):")
        lines += [f"  {item}" for item in gone]
    return "\n".join(lines)


def test_module_names_resolve():
    modules = package_modules()
    assert {"autoshard", "autoshard.plan", "autoshard.passes", "autoshard.runtime.tasks.sorting",
            "autoshard.kernels.ops", "autoshard.search.solver"} <= set(modules)
    kinds = dict(((a, b), k) for a, b, k in import_graph().edges(data="kind"))
    assert kinds[("autoshard.plan", "autoshard.errors")] == "module"
    assert kinds[("autoshard.runtime", "autoshard.runtime.program")] == "function"  # the lazy __getattr__
    assert kinds[("autoshard.cluster_io", "autoshard.cluster")] == "type"  # under `if TYPE_CHECKING:`
    assert kinds[("autoshard.passes.insert_collectives", "autoshard.kernels")] == "module"  # enclosing package
    assert ("autoshard.plan", "autoshard") not in kinds  # the root facade gets no implicit edge


def test_ratchet_catches_a_new_cycle_and_edge():
    graph = import_graph().copy()
    graph.add_edge("autoshard.errors", "autoshard.file_io", kind="function", explicit=True)
    graph.add_edge("autoshard.file_io", "autoshard.errors", kind="module", explicit=True)
    graph.add_edge("autoshard.kernels.ops", "autoshard.search.solver", kind="type", explicit=True)
    assert frozenset({"autoshard.errors", "autoshard.file_io"}) in import_cycles(graph) - KNOWN_CYCLES
    assert layer_violations(graph) - KNOWN_VIOLATIONS == {("autoshard.kernels.ops", "autoshard.search.solver")}


def _one_loop(graph: nx.DiGraph, component: frozenset[str]) -> str:
    """One import loop inside ``component``: each module with the kind of its import of the next (where to cut)."""
    loop = nx.find_cycle(graph.subgraph(component).edge_subgraph(
        [(a, b) for a, b, kind in graph.subgraph(component).edges(data="kind") if kind != "type"]))
    return " -> ".join(f"{a} ({graph.edges[a, b]['kind']})" for a, b in loop) + f" -> {loop[0][0]}"


def test_no_new_import_cycle():
    graph = import_graph()
    cycles = import_cycles(graph)
    new = [f"{sorted(c)}\n    e.g. {_one_loop(graph, c)}"
           for c in cycles if not any(c <= known for known in KNOWN_CYCLES)]
    smaller = [sorted(c) for c in cycles - KNOWN_CYCLES if any(c <= known for known in KNOWN_CYCLES)]
    gone = [sorted(k) for k in KNOWN_CYCLES - cycles]
    assert not new and not gone, _ratchet_message("Import cycles", new, gone + [f"now: {c}" for c in smaller])


def test_function_level_imports_only_known():
    """An import inside a function hides an edge from a reader; outside the front doors only ``KNOWN_LAZY`` may."""
    graph = import_graph()
    lazy = {(a, b) for a, b, data in graph.edges(data=True)
            if data["kind"] == "function" and data["explicit"] and a not in API_MODULES}
    new = sorted(lazy - set(KNOWN_LAZY))
    gone = sorted(set(KNOWN_LAZY) - lazy)
    assert not new and not gone, _ratchet_message("Imports inside functions", new, gone)


def test_layer_order_violations_only_known():
    violations = layer_violations(import_graph())
    new = sorted(violations - KNOWN_VIOLATIONS)
    gone = sorted(KNOWN_VIOLATIONS - violations)
    assert not new and not gone, _ratchet_message("Imports against the layer order", new, gone)
