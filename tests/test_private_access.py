"""No module reaches into another's internals: in router/, worker/ and common/, an attribute
access `X._name` (X not `self`, `cls` or `super()`) names something its own module defines.

Rule
- `_name` counts as defined by a module when that module has a function or class of that name
  (at any depth), binds it at module or class level (an assignment, an annotated field, an import
  alias), or assigns it on `self` / `cls` (`self._name = ...`). So a class may read the private
  state of another instance of itself, or of a helper class of its own file; a module may not
  read (or write) the private state of an object whose class lives elsewhere: it asks for a public
  name or an operation of that class instead (issue 46: `AsyncEngine` edited the scheduler's
  queues and limit, and read `engine._aborted`; the TP engine replaced an engine's `__dict__`).
- Dunder names (`__dict__`, `__code__`) are not private; nor are namedtuple's documented
  _replace, _asdict, _fields and _make. But X.__dict__.update(...) (X not self/cls) rewrites
  another object's whole state: it counts as a reach too.
- The same holds for imports: `from pkg.mod import _name` of a first-party module (router,
  worker, common) reaches into that module's internals.
- Limits: a name the module also defines for itself is not checked where another object's is
  read (other._x passes when the module has its own _x); the rule holds between modules.

A deliberate exception is listed in ALLOWED (ALLOWED_IMPORTS), keyed by (file, the expression as
written) ((file, "module._name")), with its reason; an entry that matches nothing fails the test,
so the lists cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "worker", "common")
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make"})

TORCH_PRIVATE = "torch's CPU/FP8 matmul kernel has no public name"
COMPILE_CHECK = (
    "compile_check compiles the Triton kernels themselves (their jitted functions); their names "
    "are the kernel names of the GPU profiles (docs/data/gpu)"
)
GLOO_OPTIONS = "torch.distributed's ProcessGroupGloo options: no public constructor or setter"

# (file, expression): why it may reach into something its module does not define.
ALLOWED: dict[tuple[str, str], str] = {
    ("common/structured.py", "os._exit"): "os._exit is the documented exit without cleanup",
    ("worker/model/quant.py", "torch._weight_int8pack_mm"): TORCH_PRIVATE,
    ("worker/model/quant.py", "torch._weight_int4pack_mm_for_cpu"): TORCH_PRIVATE,
    ("worker/model/quant.py", "torch._convert_weight_to_int4pack_for_cpu"): TORCH_PRIVATE,
    ("worker/kernels/cpu_quant.py", "torch._convert_weight_to_int4pack_for_cpu"): TORCH_PRIVATE,
    ("worker/model/fp8.py", "torch._scaled_mm"): TORCH_PRIVATE,
    ("worker/kernels/cpu_layers.py", "module._buffers"): (
        "torch.nn.Module's buffer dict, read to swap a buffer without register_buffer's checks"
    ),
    ("worker/tp/group.py", "ProcessGroupGloo._Options"): GLOO_OPTIONS,
    ("worker/tp/group.py", "opts._timeout"): GLOO_OPTIONS + " (NCCL's and Gloo's join timeout)",
    ("worker/tp/group.py", "opts._devices"): GLOO_OPTIONS,
    ("worker/kernels/compile_check.py", "triton_attention_kernels._paged_attention_kernel"): COMPILE_CHECK,
    ("worker/kernels/compile_check.py", "triton_store_kv._store_kv_kernel"): COMPILE_CHECK,
}

TRITON_SIBLINGS = (
    "Triton kernel modules of worker/kernels share @triton.jit helpers and argument checks with "
    "their siblings (one kernel package; a public kernel-helper module is a later refactor)"
)
# (importing file, "module._name"): why it may import another module's private name.
ATTENTION_KERNELS = "worker.kernels.triton_attention_kernels"
ALLOWED_IMPORTS: dict[tuple[str, str], str] = {
    ("worker/kernels/triton_attention.py", f"{ATTENTION_KERNELS}._paged_attention_kernel"): TRITON_SIBLINGS,
    ("worker/kernels/triton_attention.py", f"{ATTENTION_KERNELS}._merge_splits_kernel"): TRITON_SIBLINGS,
    ("worker/kernels/triton_fp8_gemm.py", "worker.kernels.triton_gemv._check"): TRITON_SIBLINGS,
    ("worker/kernels/triton_fp8_gemm.py", "worker.kernels.triton_gemv._pow2"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_norm._check_rope_args"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_norm._rope_cos_sin"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_norm._rope_halves"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_norm._rope_rotate"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_store_kv._check_store_args"): TRITON_SIBLINGS,
    ("worker/kernels/triton_rope_kv.py", "worker.kernels.triton_store_kv._store_heads"): TRITON_SIBLINGS,
}


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.Module) -> set[str]:
    """The names a module defines (see the module docstring)."""
    names: set[str] = set()

    def bind(target: ast.expr, scope_level: bool) -> None:
        if isinstance(target, ast.Name) and scope_level:
            names.add(target.id)
        elif isinstance(target, ast.Attribute) and _is_self(target.value):
            names.add(target.attr)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                bind(elt, scope_level)
        elif isinstance(target, ast.Starred):
            bind(target.value, scope_level)

    def visit(node: ast.AST, scope_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    bind(target, scope_level)
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                bind(child.target, scope_level)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and scope_level:
                names.update((a.asname or a.name).split(".")[0] for a in child.names)
            inner = isinstance(child, ast.ClassDef) or (
                scope_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            )
            visit(child, inner)

    visit(tree, True)
    return names


def private_accesses(path: Path) -> list[tuple[int, str]]:
    """(line, expression) of each `X._name` in `path` whose `_name` its module does not define."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        state = node.value
        if node.attr == "update" and isinstance(state, ast.Attribute) and state.attr == "__dict__":
            if not _is_self(state.value):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
            continue
        if not _private(node.attr) or _is_self(node.value):
            continue
        if node.attr in own or node.attr in NAMEDTUPLE_API:
            continue
        found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [(line, expr) for line, _, expr in sorted(found)]


