"""Structured outputs, the torch-free half (the router's, and the worker's import): an OpenAI
`response_format` -> an llguidance grammar, validated before admission.

Contract
- input: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": {...}}}`,
  or this server's `{"type": "regex", "regex": "..."}`, `{"type": "choice", "choice": [str, ...]}`
  (the output is one of the strings) and `{"type": "grammar", "grammar": "..."}` (a Lark grammar
  in llguidance's dialect, or a GBNF one, llama.cpp's, told apart by its `::=` rules).
- `after_thinking(grammar, opened, open_id, close_id)`: a reasoning model's form of a grammar:
  free text up to the `</think>` token (required when the model's template opens the think
  block, else optional), whitespace, then the grammar's language (vLLM's structured output with a
  reasoning parser).
- output: `grammar_for(...)` -> the llguidance grammar (JSON text) the worker runs
  (worker/grammar.py); ValueError naming the problem (a schema llguidance cannot compile, an
  unknown type, more than MAX_GRAMMAR_BYTES).
- Stack: llguidance's grammar compiler recurses once per level of a grammar (a chain of rules, of
  `$ref`s); a deep one at the size limit overflows a default 8 MB thread stack, which kills the
  process (SIGSEGV, not an exception). Grammars are compiled, and matchers built and run, on
  threads with DEEP_STACK_BYTES of stack: `start_deep(thread)` (the worker's engine threads) and
  `compile_executor()` (the router's: off its event loop, too).
- `grammar_of(kind, value)`: `grammar_for` of a format as the router carries it (router/validation.py:
  the kind and its text); `compile_task(task)` and `serve_compiles()`: the router's grammar-compile
  child processes (router/grammar_compile.py: a wall-clock budget, a cache, a share per tenant), which
  run either on a DEEP_STACK_BYTES thread, at a lower CPU priority than the router, and exit when
  the router does.
- state: the router's compile thread. failure modes: ValueError as above; `available()` says why
  not where llguidance is not installed.
- proven by: tests/test_structured_output.py, tests/test_grammar_budget.py (the child processes).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import re
import sys
import threading

try:
    import llguidance
except ImportError:  # the GPU machine's image, say: constrained requests are refused with a reason
    llguidance = None

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema larger than this is refused before any compile work
# The compiled form's bound, the same in router and worker (worker/grammar.py): a regex at
# MAX_GRAMMAR_BYTES can grow 6x in llguidance's JSON (control characters as \u escapes)
MAX_COMPILED_GRAMMAR_BYTES = 4 * MAX_GRAMMAR_BYTES
MAX_GBNF_RULES = 500  # llguidance's GBNF conversion is quadratic in the rules (3,000: 2.4 s)
# Thread stack for compiling grammars and running matchers: a chain of ~5,000 rules (the size limit)
# needs well over 8 MB; this is address space, not memory (pages are touched only as used).
DEEP_STACK_BYTES = 512 * 2**20


MEMORY_ENV = "LLM_GRAMMAR_COMPILE_MEMORY_BYTES"  # a compile child's memory budget (router/grammar_compile.py)
_STACK_SIZE = threading.Lock()  # threading's stack size is process-wide: one setter at a time


def start_deep(thread: threading.Thread) -> None:
    """`thread.start()` with DEEP_STACK_BYTES of stack (the size applies when a thread starts)."""
    with _STACK_SIZE:
        old = threading.stack_size(DEEP_STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(old)


@functools.cache
def compile_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The router's one grammar-compiling thread, started with DEEP_STACK_BYTES of stack."""
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
    with _STACK_SIZE:
        old = threading.stack_size(DEEP_STACK_BYTES)
        try:
            executor.submit(int).result()  # its one thread starts here, with that stack
        finally:
            threading.stack_size(old)
    return executor


def available() -> str | None:
    """None when constrained decoding can run here, else why not."""
    return None if llguidance is not None else "the llguidance package is not installed"


def grammar_for(response_format: dict) -> str:
    """An OpenAI `response_format` (`{"type": "json_object"}`, `{"type": "json_schema",
    "json_schema": {"schema": {...}}}`, or this server's `{"type": "regex", "regex": "..."}`) as an
    llguidance grammar, validated (ValueError with the reason otherwise)."""
    if llguidance is None:
        raise ValueError(f"constrained decoding is unavailable: {available()}")
    kind = response_format.get("type")
    if kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema: required, a JSON Schema object")
        try:
            text = json.dumps(schema)
        except RecursionError:  # nested deeper than the interpreter's stack (the parse got through)
            raise ValueError("json_schema.schema: nested too deeply") from None
        if len(text) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"json_schema.schema: {len(text)} bytes, more than {MAX_GRAMMAR_BYTES}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(_text(response_format, "regex"))
    elif kind == "choice":
        grammar = llguidance.LLMatcher.grammar_from_lark(_choice_lark(response_format.get("choice")))
    elif kind == "grammar":
        grammar = llguidance.LLMatcher.grammar_from_lark(_lark(_text(response_format, "grammar")))
    else:
        raise ValueError(
            f"type: must be text, json_object, json_schema, regex, choice or grammar, got {kind!r}"
        )
    if len(grammar) > MAX_COMPILED_GRAMMAR_BYTES:  # the worker would refuse it after admission
        raise ValueError(f"{len(grammar)} bytes once compiled, more than {MAX_COMPILED_GRAMMAR_BYTES}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(problem)
    return grammar


def grammar_of(kind: str, value: str) -> str:
    """One format as router/validation.py carries it: the request's kind and its text (a
    json_schema's JSON, a choice's options as a JSON list, "" for json_object) -> `grammar_for`."""
    if kind == "json_object":
        return grammar_for({"type": "json_object"})
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("is not valid JSON") from None
        return grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})
    if kind == "choice":
        return grammar_for({"type": "choice", "choice": json.loads(value)})
    return grammar_for({"type": kind, kind: value})  # regex, grammar


