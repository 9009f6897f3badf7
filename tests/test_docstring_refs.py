"""Docstring references: every symbol a docstring cites in backticks exists, and every source file
it names (issue 46).

Docstrings name other code, and the code moves: a class that was never written, or a function cited
in the file it moved out of, is a wrong map. This test reads the module, class and function
docstrings of every first-party Python file (router, worker, common, benchmarks, loadtest, deploy,
devtools, fuzz, tests; not the generated protos/*_pb2*.py) with ast, imports nothing, and checks:

- Source files: a path under one of the repository's directories ending in .py, .cpp, .h,
  .proto, .sh, .md, .yaml or .toml, in the prose or in backticks, names a file that exists.
  Outputs (.json, .png, ...) are not checked: a run writes them; nor are made-up examples, a file
  named with one letter or foo, bar, example (a test's docstring showing a dead link).
- A backticked name after a file in the prose ("worker/kernels/reference.py `sampling_logits`",
  "compile_check.py's `capture_launches`") or inside the backticks (`worker/engine.py LLMEngine`):
  that file defines it (an import is not its home); a C++ or proto file must mention it.
- Any other backticked span that is only code, a dotted name optionally called (`LLMEngine.step`,
  `worker.engine.LLMEngine`, `stop()`, `fused_sample(logits, ...) -> tokens`), is a symbol reference
  when it is CamelCase (`ModelConfig`), starts with one underscore (`_finish`), is written as a
  call, or is dotted with a first part that is code (a name of the file, a first-party package,
  class or module, a builtin). ALL_CAPS and plain snake_case names without a dot or parentheses are
  not: they are environment variables, metric names, constants of other systems and the fields and
  parameters of the protocols (`max_tokens`), which the code need not define. Neither are flags,
  literals, types (`list[int]`), commands or expressions with spaces, nor a dotted name ending in a
  file suffix (`tokenizer.json`), nor one whose first part is a plain word that is also a
  first-party module's name (`tokenizer.ggml.pre`, `client.models.retrieve`: a variable or a key more
  often than the module), unless it resolves in that module.

A reference resolves when it is defined or imported in the same file (any binding there, a
parameter included), or defined anywhere in the first-party code (a function or class, a class
member, a module-level name), a builtin, a message, field, enum value or rpc of
protos/llm/v1/*.proto, or its first part is a third-party module (ALIASES: np, nn, tl). A dotted
path under a first-party package goes through the longest prefix that is a module, then a name
that module defines or imports, then a class member: a method, a class attribute, a dataclass
field or an attribute assigned on self, also through first-party base classes (a class with a
third-party base is open: any member passes). THIRD_PARTY lists the other projects' names the
docstrings cite bare, with where each lives.

A deliberate exception is listed in ALLOWED with its reason; an entry no docstring cites any more
fails the test, as does a THIRD_PARTY name no docstring cites, so neither list can go stale.
Cost: 1.5 to 3 s on 2 vCPUs, most of it ast.parse of the ~390 files.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_DIRS = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
PACKAGES = ("router", "worker", "common", "benchmarks", "loadtest", "deploy", "devtools", "fuzz", "tests")

# (file, backticked text): why a reference that does not resolve stays.
ALLOWED: dict[tuple[str, str], str] = {}

# Names of other projects that docstrings cite bare (the code reaches them through a module
# attribute, or not at all), with where each lives. Checked by hand against the installed
# packages; an entry no docstring cites any more fails the test.
THIRD_PARTY = {
    "_scaled_mm": "torch._scaled_mm",
    "_weight_int4pack_mm_for_cpu": "torch._weight_int4pack_mm_for_cpu",
    "LLMatcher": "llguidance.LLMatcher",
    "JITFunction": "triton.runtime.jit.JITFunction",
    "ByteLevel": "tokenizers.pre_tokenizers.ByteLevel",
    "LlamaForCausalLM": "transformers.LlamaForCausalLM",
    "PeftModel": "peft.PeftModel",
    "FuzzedDataProvider": "atheris.FuzzedDataProvider",
    "ExportTraceServiceRequest": "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    "is_connected": "ray.util.client.ray.is_connected",
    "tojson": "jinja2's tojson filter, in chat templates",
    "_name_or_path": "a key of a Hugging Face config.json",
}
# The conventional import aliases, cited as the modules they stand for (`np.percentile`).
ALIASES = {"np": "numpy", "nn": "torch.nn", "tl": "triton.language"}
# A dotted name ending in one of these is a file name (`tokenizer.json`, `fairness.png`).
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "png", "svg", "csv", "txt", "html", "yaml", "yml", "log"}

NAME = r"[A-Za-z_]\w*"
DOTTED = rf"{NAME}(?:\.{NAME})*"
SPAN = re.compile(r"`([^`]+)`")
# `name`, `a.b.c`, `.method()`, `name(args) -> type`: the text must be code and nothing else.
CODE = re.compile(rf"\.?(?P<name>{DOTTED})(?P<call>\(.*\))?(?:\s*->.*)?", re.S)
# `path/file.py Name`: a name with its file.
PATH_NAME = re.compile(rf"(?P<path>[\w.-]+(?:/[\w.-]+)+\.py)\s+(?P<name>{DOTTED})(?:\(.*\))?", re.S)
# A Python file named in the prose just before a backticked name ("x.py `f`", "x.py's `f`").
QUALIFIER = re.compile(r"(?<![\w/.-])(?P<path>(?:[\w.-]+/)*[\w-]+\.(?:py|cpp|h|proto))(?:'s)?\s+$")
# A path to a source file under one of the repository's directories, in the prose or in backticks.
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w.-]+\.(?:py|cpp|h|proto|sh|md|yaml|toml))(?![\w/-])")
# A made-up file name in an example (`docs/x.md`): not a claim that the file exists.
PLACEHOLDER = re.compile(r"(?:\w|foo|bar|baz|example)\.\w+")
CAMEL = re.compile(r"[A-Z]\w*[a-z]\w*")
# Bases whose members a class's own AST does not show, but that add a known set.
KNOWN_BASES = {
    "object": dir(object),
    "Protocol": [],
    "Generic": [],
    "NamedTuple": [*dir(tuple), "_replace", "_asdict", "_fields", "_make"],
    "Enum": ["name", "value"],
    "IntEnum": ["name", "value", *dir(int)],
    "StrEnum": ["name", "value", *dir(str)],
}


@dataclass
class ClassInfo:
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class Module:
    path: Path
    tree: ast.Module
    package: str
    docstrings: list[tuple[int, str]] = field(default_factory=list)  # (line, text)
    api: set[str] = field(default_factory=set)  # definitions, class members, module-level names
    defined: set[str] = field(default_factory=set)  # every name the file binds, not by import
    imports: dict[str, str] = field(default_factory=dict)  # bound name -> "module" or "module:attr"
    classes: dict[str, ClassInfo] = field(default_factory=dict)


def source_files() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "_pb2" not in path.name and ".venv" not in path.parts
    ]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST):
    """The names (name, False) and self/cls attributes (name, True) an assignment target binds."""
    if isinstance(node, ast.Name):
        yield node.id, False
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id in ("self", "cls"):
            yield node.attr, True
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _docstring(node) -> tuple[int, str] | None:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].lineno, body[0].value.value
    return None


def _scan(mod: Module, body: list[ast.stmt], owner: ClassInfo | None, in_class: bool, top: bool) -> None:
    """Records what the statements bind, their classes, imports and docstrings. Statements only
    (a name bound inside an expression, a comprehension or walrus variable, is not recorded):
    a third of the nodes to visit."""
    for node in body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            mod.api.add(node.name)
            if (doc := _docstring(node)) is not None:
                mod.docstrings.append(doc)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                if arg is not None:
                    mod.defined.add(arg.arg)
            if in_class:
                owner.members.add(node.name)
            _scan(mod, node.body, owner, False, False)
        elif isinstance(node, ast.ClassDef):
            info = ClassInfo(bases=[ast.unparse(b).split("[")[0] for b in node.bases])
            mod.classes.setdefault(node.name, info)
            if in_class:
                owner.members.add(node.name)
            _scan(mod, node.body, info, True, False)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name, is_attr in _targets(target):
                    if (is_attr or in_class) and owner is not None:
                        owner.members.add(name)
                        mod.api.add(name)
                    elif top:
                        mod.api.add(name)
                    names.append(name)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            names += [name for name, _ in _targets(node.target)]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    names += [name for name, _ in _targets(item.optional_vars)]
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names += node.names
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    mod.imports[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    mod.imports[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = mod.package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            full = ".".join(p for p in (base, node.module) if p) if node.level else node.module or ""
            for alias in node.names:
                mod.imports[alias.asname or alias.name] = f"{full}:{alias.name}"
        mod.defined.update(names)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for attr in ("body", "orelse", "finalbody"):
                inner = getattr(node, attr, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    _scan(mod, inner, owner, in_class, top)
            for handler in getattr(node, "handlers", ()):
                if handler.name:
                    mod.defined.add(handler.name)
                _scan(mod, handler.body, owner, in_class, top)
            for case in getattr(node, "cases", ()):
                _scan(mod, case.body, owner, in_class, top)


def parse(path: Path, text: str | None = None) -> Module:
    text = path.read_text() if text is None else text
    tree = ast.parse(text, filename=str(path))
    name = module_name(path)
    mod = Module(path, tree, package=name if path.name == "__init__.py" else name.rpartition(".")[0])
    if (doc := _docstring(tree)) is not None:
        mod.docstrings.append(doc)
    _scan(mod, tree.body, None, False, True)
    return mod


@functools.cache
def project() -> Project:
    return Project({module_name(p): parse(p) for p in source_files()})


class Project:
    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.by_file = {m.path: m for m in modules.values()}
        self.api = set().union(*(m.api for m in modules.values()))
        self.classes: dict[str, list[ClassInfo]] = {}
        for m in modules.values():
            for name, info in m.classes.items():
                self.classes.setdefault(name, []).append(info)
        self.basenames: dict[str, list[Module]] = {}
        for name, m in modules.items():
            self.basenames.setdefault(name.rpartition(".")[2], []).append(m)
        self.protos = set()
        for proto in (REPO / "protos").rglob("*.proto"):
            text = re.sub(r"//.*", "", proto.read_text())
            self.protos.update(re.findall(r"\b(?:message|enum|service|rpc)\s+(\w+)", text))
            self.protos.update(re.findall(r"(\w+)\s*=\s*\d+\s*[;\[]", text))

    # Members -----------------------------------------------------------------------------

    def has_member(self, classes: list[ClassInfo], member: str, seen: frozenset = frozenset()) -> bool:
        for info in classes:
            if member in info.members:
                return True
            for base in info.bases:
                short = base.rpartition(".")[2]
                if short in KNOWN_BASES:
                    if member in KNOWN_BASES[short]:
                        return True
                elif short in self.classes and short not in seen:
                    if self.has_member(self.classes[short], member, seen | {short}):
                        return True
                elif hasattr(builtins, short) and isinstance(getattr(builtins, short), type):
                    if hasattr(getattr(builtins, short), member):
                        return True
                else:
                    return True  # a third-party base: its members are not ours to list
        return False

    def resolve_in(self, mod: Module, parts: list[str], *, home: bool = False) -> str | None:
        """None when `parts` (a dotted name) resolves in `mod`, else why not. With `home`, the
        first part must be defined there (an import is not a home)."""
        head, rest = parts[0], parts[1:]
        if head in mod.classes:
            return self.resolve_members(mod.classes[head], head, rest)
        if head in mod.defined:
            return None
        if head in mod.imports and not home:
            return self.resolve_import(mod.imports[head], rest)
        where = "defines" if home else "defines or imports"
        return f"{mod.path.relative_to(REPO)} {where} no {head}"

    def resolve_members(self, info: ClassInfo, owner: str, rest: list[str]) -> str | None:
        if rest and not self.has_member([info], rest[0]):
            return f"class {owner} has no member {rest[0]}"
        return None

    def resolve_import(self, target: str, rest: list[str]) -> str | None:
        module, _, attr = target.partition(":")
        dotted = [*module.split("."), *([attr] if attr else []), *rest]
        if dotted[0] in PACKAGES:
            return self.resolve_dotted(dotted)
        return None  # a third-party module or name: passes without importing it

    def resolve_dotted(self, parts: list[str]) -> str | None:
        """A dotted path from a first-party package."""
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in self.modules:
                if n == len(parts):
                    return None
                rest = parts[n:]
                if rest[0] in self.modules[name].imports:  # a re-export
                    return self.resolve_import(self.modules[name].imports[rest[0]], rest[1:])
                return self.resolve_in(self.modules[name], rest)
        return f"no module {parts[0]}"

    # A reference --------------------------------------------------------------------------

    def plain_module_word(self, mod: Module, head: str) -> bool:
        """A first part that only names a first-party module by its last part, and is a plain
        word (no underscore): `tokenizer`, `client`, `runner`. `triton_norm` is the module."""
        return "_" not in head and head in self.basenames and not self.is_local(mod, head)

    def is_local(self, mod: Module, head: str) -> bool:
        return (
            head in mod.defined
            or head in mod.imports
            or head in PACKAGES
            or head in self.classes
            or head in ("self", "cls")
        )

    def knows(self, mod: Module, head: str) -> bool:
        """Whether a dotted name's first part is something code: then the name is a reference."""
        return self.is_local(mod, head) or head in self.basenames or hasattr(builtins, head)

    def resolve(self, mod: Module, dotted: str) -> str | None:
        parts = dotted.split(".")
        head = parts[0]
        if head in ("self", "cls"):
            if len(parts) == 1 or any(self.has_member([c], parts[1]) for c in mod.classes.values()):
                return None
            return f"no class in {mod.path.relative_to(REPO)} has a member {parts[1]}"
        if head in mod.defined or head in mod.imports:
            return self.resolve_in(mod, parts)
        if head in PACKAGES:
            return self.resolve_dotted(parts)
        if head in self.classes:
            if len(parts) == 1 or self.has_member(self.classes[head], parts[1]):
                return None
            if head in self.protos and parts[1] in self.protos:
                return None  # a service's rpc (`Worker.GetLoad`)
            return f"class {head} has no member {parts[1]}"
        if head in self.basenames and len(parts) > 1:
            errors = [self.resolve_in(m, parts[1:]) for m in self.basenames[head]]
            return None if None in errors else f"module {head}: {errors[0]}"
        if head in self.api or head in self.protos:
            return None
        if hasattr(builtins, head):
            obj = getattr(builtins, head)
            for part in parts[1:]:
                if not hasattr(obj, part):
                    return f"builtin {head} has no attribute {part}"
                obj = getattr(obj, part)
            return None
        if head in ALIASES or head in sys.stdlib_module_names or importlib.util.find_spec(head):
            return None
        return f"nothing defines {head}"

    def resolve_home(self, mod: Module, qualifier: str, dotted: str) -> str | None:
        """`dotted` cited in the file `qualifier` (a path from the repository root, from this
        file's directory, or a file name that only one first-party file has)."""
        if not qualifier.endswith(".py"):  # C++ or a proto: the name occurs in it
            for base in (REPO, mod.path.parent):
                if (base / qualifier).is_file():
                    words = set(re.findall(r"\w+", (base / qualifier).read_text()))
                    missing = [p for p in dotted.split(".") if p not in words]
                    return f"{qualifier} never mentions {missing[0]}" if missing else None
            return f"no file {qualifier}" if "/" in qualifier else None
        for base in (REPO, mod.path.parent):
            target = self.by_file.get((base / qualifier).resolve())
            if target is not None:
                break
        else:
            same = self.basenames.get(Path(qualifier).stem, [])
            if "/" in qualifier or len(same) != 1:
                if "/" in qualifier and not (REPO / qualifier).is_file():
                    return f"no file {qualifier}"
                return None  # not a first-party module we read (a script elsewhere, ambiguous)
            target = same[0]
        why = self.resolve_in(target, dotted.split("."), home=True)
        return None if why is None else f"{qualifier} is not its home: {why}"


