"""The dependency rule, enforced: every import between dlo_fn and lab modules, at module level or inside a
function (and every ``importlib.import_module("...")`` literal), points down the layering and closes no circle.

The library (``dlo_fn``), which never imports the lab:

    plan     -> plan                                    (the plan the runtime executes)
    cost     -> cost, plan                              (the analytic models: never the runtime)
    models   -> models, plan
    io       -> io, plan, models                        (checkpoints to modules, memory readings)
    runtime  -> runtime, plan, cost, io                 (never the reference model)
    serve    -> serve, plan, cost, models, io, runtime
    cli      -> the library

The lab (``benchmarks``), which reads the library:

    repro    -> repro, plan, cost, models
    figures  -> figures, plan, cost, repro, models      (never runtime, serve, cli)
    bench, cli, the lab's own modules -> anything; dlo_fn.cli only for HelpFormatter, build_parser and main

The runtime core (every runtime module outside the plug-in package ``dlo_fn.runtime.cuda``) never imports the
plug-ins; only ``dlo_fn.runtime.offload`` resolves options into them. The plug-ins import the core.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dlo_fn"
LAB = ROOT / "benchmarks"

LIBRARY = ("plan", "cost", "models", "io", "runtime", "serve", "cli")
LAYERS = tuple(f"dlo_fn.{name}" for name in LIBRARY) + tuple(
    f"benchmarks.{name}" for name in ("repro", "figures", "bench", "cli")
)
_LIB = {f"dlo_fn.{name}" for name in LIBRARY}
ALLOWED: dict[str, frozenset[str]] = {
    "dlo_fn.plan": frozenset({"dlo_fn.plan"}),
    "dlo_fn.cost": frozenset({"dlo_fn.cost", "dlo_fn.plan"}),
    "dlo_fn.models": frozenset({"dlo_fn.models", "dlo_fn.plan"}),
    "dlo_fn.io": frozenset({"dlo_fn.io", "dlo_fn.plan", "dlo_fn.models"}),
    "dlo_fn.runtime": frozenset({"dlo_fn.runtime", "dlo_fn.plan", "dlo_fn.cost", "dlo_fn.io"}),
    "dlo_fn.serve": frozenset(_LIB - {"dlo_fn.cli"}),
    "dlo_fn.cli": frozenset(_LIB),
    "benchmarks.repro": frozenset({"benchmarks.repro", "dlo_fn.plan", "dlo_fn.cost", "dlo_fn.models"}),
    "benchmarks.figures": frozenset(
        {"benchmarks.figures", "benchmarks.repro", "dlo_fn.plan", "dlo_fn.cost", "dlo_fn.models"}
    ),
    "benchmarks.bench": frozenset({*LAYERS, "benchmarks"}),  # dlo_fn.cli: LAB_FROM_CLI only, checked below
    "benchmarks.cli": frozenset({*LAYERS, "benchmarks"}),
    "benchmarks": frozenset({*LAYERS, "benchmarks"}),  # the lab's own modules (measure, walkthrough, __main__)
}
LAB_FROM_CLI = frozenset({"HelpFormatter", "build_parser", "main", "entry"})
PLUGINS = "dlo_fn.runtime.cuda"
PLUGIN_RESOLVER = "dlo_fn.runtime.offload"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported dlo_fn module, dotted
    names: tuple[str, ...]  # names taken with ``from target import ...``; () for ``import target``
    line: int

    def __str__(self) -> str:
        names = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.source}:{self.line} -> {self.target}{names}"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for folder in (PACKAGE, LAB) for p in sorted(folder.rglob("*.py"))}


MODULES = _modules()


def _resolve(base: str, name: str | None) -> str:
    """``from base import name``: the submodule when ``name`` is one, else the package ``base``."""
    if name is not None and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    return base


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _is_import_module(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name == "import_module" and bool(call.args)


def edges_of(module: str) -> list[Edge]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Edge] = []

    def add(target: str, names: tuple[str, ...], line: int) -> None:
        if target.split(".")[0] in ("dlo_fn", "benchmarks"):
            # A dotted name that is not a module is an attribute of the longest module prefix.
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            found.append(Edge(module, target, names, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for alias in node.names:
                add(_resolve(base, alias.name), (alias.name,), node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(arg.value, (), node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            # A literal module name (a table handed to import_module, a ``-m`` target) is an arrow too.
            if node.value not in ("dlo_fn", "benchmarks"):
                add(node.value, (), node.lineno)
    return list(dict.fromkeys(found))


EDGES = [e for m in MODULES for e in edges_of(m)]


def layer_of(module: str) -> str | None:
    """``dlo_fn.plan.layout`` -> ``dlo_fn.plan``; a lab module outside its subpackages -> ``benchmarks``; the
    library's root package and ``__main__`` belong to no layer."""
    parts = module.split(".")
    if len(parts) > 1 and ".".join(parts[:2]) in LAYERS:
        return ".".join(parts[:2])
    return "benchmarks" if parts[0] == "benchmarks" else None


