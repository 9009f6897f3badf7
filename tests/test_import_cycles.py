"""No import circles among the first-party modules (issue 46: features behind extension points).

The graph: one node per module of router, worker, common, benchmarks, loadtest, deploy, devtools
and fuzz (protos/ is generated code and tests/ is not imported by anything); an edge A -> B when a
statement in A's source imports B. Read statically, with tests/test_layering.py's AST walk:

- module-level imports AND imports inside functions are edges. A lazy (function-level) import that
  only dodges a circle at import time is still a circle of concepts: the two modules cannot be
  understood, tested or replaced apart, and the lazy import is the workaround, not the fix.
- `if TYPE_CHECKING:` blocks are skipped (annotations only; nothing runs them).
- the edge goes to the module the statement names: `import a.b.c` -> a.b.c, `from a.b import c`
  -> a.b.c when c is a submodule, else a.b. The parent packages Python loads on the way (a, a.b)
  are not edges: loading a package's __init__ first is how Python works, not a dependency.

The test prints every circle it finds, shortest first (one shortest circle per strongly connected
group of modules, then the group's other members), so a failure names the imports to cut.
"""

from __future__ import annotations

import ast
from collections import deque

import pytest

from tests.test_layering import _statements, modules_of, source_file

PACKAGES = ("router", "worker", "common", "benchmarks", "loadtest", "deploy", "devtools", "fuzz")


def _longest_module(dotted: str) -> str:
    """`import a.b.c`: the longest prefix of a.b.c that is a module of ours ("" if none)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if source_file(".".join(parts[:i])):
            return ".".join(parts[:i])
    return ""


def edges_of(module: str) -> set[str]:
    """The first-party modules `module`'s import statements name (see the module docstring)."""
    path = source_file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), filename=str(path)), functions=True):
        if isinstance(node, ast.Import):
            found.update(_longest_module(alias.name) for alias in node.names)
            continue
        base = package
        for _ in range(node.level - 1 if node.level else 0):
            base = base.rpartition(".")[0]
        full = ".".join(p for p in (base, node.module) if p) if node.level else node.module or ""
        for alias in node.names:
            sub = f"{full}.{alias.name}"
            found.add(sub if source_file(sub) else full)
    return {m for m in found if m and m != module and source_file(m) and m.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    return {m: edges_of(m) for p in PACKAGES for m in modules_of(p)}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def shortest_cycle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """The shortest circle through the modules of `group` (BFS from each member, inside it)."""
    members = set(group)
    best: list[str] = []
    for start in group:
        parent: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in graph[node] and (not best or len(parent_path(parent, node)) < len(best)):
                best = parent_path(parent, node)
                break
            for child in sorted(graph[node] & members):
                if child not in parent:
                    parent[child] = node
                    queue.append(child)
    return best


def parent_path(parent: dict[str, str | None], node: str) -> list[str]:
    path = [node]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return path[::-1]


def describe(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for group in strongly_connected(graph):
        cycle = shortest_cycle(graph, group)
        others = sorted(set(group) - set(cycle))
        found.append((len(cycle), " -> ".join([*cycle, cycle[0]]) + (f" (with {others})" if others else "")))
    return [text for _, text in sorted(found)]


def test_the_graph_covers_every_package():
    graph = import_graph()
    for package in PACKAGES:
        assert any(m.split(".")[0] == package for m in graph), package
    # a function-level import is an edge: TPAsyncEngine.from_config imports the runner lazily
    assert "worker.tp.runner" in graph["worker.tp.engine"], graph["worker.tp.engine"]


def test_function_level_imports_count_and_type_checking_ones_do_not():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from worker import engine\n"
        "def f():\n    from worker.async_engine import AsyncEngine\n"
    )
    found = [n.module for n in _statements(ast.parse(source), functions=True)]
    assert found == ["typing", "worker.async_engine"]


def test_the_cycle_finder_reports_the_shortest_circle_first():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"b"}, "f": set()}
    assert describe(graph) == ["a -> b -> a (with ['c', 'd'])"]
    assert describe({"a": {"b"}, "b": {"c"}, "c": {"a"}, "x": {"y"}, "y": {"x"}}) == [
        "x -> y -> x",
        "a -> b -> c -> a",
    ]


def test_no_import_cycles():
    cycles = describe(import_graph())
    print("\n".join(cycles))
    assert not cycles, f"{len(cycles)} import circle(s), shortest first:\n" + "\n".join(cycles)


def test_async_engine_leaves_the_tensor_parallel_engine_to_its_caller():
    """The first circle's fix: AsyncEngine no longer builds its subclass; worker/server.py picks
    worker.tp.engine.TPAsyncEngine, and a TP config given to AsyncEngine is refused, not served by
    one rank (the refusal comes before any model is loaded)."""
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig

    with pytest.raises(ValueError, match="TPAsyncEngine"):
        AsyncEngine.from_config(EngineConfig(kv_cache_bytes=2**20, tensor_parallel_size=2))
