"""Import layering: the router and the shared code never load torch, and the router never loads
worker code.

Rules
- torch-free: worker.scheduler, worker.block_manager, worker.sequence (the engine's pure-Python
  core, tested and benchmarked without a model), every router.* module and every common.* module.
  "torch" here also covers transformers and accelerate, which import torch when they load.
- worker-free: every router.* module (the router is deployed without the engine).

Two checks, because each sees what the other misses:
- static: every import statement of those modules, at module level and inside functions (a lazy
  import, which an import-time check never runs), followed transitively through the first-party
  modules they load, read from their source files: of a module outside the rules only what
  importing it runs (module and class bodies, not functions, whose imports run only if called).
  `if TYPE_CHECKING:` blocks are skipped. It cannot see inside third-party packages.
- runtime: one subprocess per group imports every module of the group and checks sys.modules,
  which catches a third-party package that pulls torch in.

A deliberate exception would be listed in ALLOWED with its reason (there is none now); an entry
no import uses any more fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH = ("torch", "transformers", "accelerate")
WORKER_CORE = ("worker.scheduler", "worker.block_manager", "worker.sequence")

# (importer, imported): why a router -> worker import is allowed. Only the worker-free rule skips
# it (with the parent packages the import loads); the torch rule still follows it. None today: the
# loopback launcher that needed worker.config moved out of the router, to devtools/local.py.
ALLOWED: dict[tuple[str, str], str] = {}


def is_torch(module: str) -> bool:
    return module.split(".")[0] in TORCH


def is_worker(module: str) -> bool:
    return module.split(".")[0] == "worker"


def allowed(importer: str, imported: str) -> bool:
    """An ALLOWED import, or a parent package it loads on the way."""
    return any(importer == a and (imported == b or b.startswith(imported + ".")) for a, b in ALLOWED)


def modules_of(package: str) -> list[str]:
    root = REPO / package
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def source_file(module: str) -> Path | None:
    """The file of a first-party module (a package's __init__.py), None for anything else."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST, functions: bool):
    """The import statements under `node`, except inside `if TYPE_CHECKING:` bodies and, unless
    `functions`, inside function bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for orelse in child.orelse:
                yield from _statements(ast.Module(body=[orelse], type_ignores=[]), functions)
            continue
        if not functions and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _statements(child, functions)


@functools.cache
def imports_of(module: str, functions: bool = True) -> tuple[str, ...]:
    """The modules `module`'s import statements load (with `functions=False`, only those importing
    it runs): each named module, its parent packages, and for `from pkg import name` the submodule
    pkg.name when it is one of ours."""
    path = source_file(module)
    if path is None:
        return ()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for node in _statements(ast.parse(path.read_text(), filename=str(path)), functions):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package
            for _ in range(node.level - 1 if node.level else 0):
                base = base.rpartition(".")[0]
            if node.level:
                full = ".".join(p for p in (base, node.module) if p)
            else:
                full = node.module or ""
            targets = [full] + [
                f"{full}.{alias.name}" for alias in node.names if source_file(f"{full}.{alias.name}")
            ]
        for target in targets:
            parts = target.split(".")
            found += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return tuple(dict.fromkeys(m for m in found if m and m != module))


def reachable(start: str, skip=lambda importer, imported: False) -> dict[str, str | None]:
    """Every module `start` can load, following first-party modules (all imports of a module the
    rules cover, the import-time ones of any other), each mapped to the module that imports it
    (for the chain in a failure message)."""
    parent: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        module = todo.pop()
        for imported in imports_of(module, functions=module in CHECKED):
            if imported not in parent and not skip(module, imported):
                parent[imported] = module
                todo.append(imported)
    return parent


def chain(parent: dict[str, str | None], module: str) -> str:
    path = [module]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return " -> ".join(reversed(path))


ROUTER = modules_of("router")
COMMON = modules_of("common")
CHECKED = {*WORKER_CORE, *ROUTER, *COMMON}


def test_the_module_lists_are_not_empty():
    assert len(ROUTER) >= 20 and "router.service" in ROUTER and "router" in ROUTER, ROUTER
    assert len(COMMON) >= 10 and "common.tokenizer" in COMMON, COMMON
    assert all(source_file(m) for m in WORKER_CORE)


@pytest.mark.parametrize("module", [*WORKER_CORE, *ROUTER, *COMMON])
def test_never_imports_torch_statically(module):
    parent = reachable(module)
    bad = [chain(parent, m) for m in parent if is_torch(m)]
    assert not bad, f"{module} can import torch: " + "; ".join(bad)


@pytest.mark.parametrize("module", ROUTER)
def test_router_never_imports_worker_statically(module):
    parent = reachable(module, skip=allowed)
    bad = [chain(parent, m) for m in parent if is_worker(m)]
    assert not bad, f"{module} can import worker code: " + "; ".join(bad)


def test_allowed_exceptions_are_still_used():
    for importer, imported in ALLOWED:
        assert imported in imports_of(importer), f"stale ALLOWED entry: {importer} -> {imported}"


RUNTIME_CHECK = """
import importlib, sys
modules, forbidden = sys.argv[1].split(","), tuple(sys.argv[2].split(","))
for name in modules:
    importlib.import_module(name)
    bad = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    if bad:
        sys.exit(f"importing {name} loaded {bad[:5]}")
"""


@pytest.mark.parametrize(
    "group, modules, forbidden",
    [
        ("worker core", WORKER_CORE, TORCH),
        ("common", COMMON, TORCH),
        ("router", ROUTER, (*TORCH, "worker")),
    ],
)
def test_group_imports_without_torch_at_runtime(group, modules, forbidden):
    out = subprocess.run(
        [sys.executable, "-c", RUNTIME_CHECK, ",".join(modules), ",".join(forbidden)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"{group}: {out.stderr.strip()[-2000:]}"


@pytest.mark.parametrize("module", [*ROUTER, *COMMON, *modules_of("worker"), *modules_of("deploy")])
def test_production_code_never_imports_devtools(module):
    """devtools/ (the loopback launcher, the test OTLP sink, the CLI client) is not deployed."""
    bad = [m for m in imports_of(module) if m.split(".")[0] == "devtools"]
    assert not bad, f"{module} imports {bad}"