def violations(edges: list[Edge]) -> list[str]:
    bad = []
    for edge in edges:
        source, target = layer_of(edge.source), layer_of(edge.target)
        if source is None:
            # The root package imports nothing; __main__ is the CLI's entry point and imports only the CLI.
            if edge.source != "dlo_fn.__main__" or target != "dlo_fn.cli":
                bad.append(f"{edge}: the root package imports nothing, __main__ only dlo_fn.cli")
        elif source.startswith("dlo_fn") and edge.target.startswith("benchmarks"):
            bad.append(f"{edge}: nothing in dlo_fn imports the lab (benchmarks)")
        elif target is None:
            if edge.target != "dlo_fn":
                bad.append(f"{edge}: nothing imports __main__")
        elif target not in ALLOWED[source]:
            bad.append(f"{edge}: {source} may import only {', '.join(sorted(ALLOWED[source]))}")
        elif (
            source == "dlo_fn.runtime"
            and edge.source != PLUGIN_RESOLVER
            and not _in_plugins(edge.source)
            and _in_plugins(edge.target)
        ):
            bad.append(f"{edge}: the runtime core never imports its plug-ins ({PLUGINS}); offload resolves them")
        elif (
            source.startswith("benchmarks")
            and target == "dlo_fn.cli"
            and not (edge.target == "dlo_fn.cli" and edge.names and set(edge.names) <= LAB_FROM_CLI)
        ):
            bad.append(f"{edge}: the lab takes only {', '.join(sorted(LAB_FROM_CLI))} from dlo_fn.cli")
    return bad


def _in_plugins(module: str) -> bool:
    return module == PLUGINS or module.startswith(PLUGINS + ".")


def cycles(modules: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.target != e.source:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_every_subpackage_has_a_layer():
    subpackages = {
        f"{folder.name}.{p.name}" for folder in (PACKAGE, LAB) for p in folder.iterdir() if (p / "__init__.py").exists()
    }
    assert subpackages == set(LAYERS)


def test_the_parser_sees_every_kind_of_arrow():
    # One known arrow of each kind, so a parser that stops seeing them fails here rather than passing below.
    def targets(source: str) -> set[str]:
        return {e.target for e in EDGES if e.source == source}

    assert "benchmarks.figures.timeline" in targets("benchmarks.figures")  # a module-name table for import_module
    assert targets("dlo_fn.__main__") == {"dlo_fn.cli"}  # module level
    assert "dlo_fn.models.specs" in targets("benchmarks.repro.timeline_tables")  # inside a function
    assert {"dlo_fn.cost.hbm", "dlo_fn.cost.memory"} <= targets("benchmarks.repro.deployment")  # from pkg import mod
    assert "dlo_fn.models" in targets("benchmarks.repro.b300")  # from pkg import name: the package
    assert len(EDGES) > 200


def test_every_import_points_down_the_layering():
    bad = violations(EDGES)
    assert not bad, "imports against the layering (see this file's docstring):\n" + "\n".join(bad)


def test_no_import_circles():
    found = cycles(list(MODULES), EDGES)
    lines = []
    for component in found:
        inside = set(component)
        arrows = [str(e) for e in EDGES if e.source in inside and e.target in inside and e.source != e.target]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(arrows))
    assert not found, "import circles:\n" + "\n".join(lines)