@dataclass(frozen=True)
class Ref:
    file: str
    line: int
    text: str
    problem: str | None


def check_span(proj: Project, mod: Module, text: str, before: str) -> str | None | bool:
    """None: a reference that resolves; a string: one that does not, and why; False: not a
    reference."""
    path = PATH_NAME.fullmatch(text.strip())
    if path:
        return proj.resolve_home(mod, path["path"], path["name"])
    code = CODE.fullmatch(text)
    if not code:
        return False
    dotted, call = code["name"], code["call"]
    qualifier = QUALIFIER.search(before[-200:])
    if qualifier:
        return proj.resolve_home(mod, qualifier["path"], dotted)
    head = dotted.split(".")[0]
    if dotted.startswith("__") and dotted.endswith("__"):
        return False
    if "." in dotted and dotted.rpartition(".")[2] in FILE_SUFFIXES:
        return False
    if head in THIRD_PARTY:
        return None
    if "." in dotted and proj.plain_module_word(mod, head):
        # `tokenizer.ggml.pre`, `client.models.retrieve`: a variable or a key more often than
        # the module of that name; a reference only when it resolves there.
        return None if proj.resolve(mod, dotted) is None else False
    is_ref = (
        ("." in dotted and proj.knows(mod, head))
        or CAMEL.fullmatch(head) is not None
        or (head.startswith("_") and not head.startswith("__"))
        or call is not None
    )
    if not is_ref:
        return False
    return proj.resolve(mod, dotted)


