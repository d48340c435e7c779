"""The package's import graph has no cycles, and each layer imports only the layers below it.

Every `import` counts, at module level or inside a function (a lazy import that closes a cycle
is still a cycle: it only moves the failure from start-up to the first call). Edges to a
package's `__init__` that Python makes implicitly (importing `a.b.c` runs `a/__init__` and
`a/b/__init__`) are not counted; an explicit `from a.b import c` is an edge to `a.b.c` when c is
a module and to `a.b` otherwise.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "common", "tokenline", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its own package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` where a.b.c is ours, or the nearest enclosing module that is
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_no_import_cycles_in_services_common_tokenline_and_bench():
    graph = import_graph()
    assert len(graph) > 80  # the walk found the tree, not an empty folder
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_lazy_import_cycle():
    """What the test above relies on: a function-level import back counts."""
    graph = {"a.base": {"a.impl"}, "a.impl": {"a.base"}, "a.user": {"a.base"}}
    assert cycles(graph) == [["a.base", "a.impl"]]
    path = ROOT / "services" / "scheduler" / "attention" / "registry.py"
    edges = imports_of("services.scheduler.attention.registry", path, modules())
    assert "services.scheduler.attention.base" in edges


# The scheduler's rooms, lowest first: a module may import its own room and rooms below it.
SCHEDULER_LAYERS = ["native", "attention", "models", "executor", "core", "service"]


def scheduler_layer(module: str) -> str | None:
    prefix = "services.scheduler."
    if module == "services.scheduler" or not module.startswith(prefix):
        return None
    room = module[len(prefix):].split(".")[0]
    return room if room in SCHEDULER_LAYERS else "service"  # server, spans, process_setup


def test_scheduler_rooms_import_only_rooms_below_them():
    """native <- attention <- models <- executor <- core <- the service (server.py): the engine
    core never reaches up into the NATS service, the models never into the core."""
    rank = {room: i for i, room in enumerate(SCHEDULER_LAYERS)}
    upward = []
    for module, targets in import_graph().items():
        room = scheduler_layer(module)
        if room is None:
            continue
        for target in targets:
            other = scheduler_layer(target)
            if other is not None and rank[other] > rank[room]:
                upward.append(f"{module} ({room}) imports {target} ({other})")
            if target.startswith("services.") and not target.startswith("services.scheduler"):
                upward.append(f"{module} imports another service: {target}")
    assert upward == []


def test_no_service_imports_another_service():
    crossing = []
    for module, targets in import_graph().items():
        if not module.startswith("services."):
            continue
        service = module.split(".")[1]
        for target in targets:
            if target.startswith("services.") and target.split(".")[1] != service:
                crossing.append(f"{module} imports {target}")
    assert crossing == []