def test_planted_violations_are_caught(tmp_path, monkeypatch):
    # Module level, function level and import_module arrows in a planted figures module; a circle; bench.
    source = (
        "import dlo_fn.plan.layout\n"
        "def late():\n"
        "    from dlo_fn.runtime.platform import platform_for\n"
        "    import importlib\n"
        "    importlib.import_module('dlo_fn.cli.demo')\n"
    )
    path = tmp_path / "benchmarks" / "figures" / "planted.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    planted = {**MODULES, "benchmarks.figures.planted": path}
    monkeypatch.setitem(globals(), "MODULES", planted)
    edges = edges_of("benchmarks.figures.planted")
    assert {e.target for e in edges} == {"dlo_fn.plan.layout", "dlo_fn.runtime.platform", "dlo_fn.cli.demo"}
    assert [b.split(":")[0] for b in violations(edges)] == ["benchmarks.figures.planted"] * 2
    circle = [Edge("dlo_fn.plan.a", "dlo_fn.plan.b", (), 1), Edge("dlo_fn.plan.b", "dlo_fn.plan.a", (), 1)]
    assert cycles(["dlo_fn.plan.a", "dlo_fn.plan.b", "dlo_fn.plan.c"], circle) == [["dlo_fn.plan.a", "dlo_fn.plan.b"]]
    bench = [
        Edge("benchmarks.bench.x", "dlo_fn.cli", ("HelpFormatter",), 1),
        Edge("benchmarks.bench.x", "dlo_fn.cli.demo", ("main",), 2),
    ]
    assert len(violations(bench)) == 1
    library = [
        Edge("dlo_fn.cli.policy", "benchmarks.repro.topologies", (), 1),  # the library never imports the lab
        Edge("dlo_fn.plan.layout", "dlo_fn.cost.memory", (), 2),  # the plan imports only the plan
        Edge("dlo_fn.cost.policy", "dlo_fn.runtime.probe", (), 3),  # the analytic models never the runtime
        Edge("dlo_fn.runtime.mesh", "dlo_fn.models.sp", (), 4),  # the runtime never the reference model
    ]
    assert [b.split(":")[0] for b in violations(library)] == [e.source for e in library]
    plugins = [
        Edge("dlo_fn.runtime.executor", "dlo_fn.runtime.cuda.block_graph", ("BlockGraphs",), 1),
        Edge("dlo_fn.runtime.offload", "dlo_fn.runtime.cuda", ("plugins_for",), 2),
        Edge("dlo_fn.runtime.cuda.block_graph", "dlo_fn.runtime.cuda.capture", (), 3),
        Edge("dlo_fn.serve.engine", "dlo_fn.runtime.cuda", (), 4),
    ]
    assert [b.split(":")[0] for b in violations(plugins)] == ["dlo_fn.runtime.executor"]


def test_the_runtime_core_stays_small():
    # The core (runtime outside its plug-in package) is read in one sitting: the executor, its program and its
    # issue loop in particular. Counted in the formatter's layout (ruff format).
    lines = {
        m: len(p.read_text().splitlines())
        for m, p in MODULES.items()
        if m.startswith("dlo_fn.runtime") and not _in_plugins(m)
    }
    assert lines["dlo_fn.runtime.executor"] <= 400
    assert sum(lines.values()) < 4000, sum(lines.values())
