"""LLMEngine: the core of a worker (scheduler + block manager + model runner), one thread.

Contract:
- `add_request(request_id, prompt_token_ids, sampling, priority=0, salt="")` queues a request
  (ValueError for duplicates, empty or over-long prompts).
- `abort(request_id)` ends it at once (its blocks are freed at once, also while a step in flight
  holds it); its final output comes from the next `step()` with finish_reason ABORT.
- `step() -> list[RequestOutput]`: one scheduler plan, one forward pass, one sampled token per
  sampling sequence (with speculative decoding, worker/speculative.py, a drafted sequence's kept
  draft tokens before it); an output for every sequence that produced tokens or finished.
- State: everything lives here and is touched by one thread only (AsyncEngine's loop thread);
  with async scheduling the model runner belongs to one executor thread instead.
- Async scheduling (`EngineConfig.async_scheduling`): `step()` launches step N+1 on the executor
  thread before it waits for step N, so planning step N+1 (schedule, block allocation), committing
  step N and building its outputs overlap the forward pass. The plan of N+1 counts one placeholder
  token per sequence sampling in N (`Scheduler.advance`); N+1's inputs read N's sampled token in
  that slot from N's token tensor on the device (`ModelRunner.launch(plan, prev, feeds)`), so the
  executor queues N+1 behind N without waiting for N's tokens on the host: the one host sync per
  step is the engine thread's, when it commits N. Each `step()` still returns the outputs of exactly
  one step, and tokens, finish reasons and prompt / output token counts are the synchronous
  engine's (cached-token counts may be lower: see the differences below). What overlaps:
  decodes, prompt chunks, new admissions (prefix-cache hits included), greedy and seeded or unseeded
  sampling, logprobs, logit bias, penalties (their token statistics live on the device, updated by
  each sampled token), stop token ids, EOS, max_tokens (a sequence whose pending token is its last
  is left out of the next plan), aborts (the step in flight drops the token), and preemption (KV
  pool short, or a waiting request of higher priority): the plan of N+1 preempts as the synchronous
  one would, sequences of N included. A victim's blocks go back at once: N writes its KV into them
  before N+1, queued behind N on the executor thread (one stream on a GPU), reuses them; N's token
  for it is output when N commits, and may finish it while it waits (`Scheduler.commit`); it is
  re-admitted (recomputed) once that token is known. So do the blocks of a sequence that ends (EOS
  or a stop id in N, or an abort) while a step in flight holds it, for the same reason: the plan of
  N+1 has them as the synchronous plan would. Differences from the synchronous engine, none in
  tokens, finish reasons or prompt / output counts: blocks are hashed for the prefix cache when the
  step that fills them commits, so a request admitted in N+1 misses the blocks of a shared prefix
  that N is filling and computes them again (fewer cached prompt tokens; the synchronous engine
  admits it after N's commit and hits them); N+1 is planned while N's tokens are unknown (a sequence
  whose pending token ends it by EOS still counts as running then), so N+1 may preempt where the
  synchronous plan would not, or not where it would (preemption counts differ; logprobs of
  recomputed sequences equal within 1e-5), and a victim's blocks filled by N are not hashed for the
  prefix cache. What runs synchronously (plan
  made once nothing is in flight, counted in `num_sync_steps`): the first step after idling, and
  the step after a next plan that scheduled nothing because it preempted everything it could run
  (`fallbacks["preemption"]`), and the step after an empty next plan for any other reason (every
  running sequence's pending token is its last, and they still fill `max_num_seqs`). Stop strings
  are matched by the router, which aborts: an abort here.
  Not with tensor parallelism (the flag is ignored there), nor with speculative decoding (drafts
  are off when the flag is on).
- Proven by tests/test_engine_*.py, tests/test_async_scheduling.py (async == sync on random
  workloads, preempting ones included), tests/test_async_preemption.py (preemption in flight,
  case by case) and tests/test_async_ends_in_flight.py (blocks of sequences ending in flight reused
  by the next plan); `stats()` exposes counters for metrics.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass

from worker.block_manager import BlockManager
from worker.config import DEFAULT_SPECULATIVE_TOKENS, EngineConfig
from worker.lora import EngineAdapters
from worker.model_runner import ModelRunner
from worker.sampler import SampledTokens
from worker.scheduler import Scheduler, SchedulerOutput
from worker.sequence import PLACEHOLDER, Sequence, SequenceStatus, next_output
from worker.speculative import NgramProposer
from worker.step_thread import StepThread
from worker.types import EngineStats, ModelInfo, RequestOutput, SamplingParams, StepRecord

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step handed to the executor: its plan and the future of (sampled tokens, seconds)."""

    plan: SchedulerOutput
    future: Future


