"""Constrained decoding (structured outputs): each sampled token keeps the output a prefix of a
grammar's language, with llguidance (the token-mask engine vLLM and llama.cpp use).

Contract
- input: `SamplingParams.grammar`, an llguidance grammar (JSON text, as common.structured builds
  it from a `response_format`: a JSON Schema, any JSON object, or a regex; the router validates it
  before admission); the model's tokenizer (`tokenizer_json()`, read once, on the first
  constrained request: ~0.2 s for SmolLM2's 49k tokens, on the engine thread).
- output: `Grammars.constrain(seq)` (the engine, at admission) sets `seq.matcher`, a new llguidance
  matcher, and `seq.opening`, the grammar's shared compiled state while that matcher is at its
  start; `Grammars.matcher(grammar)` -> a new matcher alone (ValueError naming the problem for a
  grammar this tokenizer cannot run, or where llguidance is not installed). Per sampling step:
  `start(seqs)` (the model runner, before the forward pass) starts the masks of the constrained
  sampling rows on the mask threads; `banned(seqs, vocab, device)` joins them -> the bool
  `[S, vocab]` the sampler sets to -inf; then `advance(seqs, tokens)` (`consume(matcher, token)`
  for each constrained row). `allowed(matchers, vocab)` -> bool `[R, vocab]` (CPU), the masks
  computed one after another on the calling thread (the reference). EOS only once the grammar is
  complete or has failed: the sequence then ends as at any EOS.
- Shared compiled state: a grammar text is compiled once (`compiled`, an LRU of
  GRAMMAR_CACHE_SIZE, counted in `num_compiles`); each matcher is a copy of its never-advanced
  template (`LLMatcher.deep_copy`, ~0.3 ms against ~10 ms to compile a schema). The opening mask,
  the same for every matcher of a grammar and the expensive one (llguidance builds its lexer
  lazily: 0.9-6 s for the regex `(a{1000}){1000}` on this loaded 2-vCPU box, against ~1 ms to
  construct), is computed once per grammar on a private copy and shared by every row still at
  the start (`n` choices of one request, or any later request while it is cached).
- Masks beside the forward pass: mask threads with DEEP_STACK_BYTES of stack (common/structured.py
  `start_deep`; started as jobs need them, MASK_THREADS at most): per step one job computes the
  rows past their grammar's start in order (one thread hand-off; llguidance releases the GIL while
  it computes), and each grammar's opening mask is its own job, shared by its rows at the start.
- Grammar step budget (`budget_s`, EngineConfig.grammar_step_budget_ms, default 100 ms; 0 = none):
  `banned` waits for the step's masks until `budget_s` after they started, then gives up on the
  row the step's job is on, and on the opening masks not done. Those rows alone fail (the
  grammar-failed path below: logged naming the budget, counted in `num_failures` and
  `num_over_budget`, only EOS from then on, finish reason LENGTH); the rows that job had not reached
  get a job each and one more budget; every other row samples as usual, so a step is longer than
  its forward pass by at most twice the budget. The job left behind runs to its end on its
  thread, its matcher never touched again (llguidance's computation cannot be interrupted, and
  LLParserLimits has no time bound: `step_lexer_fuel` left the opening mask of `(a{1000}){1000}`
  at ~1 s; a lower `initial_lexer_fuel` made it cheaper, same mask, but bounds work, not time, and
  would part from the router's validation limits, so the defaults stay); an opening mask that ends
  late still serves the grammar's later rows. Pool starvation: MASK_THREADS expensive jobs at once (distinct
  grammars) can delay the masks of other constrained rows past their budget (unconstrained rows
  are never delayed).
- Reference path (tests): `shared = False` builds a fresh matcher per request; `parallel = False`
  computes the masks serially in `banned`, without a budget (the code before the fast path).
- state: the llguidance tokenizer, the compiled-grammar cache, the mask threads (started on the
  first constrained step; stopped at interpreter exit after their jobs, worker/step_thread.py
  `stop_at_exit`), the jobs started for the step about to sample (`_pending`, by request id); each
  matcher lives on its `Sequence` (advanced only by `consume`, so a preempted and recomputed
  sequence keeps its place in the grammar, and nothing keyed by request id can outlive or be shared
  by a request; a grammar's template is never advanced).
- cost: +0.3 ms per step at batch 1, +0.085 ms per row at batch 32 (docs/benchmarks.md, measured
  with the masks computed serially on the step's thread); the hand-off to the mask thread, where
  the forward pass does not hide it, added 0.1-2 ms per step (1-32 rows, a loaded 2-vCPU box).
- failure modes: ValueError from `matcher` / `constrain` (bad grammar, llguidance missing);
  RuntimeError when the model's tokenizer cannot be read (a worker fault: INTERNAL, remembered,
  not retried per request). A matcher can enter llguidance's error state mid-generation (a
  resource limit, e.g. the regex `(a{1000}){1000}`: "too many expressions constructed"; a token it
  did not allow cannot come through the sampler), or its mask can run over the step budget: the
  error is logged and counted (`num_failures`), the sequence is marked (`grammar_failed`) and only
  EOS is allowed from then on, so the output ends at once, incomplete, with finish reason LENGTH
  (worker/scheduler.py `_stop_reason`), never STOP: the client sees an answer cut short.
- proven by: tests/test_structured_output.py (engine outputs accepted whole by a fresh matcher and
  parsed against the schema; the unpacked mask against llguidance's byte mask; async scheduling,
  preemption and aborts; through the router and the OpenAI SDK); tests/test_grammar_failure.py (a
  grammar failing mid-way ends LENGTH and is counted); tests/test_grammar_step_budget.py (n=16
  choices of an expensive regex compile once and fail alone over the budget while a plain request
  beside them finishes; rows held up behind an expensive one get their masks; the fast path's
  masks and outputs equal the reference path's).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import numpy as np
import torch

from common.structured import MAX_COMPILED_GRAMMAR_BYTES, llguidance, start_deep
from worker.step_thread import EXIT_JOIN_S, stop_at_exit

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (their templates and opening masks)
MASK_THREADS = 16  # mask threads at most (started as jobs need them: one per step, as a rule)
DEFAULT_STEP_BUDGET_S = 0.1


class Compiled:
    """One grammar text compiled: the template every matcher of it copies (never advanced), and
    its opening mask (`opening`: a Future of the pair (packed mask or None, error or None),
    computed once, on a private copy)."""

    __slots__ = ("grammar", "template", "probe", "opening")

    def __init__(self, grammar: str, template):
        self.grammar, self.template = grammar, template
        self.probe = template.deep_copy()  # the opening mask's matcher, dropped once it is computed
        self.opening: Future | None = None


class MaskThreads:
    """Daemon threads with DEEP_STACK_BYTES of stack running mask jobs in order of submission: one
    more is started when every thread has a job (a job over the budget keeps its thread until
    llguidance is done), up to `threads`."""

    def __init__(self, threads: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._size, self._closed = threads, False
        self._lock = threading.Lock()
        self._unfinished = 0  # jobs submitted and not yet done

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:  # interpreter exit: run it here
                future.set_running_or_notify_cancel()
                future.set_result(fn(*args))
                return future
            self._unfinished += 1
            if self._unfinished > len(self._threads) < self._size:
                name = f"grammar-mask-{len(self._threads)}"
                thread = threading.Thread(target=self._serve, name=name, daemon=True)
                start_deep(thread)  # llguidance's matchers recurse deeply (common/structured.py)
                self._threads.append(thread)
            self._jobs.put((future, fn, args))
        return future

    def shutdown(self, timeout_s: float | None = None) -> None:
        """After the jobs already submitted (at most `timeout_s` in all)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            for _ in threads:
                self._jobs.put(None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._unfinished -= 1


class _Batch:
    """One step's masks of rows past their grammar's start, computed in order by one job. `take(i)`
    after the budget: row i's (mask, error), or None with whether the job is on it now; the first
    call stops the job after its current row (the rows after it are then computed elsewhere)."""

    def __init__(self, matchers: list, compute):
        self.matchers, self._compute = matchers, compute
        self.results: list = [None] * len(matchers)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next, self._stopped = 0, False

    def run(self) -> None:  # a mask thread
        try:
            while True:
                with self._lock:
                    if self._stopped or self._next == len(self.matchers):
                        return
                    row, self._next = self._next, self._next + 1
                result = self._compute(self.matchers[row])
                with self._lock:
                    self.results[row] = result
        finally:
            self.done.set()

    def take(self, row: int) -> tuple[tuple | None, bool]:
        with self._lock:
            self._stopped = True
            return self.results[row], row == self._next - 1 and self.results[row] is None


def _wait(jobs: list, deadline: float | None) -> None:
    """Until every job (a Future, or (index, _Batch)) is done, or `deadline` (perf_counter)."""
    for job in jobs:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if isinstance(job, Future):
            wait_futures([job], timeout=timeout)
        else:
            job[1].done.wait(timeout)


class Grammars:
    """A model runner's llguidance tokenizer, its compiled grammars and the masks of each step."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        eos_token_ids: tuple[int, ...],
        budget_s: float = DEFAULT_STEP_BUDGET_S,
    ):
        """`tokenizer_json()`: the model's `tokenizers` JSON, read on the first constrained request
        (`for_model` reads it from a --model value). `budget_s`: the grammar step budget (0: none)."""
        self._tokenizer_json, self._eos = tokenizer_json, tuple(eos_token_ids)
        self._tokenizer = None
        self._failed: str | None = None  # why the tokenizer could not be built (not retried)
        self.budget_s = budget_s
        self.shared = True  # False (tests' reference): a fresh matcher per request, nothing cached
        self.parallel = True  # False (tests' reference): masks computed serially in `banned`
        self.num_failures = 0  # cumulative: matchers that failed mid-generation (EngineStats)
        self.num_over_budget = 0  # cumulative: of those, the masks that ran over the step budget
        self.num_compiles = 0  # cumulative: grammar texts compiled (cache misses)
        self._cache: collections.OrderedDict[str, Compiled] = collections.OrderedDict()
        self._threads = MaskThreads(MASK_THREADS)
        # request id -> (sequence, its mask job, when the job was started) for the coming sample
        self._pending: dict[str, tuple[object, Future | tuple[int, _Batch], float]] = {}
        stop_at_exit(self, self._stop_threads)

    def _stop_threads(self) -> None:
        self._threads.shutdown(EXIT_JOIN_S)

    @classmethod
    def for_model(
        cls, model: str | None, eos_token_ids: tuple[int, ...], budget_s: float = DEFAULT_STEP_BUDGET_S
    ) -> Grammars:
        """Grammars over the tokenizer of a --model value (None = the embedded model)."""

        def tokenizer_json() -> str:
            from common.model_files import resolve_model_source
            from common.tokenizer import Tokenizer

            return Tokenizer.from_model(resolve_model_source(model)).backend_json()

        return cls(tokenizer_json, eos_token_ids, budget_s)

    def sibling(self, budget_s: float | None = None) -> Grammars:
        """A new Grammars over the same tokenizer (read once): its own cache, threads and counters."""
        other = Grammars(self._tokenizer_json, self._eos, self.budget_s if budget_s is None else budget_s)
        other._tokenizer, other._failed = self._tokenizer, self._failed
        return other

    def _llt(self):
        if self._tokenizer is None:
            if self._failed:
                raise RuntimeError(self._failed)
            try:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), eos_token=list(self._eos) or None
                )
            except Exception as exc:  # a worker fault, not the request's: INTERNAL (the router retries)
                log.exception("structured output: the model's tokenizer could not be read")
                self._failed = (
                    f"structured output: the model's tokenizer could not be read ({type(exc).__name__})"
                )
                raise RuntimeError(self._failed) from None
        return self._tokenizer

    # -- matchers -------------------------------------------------------------------------
    def _new(self, grammar: str):
        """A freshly compiled matcher (ValueError naming the problem)."""
        if llguidance is None:
            raise ValueError(
                "structured output is unavailable on this worker: the llguidance package is not installed"
            )
        if len(grammar) > MAX_COMPILED_GRAMMAR_BYTES:  # the router's bound too (common/structured.py)
            raise ValueError(f"grammar: {len(grammar)} bytes is too large")
        matcher = llguidance.LLMatcher(self._llt(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return matcher

    def compiled(self, grammar: str) -> Compiled:
        """`grammar` compiled, from the cache or now (ValueError naming the problem; not cached)."""
        entry = self._cache.get(grammar)
        if entry is not None:
            self._cache.move_to_end(grammar)
            return entry
        entry = Compiled(grammar, self._new(grammar))
        self.num_compiles += 1
        self._cache[grammar] = entry
        while len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)  # its sequences keep their own reference
        return entry

    def matcher(self, grammar: str):
        """A new matcher of `grammar` at its start (a copy of the compiled template)."""
        if not self.shared:
            return self._new(grammar)
        return self.compiled(grammar).template.deep_copy()

    def constrain(self, seq) -> None:
        """A constrained request's matcher (`seq.matcher`) and, while it is at its start, the
        compiled grammar whose opening mask it takes (`seq.opening`). ValueError for a bad grammar."""
        grammar = seq.sampling.grammar
        if not self.shared:
            seq.matcher = self._new(grammar)
            return
        entry = self.compiled(grammar)
        seq.matcher, seq.opening = entry.template.deep_copy(), entry

    # -- masks ----------------------------------------------------------------------------
    @property
    def _mask_bytes(self) -> int:
        return (self._llt().vocab_size + 31) // 32 * 4

    def _compute(self, matcher) -> tuple[np.ndarray | None, str | None]:
        """Mask thread: `matcher`'s packed mask; None when only EOS may follow (complete or failed),
        with llguidance's error if it failed."""
        try:
            if not (matcher.is_error() or matcher.is_stopped()):
                out = np.zeros(self._mask_bytes, dtype=np.uint8)
                matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
                if not matcher.is_error():
                    return out, None
            return None, (matcher.get_error() or "llguidance's error state") if matcher.is_error() else None
        except Exception as exc:  # noqa: BLE001 - the row fails, not the step
            log.exception("structured output: a mask computation raised")
            return None, f"its mask computation raised {type(exc).__name__}"

    def _compute_opening(self, entry: Compiled) -> tuple[np.ndarray | None, str | None]:
        try:
            return self._compute(entry.probe)
        finally:
            entry.probe = None  # its lexer states can be large: the mask is what is kept

    def _opening(self, entry: Compiled) -> Future:
        """The grammar's opening mask, started once (on the first step of its first row)."""
        if entry.opening is None:
            entry.opening = self._threads.submit(self._compute_opening, entry)
        return entry.opening

    def start(self, seqs: list) -> None:
        """Before the forward pass: the masks of these constrained sampling rows start on the mask
        threads: the rows at their grammar's start take its opening mask, the others are computed
        in order by one job (one thread hand-off per step). A row's job from a step that failed
        before sampling is kept (its matcher has not moved)."""
        if not self.parallel:
            return
        now = time.perf_counter()
        batch = []
        for seq in seqs:
            if seq.grammar_failed:
                continue
            pending = self._pending.get(seq.request_id)
            if pending is not None and pending[0] is seq:
                self._pending[seq.request_id] = (seq, pending[1], now)
            elif seq.opening is not None:
                self._pending[seq.request_id] = (seq, self._opening(seq.opening), now)
            else:
                self._pending[seq.request_id] = (seq, (len(batch), None), now)
                batch.append(seq.matcher)
        if batch:
            rows = _Batch(batch, self._compute)
            self._threads.submit(rows.run)
            for rid, (seq, job, t0) in self._pending.items():
                if isinstance(job, tuple) and job[1] is None:
                    self._pending[rid] = (seq, (job[0], rows), t0)

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def allowed(self, matchers: list, vocab: int) -> torch.Tensor:
        """bool [R, vocab]: each matcher's bitmask computed here, one after another (the reference)."""
        words = self._mask_bytes
        packed = np.zeros((len(matchers), words), dtype=np.uint8)
        ended = []
        for row, matcher in enumerate(matchers):
            if matcher.is_error() or matcher.is_stopped():  # failed, or complete: only EOS may follow
                ended.append(row)
            else:
                matcher.unsafe_compute_mask_ptr(packed[row].ctypes.data, words)
        return self._unpack(packed, ended, vocab)

    def _unpack(self, packed: np.ndarray, ended: list[int], vocab: int) -> torch.Tensor:
        """bool [R, vocab] of packed bitmasks, unpacked in one lookup (little-endian words: token t
        is bit t % 8 of byte t // 8); rows `ended` allow EOS only."""
        bits = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little"))  # [R, words * 32]
        out = torch.zeros(packed.shape[0], vocab, dtype=torch.bool)
        n = min(vocab, bits.shape[1])
        out[:, :n] = bits[:, :n]
        if ended:
            out[ended] = False
            eos = [t for t in self._eos if t < vocab]
            for row in ended:
                out[row, eos] = True
        return out

    def _joined(self, seqs: list, vocab: int) -> torch.Tensor:
        """bool [R, vocab] of constrained `seqs`: their masks (started by `start`, else now) joined
        within the step budget; a row over it, or whose matcher failed, fails. Rows that a row over
        the budget kept from starting are computed then, one job each, within one more budget."""
        missing = [s for s in seqs if hasattr(s, "request_id") and s.request_id not in self._pending]
        if missing:  # not started before the forward pass (a caller other than the model runner)
            self.start(missing)
        now, budget = time.perf_counter(), self.budget_s
        jobs: list = []  # per row: None (failed before), a Future, or (index, _Batch)
        started = now
        for seq in seqs:
            pending = self._pending.pop(getattr(seq, "request_id", None), None)
            if getattr(seq, "grammar_failed", False):
                jobs.append(None)
            elif pending is not None and pending[0] is seq:
                jobs.append(pending[1])
                started = min(started, pending[2])
            else:  # not a Sequence (tests): its own job
                jobs.append(self._threads.submit(self._compute, seq.matcher))
        deadline = None if budget <= 0 else started + budget
        _wait([j for j in jobs if j is not None], deadline)
        results: list = [None] * len(seqs)  # (mask, error), or a reason to fail it
        rescue: dict[int, Future] = {}
        for row, job in enumerate(jobs):
            if job is None:
                continue
            if isinstance(job, Future):
                results[row] = job.result() if job.done() else self._over_budget()
                continue
            index, rows = job
            result, running = rows.take(index)
            if result is not None:
                results[row] = result
            elif running:  # the row the step's job is still on
                results[row] = self._over_budget()
            else:  # held up behind it: its own job now
                rescue[row] = self._threads.submit(self._compute, seqs[row].matcher)
        if rescue:
            _wait(list(rescue.values()), None if budget <= 0 else time.perf_counter() + budget)
            for row, future in rescue.items():
                results[row] = future.result() if future.done() else self._over_budget()
        packed = np.zeros((len(seqs), self._mask_bytes), dtype=np.uint8)
        ended = []
        for row, (seq, result) in enumerate(zip(seqs, results)):
            if isinstance(result, str):
                self._fail(seq, result)
            elif result is not None and result[0] is not None:
                packed[row] = result[0]
                continue
            elif result is not None and result[1] is not None:
                self._fail(seq, result[1])
            ended.append(row)  # failed (LENGTH at its EOS), or complete (STOP)
        return self._unpack(packed, ended, vocab)

    def _over_budget(self) -> str:
        self.num_over_budget += 1
        return f"its mask ran over the grammar step budget ({self.budget_s * 1000:.0f} ms)"

    def banned(self, seqs: list, vocab: int, device: torch.device) -> torch.Tensor | None:
        """bool [S, vocab] on `device`: the tokens the grammar of each row's sequence (`.matcher`)
        does not allow, nothing for rows without one; None when no row has one."""
        rows = [i for i, seq in enumerate(seqs) if getattr(seq, "matcher", None) is not None]
        if not rows:
            return None
        out = torch.zeros(len(seqs), vocab, dtype=torch.bool)
        if self.parallel:
            out[rows] = ~self._joined([seqs[i] for i in rows], vocab)
        else:
            out[rows] = ~self.allowed([seqs[i].matcher for i in rows], vocab)
        return out.to(device)

    def _fail(self, seq, why: str) -> None:
        """`seq`'s grammar failed: EOS only from now on (finish LENGTH), counted and logged once."""
        if getattr(seq, "grammar_failed", False):
            return
        seq.grammar_failed = True
        self.num_failures += 1
        log.warning(
            "structured output: the grammar of %s failed (%s); ending with EOS (finish: length)",
            getattr(seq, "request_id", "a request"),
            why.splitlines()[0] if why else "unknown",
        )

    def advance(self, seqs: list, tokens: torch.Tensor) -> None:
        """Each constrained row's matcher takes its sampled token (one host copy of `tokens`). A
        sequence whose matcher failed is marked `grammar_failed` (its EOS then ends it LENGTH, not
        STOP) and counted once; a failed one's matcher is not touched again (a mask job over the
        budget may still be running on it)."""
        for seq, token in zip(seqs, tokens.tolist()):
            matcher = getattr(seq, "matcher", None)
            if matcher is None or getattr(seq, "grammar_failed", False):
                continue
            if getattr(seq, "opening", None) is not None:
                seq.opening = None  # past its start: its own masks from now on
            if not self.consume(matcher, token):
                self._fail(seq, f"at token {token}: {matcher.get_error()}")

    def consume(self, matcher, token: int) -> bool:
        """`matcher` takes `token`; False once it has failed (llguidance's error state, reached on
        this token or while computing its mask: a failed matcher also reports itself stopped)."""
        if not matcher.is_stopped() and not matcher.consume_token(token):
            return False
        return not matcher.is_error()