def doc_refs(proj: Project, mod: Module, lineno: int, doc: str) -> list[Ref]:
    """The references of one docstring (starting at line `lineno`): its backticked symbol
    references and the source files it names."""
    rel = str(mod.path.relative_to(REPO))
    found = []
    for match in SPAN.finditer(doc):
        result = check_span(proj, mod, match[1], doc[: match.start()])
        if result is not False:
            found.append(Ref(rel, lineno + doc.count("\n", 0, match.start()), match[1], result))
    for match in SOURCE_PATH.finditer(doc):
        path = match[1]
        if path.split("/")[0] in TOP_DIRS and not PLACEHOLDER.fullmatch(path.rpartition("/")[2]):
            problem = None if (REPO / path).is_file() else f"no file {path}"
            found.append(Ref(rel, lineno + doc.count("\n", 0, match.start()), path, problem))
    return found


@functools.cache
def all_references() -> tuple[Ref, ...]:
    proj = project()
    return tuple(
        ref
        for path in source_files()
        for lineno, doc in proj.by_file[path].docstrings
        for ref in doc_refs(proj, proj.by_file[path], lineno, doc)
    )


def test_every_cited_symbol_exists():
    refs = all_references()
    bad = [r for r in refs if r.problem is not None and (r.file, r.text) not in ALLOWED]
    assert not bad, f"{len(bad)} of {len(refs)} docstring references do not resolve:\n" + "\n".join(
        f"  {r.file}:{r.line}: `{r.text}`: {r.problem}" for r in bad
    )