class LLMEngine(EngineAdapters):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        mc = self.runner.model_config
        num_blocks = min(config.num_kv_blocks or self.runner.num_blocks, self.runner.num_blocks)
        # A sequence must fit the pool alone, or preempting everyone else could not save it.
        max_model_len = min(
            config.max_model_len or mc.max_position, mc.max_position, num_blocks * config.block_size
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.async_scheduling = config.async_scheduling and config.tensor_parallel_size == 1
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            self.runner.eos_token_ids,
            self._proposer(config),
            config.speculative_max_batch,
        )
        self.info = ModelInfo(
            name=self.runner.model_name,
            block_size=config.block_size,
            max_model_len=max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=self.runner.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            adapters=adapters.names if (adapters := getattr(self.runner, "adapters", None)) else (),
            # random at start: a router sees a restarted worker's info as new even between probes
            info_version=int.from_bytes(os.urandom(7), "big"),
        )
        self.lora = self.lora_figures()  # worker/metrics.py's LoRA gauges
        self._aborted: list[Sequence] = []
        self.num_steps = 0
        self.step_s_total = 0.0
        self.last_step: StepRecord | None = None  # the latest committed step (worker/metrics.py)
        passive = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
        if self.async_scheduling and self.runner.device.type == "cpu" and not passive:
            log.warning(
                "async scheduling on CPU without OMP_WAIT_POLICY=PASSIVE: libgomp's spinning team "
                "beside the engine thread made steps up to 10x slower (docs/benchmarks.md)"
            )
        self.num_overlapped_steps = 0  # launched while another step was in flight
        self.num_sync_steps = 0  # launched with nothing in flight
        self.fallbacks: Counter[str] = Counter()  # why a next plan was not launched early
        self._in_flight: deque[_Launched] = deque()
        self._pending_releases: list[str] = []  # runner.release calls for the executor thread
        # Started now, not at the first launch: its exit hook is then older than that of an
        # AsyncEngine around this engine, which so stops its loop (and closes this) first.
        self._executor: StepThread | None = StepThread() if self.async_scheduling else None
        self._last_ready = 0.0  # when the last committed step's tokens reached the host

    def _proposer(self, config: EngineConfig) -> NgramProposer | None:
        """Speculative decoding's drafter, if on: by default on CPU (not on GPU, where a drafted step
        would run outside the CUDA graphs); never with async scheduling or tensor parallelism, whose
        steps take one token per sequence."""
        k = config.num_speculative_tokens
        if k is None:
            k = DEFAULT_SPECULATIVE_TOKENS if self.runner.device.type == "cpu" else 0
        elif k and (self.async_scheduling or config.tensor_parallel_size > 1):
            log.warning("speculative decoding is off: not with async scheduling or tensor parallelism")
            return None
        if self.async_scheduling or config.tensor_parallel_size > 1:
            return None
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max) if k else None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        salt: str = "",
    ) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if sampling.adapter:
            if sampling.adapter not in self.info.adapters:
                served = ", ".join(self.info.adapters) or "none"
                raise ValueError(f"adapter {sampling.adapter!r} is not served here (adapters: {served})")
            # Its KV differs from the base model's, and from an earlier load of the same name's.
            salt = f"{salt}\x1flora:{sampling.adapter}#{self.runner.adapters.slot[sampling.adapter]}"
        seq = Sequence(request_id, list(prompt_token_ids), sampling, priority, salt)
        if sampling.grammar:
            self.scheduler.check(seq)  # the cheap refusals before compiling the grammar
            self.runner.constrain(seq)  # seq.matcher; ValueError for a bad grammar
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._release(request_id)
        self._aborted.append(seq)
        return True

    def forget_aborted(self, request_id: str) -> None:
        """Drops the pending abort output of `request_id` (nobody reads it: its id is reused)."""
        self._aborted = [seq for seq in self._aborted if seq.request_id != request_id]

    @property
    def has_pending_aborts(self) -> bool:
        """Requests aborted since the last `step()`, whose final outputs (finish_reason ABORT) the
        next `step()` returns: that step has work even if nothing is left to schedule."""
        return bool(self._aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._in_flight)

    @property
    def has_in_flight(self) -> bool:
        """A launched step has not returned its outputs yet (async scheduling)."""
        return bool(self._in_flight)

    def close(self) -> None:
        """Stop the executor thread (async scheduling), after the step in flight."""
        if self._executor is not None:
            self._executor.shutdown(timeout_s=60.0)
            self._executor = None

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_overlapped()
        outputs = [next_output(seq) for seq in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        start = time.perf_counter()
        tokens = self.runner.launch(plan)
        self._file_prompt_reads(tokens)
        sampled = tokens.to_host()
        self._count_step(plan, time.perf_counter() - start)
        self.num_sync_steps += 1
        output = next_output
        for seq in self.scheduler.update(plan, sampled, tokens.accepted):
            if seq.status is SequenceStatus.FINISHED:
                self.runner.release(seq.request_id)
            outputs.append(output(seq))
        return outputs

    # -- async scheduling -----------------------------------------------------------------
    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch the next step if it can be planned now, then return the oldest one's outputs."""
        outputs = [next_output(seq) for seq in self._aborted]
        self._aborted.clear()
        if not self._in_flight:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return outputs
            self._launch(plan)
        plan = self._plan_ahead()
        if plan is not None:
            self._launch(plan)
        outputs.extend(self._finish_oldest())
        return outputs

    def _plan_ahead(self) -> SchedulerOutput | None:
        """The next plan, made while a step is in flight; None when there is nothing to launch yet
        (the next step is then planned once nothing is in flight)."""
        plan = self.scheduler.schedule(speculative=True)
        if plan.is_empty:
            if plan.preempted:  # every sequence it could run was preempted (the pool is short)
                self.fallbacks["preemption"] += 1
            return None
        return plan

    def _launch(self, plan: SchedulerOutput) -> None:
        """Hand `plan` to the executor thread (behind the step in flight, if any)."""
        prev = self._in_flight[-1].future if self._in_flight else None
        if prev is None:
            self.num_sync_steps += 1
        else:
            self.num_overlapped_steps += 1
        # Sequences whose input is the token of the step in flight (a placeholder here): the runner
        # reads it from that step's tokens on the device.
        feeds = frozenset(
            [s.seq.request_id for s in plan.scheduled if s.seq.token_ids[s.start] == PLACEHOLDER]
        )
        releases, self._pending_releases = self._pending_releases, []
        self.scheduler.advance(plan)
        if self._executor is None:
            self._executor = StepThread()
        future = self._executor.submit(self._run_step, plan, prev, feeds, releases)
        self._in_flight.append(_Launched(plan, future))
        self.scheduler.in_flight.append(plan)

    def _run_step(
        self, plan: SchedulerOutput, prev: Future | None, feeds: frozenset[str], releases: list[str]
    ) -> tuple[SampledTokens, float]:
        """Executor thread: the runner's releases, then the step queued on the device, its
        placeholders read from the previous step's tokens there (no host sync: on a GPU this
        returns while the device still runs the previous step; the engine thread writes the same
        values into the sequences when it commits)."""
        for request_id in releases:
            self.runner.release(request_id)
        prev_tokens = prev.result()[0] if feeds else None  # done: it ran on this thread before
        start = time.perf_counter()
        return self.runner.launch(plan, prev_tokens, feeds), start

    def _finish_oldest(self) -> list[RequestOutput]:
        launched = self._in_flight[0]
        try:
            tokens, start = launched.future.result()
            sampled = tokens.to_host()  # the step's one host sync
        except BaseException:
            self._recover()
            raise
        self._in_flight.popleft()
        self.scheduler.in_flight.popleft()
        self._file_prompt_reads(tokens)
        # Device time of this step: from its launch, or from the previous step's end if later.
        ready = time.perf_counter()
        self._count_step(launched.plan, ready - max(start, self._last_ready))
        self._last_ready = ready
        touched = self.scheduler.commit(launched.plan, sampled)
        self._release_pending()
        outputs, output = [], next_output
        for seq in touched:
            if seq.status is SequenceStatus.FINISHED:
                self._release(seq.request_id)
            outputs.append(output(seq))
        return outputs

    @staticmethod
    def _file_prompt_reads(tokens: SampledTokens) -> None:
        """The prompt logprobs and pooled rows a step computed, into their sequences (a preempted
        or aborted one's too: a recomputation skips or restarts what is held; an aborted one is
        never output again)."""
        for seq, first, entries in tokens.prompt:
            seq.add_prompt_logprobs(first, entries)
        for seq, first, rows, total in tokens.pool_sums:
            seq.add_pooled(first, rows, total)
        for seq, vector in tokens.embeddings:
            seq.embedding = vector.tolist()

    def _count_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A committed step's time and size: the totals and `last_step` (the step histograms)."""
        self.step_s_total += seconds
        self.num_steps += 1
        self.last_step = StepRecord(self.num_steps, seconds, plan.num_batched_tokens, len(plan.scheduled))

    def _release_pending(self) -> None:
        """With nothing in flight the executor is idle: it takes the pending releases now."""
        if not self._in_flight:
            for request_id in self._pending_releases:
                self.runner.release(request_id)
            self._pending_releases.clear()

    def _recover(self) -> None:
        """A step failed: wait for the rest, undo every launched plan (newest first), so the
        engine is as the last committed step left it."""
        for launched in self._in_flight:
            try:
                launched.future.result()
            except BaseException:  # noqa: BLE001 - the first failure is the one re-raised
                log.debug("a step queued behind a failed one failed too", exc_info=True)
        for launched in reversed(self._in_flight):
            self.scheduler.rollback(launched.plan)
        self._in_flight.clear()
        self.scheduler.in_flight.clear()
        self._release_pending()

    def _release(self, request_id: str) -> None:
        """runner.release, on the thread that owns the runner: now, or with the next launch."""
        if self._in_flight:
            self._pending_releases.append(request_id)
        else:
            self.runner.release(request_id)

    def stats(self) -> EngineStats:
        s = self.scheduler
        failures, over_budget, compiles = self.runner.grammar_counts()
        return EngineStats(
            len(s.running),
            len(s.waiting),
            self.block_manager.num_free_blocks,
            self.block_manager.num_blocks,
            s.num_preemptions,
            self.block_manager.num_prefix_queries,
            self.block_manager.num_prefix_hits,
            s.num_prompt_tokens,
            s.num_generation_tokens,
            self.num_overlapped_steps,
            self.num_sync_steps,
            failures,
            s.num_draft_tokens,
            s.num_accepted_tokens,
            over_budget,
            compiles,
        )

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams], salt: str = ""
    ) -> list[list[int]]:
        """Offline helper: run prompts to completion, return output token ids in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"offline-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params):
            self.add_request(rid, prompt, sp, salt=salt)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