def private_imports(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """(line, "module._name") of each `from <first-party module> import _name` in `path` (a module
    of `package`, by default the one its place in the repository names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if package is None:
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = ".".join(p for p in (base, module) if p)
        if module.split(".")[0] not in PACKAGES:
            continue
        found += [(node.lineno, f"{module}.{a.name}") for a in node.names if _private(a.name)]
    return found


def _unlisted(scan, allowed: dict[tuple[str, str], str]) -> tuple[list[str], list[tuple[str, str]]]:
    """What `scan(path)` finds in router/, worker/ and common/ outside `allowed`, and the entries of
    `allowed` nothing matched."""
    offending, used = [], set()
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for line, expr in scan(path):
                if (rel, expr) in allowed:
                    used.add((rel, expr))
                else:
                    offending.append(f"{rel}:{line}: {expr}")
    return offending, sorted(set(allowed) - used)


def test_no_module_imports_another_modules_privates():
    offending, stale = _unlisted(private_imports, ALLOWED_IMPORTS)
    assert not offending, "private names imported from another module:\n" + "\n".join(offending)
    assert not stale, f"ALLOWED_IMPORTS entries that match nothing any more: {stale}"


def test_no_module_reaches_into_another_modules_privates():
    offending, stale = _unlisted(private_accesses, ALLOWED)
    assert not offending, "private attributes reached from another module:\n" + "\n".join(offending)
    assert not stale, f"ALLOWED entries that match nothing any more: {stale}"


def test_the_scan_sees_a_reach_and_not_a_class_reading_its_own_kind(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import other\n"
        "class Bucket:\n"
        "    def __init__(self):\n"
        "        self._level = 0\n"
        "    def merge(self, peer: 'Bucket'):\n"
        "        peer._level = self._level\n"
        "        super()._hook()\n"
        "def f(engine, t, fresh):\n"
        "    t._replace(a=1)\n"
        "    engine.__dict__.update(fresh.__dict__)\n"
        "    return other._secret, engine._aborted, f.__name__\n"
    )
    assert private_accesses(source) == [
        (10, "engine.__dict__.update"),
        (11, "other._secret"),
        (11, "engine._aborted"),
    ]


def test_the_import_scan_sees_a_first_party_private_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from worker.kernels.triton_norm import _rope_halves, rms_norm\n"
        "from .triton_gemv import _check\n"
        "from torch._C import _nn\n"
    )
    assert private_imports(probe, package="worker.kernels") == [
        (1, "worker.kernels.triton_norm._rope_halves"),
        (2, "worker.kernels.triton_gemv._check"),
    ]
