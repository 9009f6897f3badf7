"""LLMEngine: the synchronous core of a worker (scheduler + block manager + model runner).

Contract:
- `add_request(request_id, prompt_token_ids, sampling, priority=0, salt="")` queues a request
  (ValueError for duplicates, empty or over-long prompts).
- `abort(request_id)` ends it at once and frees its blocks; its final output comes from the next
  `step()` with finish_reason ABORT.
- `step() -> list[RequestOutput]`: one scheduler plan, one forward pass, one sampled token per
  sampling sequence; an output for every sequence that produced tokens or finished.
- State: everything lives here and is touched by one thread only (AsyncEngine's loop thread).
- Proven by tests/test_engine_*.py; `stats()` exposes counters for metrics.
"""

from __future__ import annotations

import logging
import time

from worker.block_manager import BlockManager
from worker.config import EngineConfig
from worker.model_runner import ModelRunner
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.types import EngineStats, ModelInfo, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
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
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            self.runner.eos_token_ids,
        )
        self.info = ModelInfo(
            name=self.runner.model_name,
            block_size=config.block_size,
            max_model_len=max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=self.runner.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
        )
        self._aborted: list[Sequence] = []
        self.num_steps = 0
        self.step_s_total = 0.0

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
        self.scheduler.add(Sequence(request_id, list(prompt_token_ids), sampling, priority, salt))

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self.runner.release(request_id)
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        start = time.perf_counter()
        sampled = self.runner.run(plan)
        self.step_s_total += time.perf_counter() - start
        self.num_steps += 1
        for seq in self.scheduler.update(plan, sampled):
            if seq.is_finished:
                self.runner.release(seq.request_id)
            outputs.append(self._output(seq))
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        # Slices of the tail only: no copy of the whole output per step.
        emitted, num_prompt = seq.num_emitted_tokens, len(seq.prompt_token_ids)
        new = seq.token_ids[num_prompt + emitted :]
        new_lp = seq.logprobs[emitted:] if seq.sampling.logprobs else None
        seq.num_emitted_tokens = len(seq.token_ids) - num_prompt
        queue_s = (seq.first_scheduled_s - seq.arrival_s) if seq.first_scheduled_s else 0.0
        ttft_s = (seq.first_token_s - seq.arrival_s) if seq.first_token_s else 0.0
        return RequestOutput(
            seq.request_id,
            new,
            new_lp,
            seq.is_finished,
            seq.finish_reason,
            num_prompt,
            seq.num_emitted_tokens,
            seq.num_cached_tokens,
            queue_s,
            ttft_s,
            seq.num_preemptions,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler
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