def test_allowed_exceptions_are_still_used():
    unresolved = {(r.file, r.text) for r in all_references() if r.problem is not None}
    stale = [key for key in ALLOWED if key not in unresolved]
    assert not stale, f"stale ALLOWED entries (they resolve now, or nothing cites them): {stale}"


def test_third_party_names_are_still_cited():
    heads = {CODE.fullmatch(r.text)["name"].split(".")[0] for r in all_references() if CODE.fullmatch(r.text)}
    stale = sorted(set(THIRD_PARTY) - heads)
    assert not stale, f"THIRD_PARTY names no docstring cites any more: {stale}"


def test_the_scan_sees_the_code():
    refs = all_references()
    files = {r.file for r in refs}
    assert len(refs) > 1000 and len(files) > 150, (len(refs), len(files))
    assert {"worker/engine.py", "router/service.py", "worker/kernels/triton_sampling.py"} <= files


def _classify(doc: str, source: str = "") -> dict[str, str | None | bool]:
    """Each backticked span and source path of `doc`, written as the docstring of a made-up
    module in worker/ with `source` as its body: None (a reference that resolves), why it does
    not, or False (not a reference)."""
    proj = project()
    mod = parse(REPO / "worker" / "probe.py", f'"""{doc}"""\n{source}')
    found: dict[str, str | None | bool] = {m[1]: False for m in SPAN.finditer(doc)}
    found.update({ref.text: ref.problem for ref in doc_refs(proj, mod, 1, doc)})
    return found