def _text(response_format: dict, key: str) -> str:
    value = response_format.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{key}: required, a non-empty string of at most {MAX_GRAMMAR_BYTES} bytes")
    return value


def _choice_lark(options) -> str:
    """`start: "a" | "b" ...`: the output is exactly one of the strings (JSON escapes in the literals)."""
    if not (isinstance(options, list) and options and all(isinstance(o, str) and o for o in options)):
        raise ValueError("choice: required, a non-empty list of non-empty strings")
    literals = " | ".join(json.dumps(o) for o in options)
    if len(literals) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"choice: {len(literals)} bytes, more than {MAX_GRAMMAR_BYTES}")
    return f"start: {literals}\n"


_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)


def _lark(grammar: str) -> str:
    """A Lark grammar as is; a GBNF one (llama.cpp's `root ::= ...`) converted by llguidance. GBNF
    is told by a line that starts with a rule (`name ::=`), not by "::=" anywhere: a Lark grammar
    may have it in a literal, a regex or a comment."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    rules = grammar.count("::=")
    if rules > MAX_GBNF_RULES:
        raise ValueError(f"GBNF: {rules} rules, more than {MAX_GBNF_RULES}")
    try:
        return gbnf_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - its errors are plain Exceptions, IndexError, RecursionError...
        raise ValueError(f"GBNF: {exc}") from None


# The think block's text: anything but a spelled-out "</think>" (the block ends with the token);
# then at most 8 whitespace characters ("\n\n" after R1's block; unbounded, a model could write
# whitespace until max_tokens).
_THOUGHT = "THOUGHT: /(?s:.*)/ & ~/(?s:.*<\\/think>.*)/\nws: /[ \\t\\n]{0,8}/\n"


@functools.lru_cache(maxsize=64)
def after_thinking(grammar: str, opened: bool, open_id: int, close_id: int) -> str:
    """`grammar` (as `grammar_for` returns it: llguidance's JSON form or Lark text) preceded by a
    think block: its answer is the same language once the `</think>` token (`close_id`) is
    written. With `opened` (the template opens the block: the answer starts inside it) the block
    is required, else optional and opened by the model (the `<think>` token, `open_id`). The
    tokens are named by id: llguidance takes `<...>` added tokens for special ones, which no text
    matches."""
    is_json = grammar.lstrip().startswith("{")
    top = json.loads(grammar) if is_json else {"grammars": [{"lark_grammar": grammar}]}
    answer = {**top["grammars"][0], "name": "answer"}
    block = f"THOUGHT <[{close_id}]> ws"
    start = f"start: {block} @answer\n" if opened else f"start: (<[{open_id}]> {block})? @answer\n"
    wrapper = {"name": "think_then_answer", "lark_grammar": start + _THOUGHT}
    wrapped = json.dumps({**top, "grammars": [wrapper, answer, *top["grammars"][1:]]}, ensure_ascii=False)
    problem = llguidance.LLMatcher.validate_grammar(wrapped)
    if problem:
        raise ValueError(problem)
    return wrapped


def compile_task(task: list) -> str:
    """One compile as router/grammar_compile.py sends it: `["format", kind, value]` (`grammar_of`)
    or `["think", grammar, opened, open_id, close_id]` (`after_thinking`)."""
    if task[0] == "format":
        return grammar_of(str(task[1]), str(task[2]))
    if task[0] == "think":
        return after_thinking(str(task[1]), bool(task[2]), int(task[3]), int(task[4]))
    raise ValueError(f"unknown compile task {task[0]!r}")


def _compile_reply(task: list) -> dict:
    try:
        return {"ok": compile_task(task)}
    except ValueError as exc:
        return {"error": str(exc)}
    except RecursionError:
        return {"error": "nested too deeply"}
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - llguidance's panics are BaseExceptions
        return {"internal": f"{type(exc).__name__}: {exc}"[:2000]}


def serve_compiles() -> None:
    """A grammar-compile child's main (router/grammar_compile.py): one JSON task a line on stdin,
    one JSON reply a line on stdout (`{"ok": grammar}`, `{"error": why}` or `{"internal": ...}`),
    after a first `{"ready": true}`. Compiles run on a DEEP_STACK_BYTES thread; the child runs at a
    lower CPU priority than the router (nice 10) and exits when stdin closes or the router is gone
    (a compile in progress holds no stdin read: a watchdog thread checks the parent)."""
    out = os.fdopen(os.dup(1), "wb")  # the replies' channel; stray prints go to stderr instead
    os.dup2(2, 1)
    try:
        os.nice(10)
    except OSError:
        pass  # not allowed here: the same priority as the router, then
    parent = os.getppid()

    def watchdog() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(0)

    def serve() -> None:
        _cap_memory(int(os.environ.get(MEMORY_ENV) or 0))  # every thread's stack is reserved by now
        out.write(b'{"ready": true}\n')
        out.flush()
        for line in sys.stdin.buffer:
            reply = _compile_reply(json.loads(line))
            out.write(json.dumps(reply).encode() + b"\n")  # ASCII: one line whatever the grammar
            out.flush()

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()
    thread = threading.Thread(target=serve, name="grammar-compile")
    start_deep(thread)
    thread.join()


def _cap_memory(budget_bytes: int) -> None:
    """Caps the process's address space at what it holds now plus `budget_bytes` (0: no cap): an
    allocation past it fails, which llguidance (Rust) answers by aborting the process, a refusal
    to the router. Address space, not resident memory: a cap it counts before any page is used."""
    if budget_bytes <= 0:
        return
    import resource

    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = size_kb * 1024 + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