def test_the_rule_separates_references_from_prose():
    found = _classify(
        '`--max-tokens`, `llm_requests_total`, `LLM_WORKER_TOKEN`, `"stop"`, `42`, `max_tokens`,'
        " `make test`, `list[int]`, `x @ W.T + b`, `tokenizer.ggml.pre`, `[S, V]`, `__main__`,"
        ' `fairness.png`, `MAX_TOKENS`, `python -m router --port 0`, `{"type": "text"}`,'
        " docs/x.md, `worker/example.py`"
    )
    assert all(v is False for v in found.values()), found


def test_the_rule_checks_references():
    source = "class Local:\n    x: int = 0\n\n    def go(self):\n        self.y = 1\n"
    ok = (
        "`Local`, `Local.go()`, `Local.y`, `worker.engine.LLMEngine`, `LLMEngine.step`, `None`,"
        " `str.split`, `reference_fused_sample()`, `triton_norm.rms_norm`, `Worker.GetLoad`,"
        " worker/config.py `EngineConfig`, worker/kernels/reference.py `sampling_logits`,"
        " `worker/config.py`, docs/metrics.md, `worker/engine.py LLMEngine.step`,"
        " worker/kernels/cpu_layers.cpp `lora_add`, `_scaled_mm`"
    )
    found = _classify(ok, source)
    assert all(v is None for v in found.values()), {k: v for k, v in found.items() if v is not None}
    assert {"Local.go()", "sampling_logits", "lora_add", "docs/metrics.md"} <= set(found), found
    bad = (
        "`CacheLayout`, `Local.nope`, `worker.engine.NoSuchThing`, `no_such_function()`,"
        " `_no_such_private`, worker/sampler.py `sampling_logits`, `LLMEngine.no_such_method`,"
        " `str.no_such`, `triton_norm.no_such`, worker/no_such_file.py, `worker/engine.py Nope`,"
        " worker/kernels/cpu_layers.cpp `no_such_op`, tests/test_decode_pool.py, docs/xy.md"
    )
    found = _classify(bad, source)
    paths = {"worker/sampler.py", "worker/kernels/cpu_layers.cpp", "worker/engine.py"}  # exist
    assert all(isinstance(v, str) for k, v in found.items() if k not in paths), found
    assert len(found) == 14 + len(paths), found
