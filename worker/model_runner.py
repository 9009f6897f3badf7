"""Model runner: turns a scheduler plan into one forward pass and sampled tokens.

Contract:
- Input: `SchedulerOutput` (which sequences, how many new tokens each).
- Builds flat inputs for the step: `input_ids [T] int64`, `positions [T] int64`,
  `slot_mapping [T] int64`, `block_tables [S, max_blocks] int32`, `seq_lens [S] int32`,
  `query_start_loc [S+1] int32` (see worker/attention.py) from the persistent batch state
  (worker/input_batch.py: one host-to-device transfer per step; `prepare_reference` is the slow
  rebuild it is tested against), runs the model, computes logits only for sequences that finish
  their outstanding tokens this step, and samples. Greedy rows without logprobs or logit
  processing take the argmax of the model-dtype logits (no float32 copy); one host sync per step
  (the tokens' copy to the host), two when logprobs are asked for.
- Prompt logprobs (`SamplingParams.prompt_logprobs`): a step that computes a chunk of such a
  prompt runs eager (no CUDA graph) and scores the chunk's rows (worker/prompt_logprobs.py); the
  values come to the host with the step (`SampledTokens.prompt`): a host sync on the executor
  thread, so on a GPU such a step does not overlap the next one's planning.
- Output: `run(plan)` -> `{request_id: (token_id, logprob | None)}` for the sampling sequences;
  `launch(plan, prev, feeds)` -> `SampledTokens` (worker/sampler.py), the tokens left on the device
  and read there by the next step's placeholders (async scheduling), their host copy on demand.
- Pooling (`SamplingParams.pooling`, embeddings): a "mean" sequence's chunks run eager like
  scored ones and their row sums come to the host with the step (`SampledTokens.pool_sums`); a
  "last" one's sampling row is its embedding (`SampledTokens.embeddings`; worker/pooling.py).
- Speculative decoding (worker/speculative.py): a drafted sequence's newest token and draft are
  computed as one chunk, every row of it samples, and `RequestSampler.verify` keeps the drafts
  the rows confirm (`SampledTokens.accepted`, a host sync); such a step runs eager on CUDA.
- State: the model weights, the paged KV cache (`kv_caches[layer] = (K, V)`, each
  `[num_blocks, block_size, num_kv_heads, head_dim]`), the per-request sampling state
  (`RequestSampler`, worker/sampler.py: generators, Philox seeds and counters, penalty statistics).
- Sampling on CUDA: rows without logprobs, logit bias or penalties go through the fused Triton
  kernel (worker/kernels/triton_sampling.py) over the model-dtype logits; elsewhere worker/sampler.py.
- Memory: the KV pool is sized once from `kv_cache_bytes` (CPU) or from free device memory
  after loading the weights times `gpu_memory_utilization` (CUDA; CPU without `kv_cache_bytes`:
  available memory times `kv_cache_memory_fraction`), less, with `lora_dir`, the run-time LoRA
  adapters' room (`Adapters.reserve_bytes`).
- CUDA: decode rows replay CUDA graphs (worker/cuda_graphs.py) unless `enforce_eager`; a mixed
  step runs its prompt chunks and LoRA adapter rows in one eager launch, then the decode graph of
  the base model's decode rows.
- Proven by tests/test_engine_hf.py (logits vs transformers), tests/test_engine_batching.py,
  tests/test_input_batch.py, tests/test_cuda_graphs.py (graph path with mixed steps on CPU) and
  tests/test_lora_graphs.py (base rows on graphs beside LoRA rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import torch

from worker.attention import AttentionMetadata, get_attention_backend
from worker.config import EngineConfig, resolve_device, resolve_dtype
from worker.cpu_compile import CompiledCpuForward
from worker.cuda_graphs import CudaGraphRunner, bucket_for, capture_sizes
from worker.grammar import Grammars
from worker.host import available_memory_bytes, default_num_threads
from worker.input_batch import InputBatch, reference_inputs
from worker.kernels.cpu_layers import CpuLayerStack
from worker.lora import Adapters
from worker.model.llama import LlamaModel
from worker.pooling import chunk_sums, last_rows, pooled_chunks
from worker.prompt_logprobs import score_prompt_rows, scored_chunks
from worker.sampler import RequestSampler, SampledTokens
from worker.sampling_ops import fused_sampler, take_rows
from worker.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


def resolved_config(config: EngineConfig) -> EngineConfig:
    """`auto` device, dtype and thread count made concrete: the one place they are decided."""
    device = resolve_device(config.device)
    return dataclasses.replace(
        config,
        device=device,
        dtype=resolve_dtype(config.dtype, device),
        num_threads=config.num_threads or default_num_threads(),
    )


class ModelRunner:
    def __init__(self, config: EngineConfig):
        # Imported here: the loaders pull in gguf, which a runner built from_model() never needs.
        from worker.model.loader import load_model

        config = resolved_config(config)
        torch.set_num_threads(config.num_threads)
        # fp8 (worker/model/fp8.py) converts the dense model in _setup.
        quantization = "none" if config.quantization == "fp8" else config.quantization
        device = torch.device(config.device)
        loaded = load_model(config.model, config.dtype, device, quantization=quantization)
        if config.device == "cpu":
            from worker.model.cpu_paths import apply_cpu_paths

            apply_cpu_paths(loaded.model, config, log)
        self._setup(config, loaded.model, loaded.name, loaded.eos_token_ids, loaded.load_s)

    @classmethod
    def from_model(
        cls,
        config: EngineConfig,
        model: LlamaModel,
        eos_token_ids: tuple[int, ...] = (),
        name: str = "in-memory",
    ) -> ModelRunner:
        """A runner over an already built model (on config.device), e.g. random weights."""
        dtype = str(model.dtype).removeprefix("torch.")  # not embed_tokens': int8 if quantized
        # (not embed_tokens.weight: None once the embedding is re-laid out for int8 activations)
        device = str(model.norm.weight.device) if config.device == "auto" else config.device
        config = resolved_config(dataclasses.replace(config, dtype=dtype, device=device))
        torch.set_num_threads(config.num_threads)
        runner = cls.__new__(cls)
        runner._setup(config, model, name, tuple(eos_token_ids), 0.0)
        return runner

    def _setup(
        self,
        config: EngineConfig,
        model: LlamaModel,
        name: str,
        eos_token_ids: tuple[int, ...],
        load_s: float,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.quantization == "fp8":
            from worker.model.fp8 import quantize_model_fp8, use_fp8_gemv

            group = config.fp8_group_size  # 0: per channel, W8A8; else per group, W8A16
            log.info("fp8 (group %d): %d linear layers converted", group, quantize_model_fp8(model, group))
            if self.device.type == "cuda":
                # Decode rows (<= 16) read the fp8 weights through a Triton GEMV (W8A16) where
                # startup timing beats the other path; before the KV pool is sized and graph capture.
                log.info("fp8 W8A16 gemv at decode: %d linear layers", use_fp8_gemv(model))
        if config.triton_gemv and self.device.type == "cuda":
            from worker.model.gemv import use_triton_gemv

            # Before the KV pool is sized (the timing's weight copies are freed) and graph capture.
            log.info("triton gemv: %d linear layers swapped", use_triton_gemv(model))
        self.model, self.model_config = model, model.config
        # LoRA adapters (worker/lora.py): wrapped last, around whatever form the linears now have.
        self.adapters = Adapters.attach(model, config, self.device, log)
        self.model_name, self.eos_token_ids, self.load_s = name, eos_token_ids, load_s
        self.backend = get_attention_backend(config.attention_backend, self.device, model.dtype)
        if self.kv_cache_dtype == torch.float8_e4m3fn and self.backend.name != "triton":
            # The other backends would cast q to fp8; the triton kernel widens the tiles instead.
            raise ValueError(
                f"--kv-cache-dtype fp8 needs the triton attention backend, not {self.backend.name!r}"
            )
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        cfg, dtype = self.model_config, self.kv_cache_dtype
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty: pages are committed as blocks are first written, so RSS follows the tokens
        # held, not the pool's size (kernels never read a slot before it is written).
        self.kv_caches = [
            (
                torch.empty(shape, dtype=dtype, device=self.device),
                torch.empty(shape, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        # CPU plain-greedy batches: the fused ops' argmax over the model-dtype logits (no float32 copy).
        cpu_argmax = (
            self.backend.fused.argmax_rows if self.backend.name == "cpu" and self.backend.fused else None
        )
        self.sampler = RequestSampler(self.device, config.seed, fused_sampler(self.device), cpu_argmax)
        # structured output: the model's tokenizer is read on the first constrained request
        self.sampler.grammars = Grammars.for_model(
            config.model, eos_token_ids, config.grammar_step_budget_ms / 1000
        )
        self.logits_observer: Callable[[list[str], torch.Tensor], None] | None = None
        log.info(
            "model %s loaded in %.1fs; %d KV blocks (%d tokens, %.0f MiB), backend %s",
            self.model_name,
            self.load_s,
            self.num_blocks,
            self.num_blocks * self.block_size,
            self.num_blocks * self.kv_bytes_per_block / 2**20,
            self.backend.name,
        )
        # Persistent batch state (worker/input_batch.py): block tables kept across steps.
        max_model_len = min(
            config.max_model_len or cfg.max_position, cfg.max_position, self.num_blocks * self.block_size
        )
        self.input_batch = InputBatch(
            config.max_num_seqs, -(-max_model_len // self.block_size), self.block_size, self.device
        )
        # Decode rows replay CUDA graphs (worker/cuda_graphs.py); a step that also carries prompt
        # chunks runs them in one eager launch next to the decode graph.
        self.cuda_graphs: CudaGraphRunner | None = None
        if not config.enforce_eager and CudaGraphRunner.supported(self.device, self.backend):
            self.cuda_graphs = CudaGraphRunner(
                self.model,
                self.kv_caches,
                self.backend,
                capture_sizes(config.max_num_seqs),
                self.input_batch,
            )
            with torch.inference_mode():
                self.cuda_graphs.capture()
        # CPU with --cpu-compile: every step runs the inductor-compiled forward (worker/cpu_compile.py).
        self.cpu_compiled: CompiledCpuForward | None = None
        if config.cpu_compile and not config.enforce_eager and CompiledCpuForward.supported(self.device):
            # With dense weight copies or dequantize-then-GEMM the linears have two branches
            # (below / above the row threshold): both are compiled, and guards stay on to pick.
            # Modules on int8 activations have one branch: no extra size, guards skipped.
            from worker.model.cpu_paths import row_thresholds

            warm_sizes = tuple(sorted({2, *row_thresholds(self.model)}))
            self.cpu_compiled = CompiledCpuForward(
                self.model, self.kv_caches, self.backend, self.block_size, warm_sizes
            )
            if not self.cpu_compiled.warmup():
                self.cpu_compiled = None
        # CPU, int4 / int8 layers: the decoder layers of a step in one C++ op (worker/kernels/cpu_layers.py).
        self.cpu_layers: CpuLayerStack | None = None
        if config.cpu_layer_op and self.cpu_compiled is None and self.device.type == "cpu":
            self.cpu_layers, why = CpuLayerStack.build(self.model, self.backend, self.kv_caches)
            log.info("decoder layers as one C++ op: %s", "on" if self.cpu_layers else f"off ({why})")

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        name = self.config.kv_cache_dtype
        if name == "fp8":
            return torch.float8_e4m3fn
        return getattr(torch, self.config.dtype if name == "auto" else name)

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elt = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elt

    def _num_kv_blocks(self) -> int:
        budget, reserve = self.config.kv_cache_bytes, 0
        if self.device.type == "cuda" or budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = int(available_memory_bytes() * self.config.kv_cache_memory_fraction)
            # --lora-dir: room for the run-time adapters, allocated after the pool (an explicit
            # --kv-cache-bytes on CPU is the pool's size as given)
            if self.adapters is not None and (reserve := self.adapters.reserve_bytes(self.config)):
                log.info("KV budget leaves %.1f MiB for run-time LoRA adapters", reserve / 2**20)
        self.lora_reserve = reserve
        num_blocks = (budget - reserve) // self.kv_bytes_per_block
        if num_blocks < 1:
            less = f" less {reserve} for run-time LoRA adapters (--max-lora-adapters x --max-lora-rank)"
            raise ValueError(
                f"KV budget of {budget} bytes{less if reserve else ''} is smaller than one block "
                f"({self.kv_bytes_per_block} bytes)"
            )
        return int(num_blocks)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        self.input_batch.drop(request_id)

    def grammar_counts(self) -> tuple[int, int, int]:
        """So far (worker/grammar.py): constrained generations whose grammar failed mid-way, of
        those the masks that ran over the step budget, and grammar texts compiled."""
        g = self.sampler.grammars
        return g.num_failures, g.num_over_budget, g.num_compiles

    def grammar_matcher(self, grammar: str):
        """A constrained request's llguidance matcher (worker/grammar.py `Grammars.matcher`)."""
        return self.sampler.grammars.matcher(grammar)

    def constrain(self, seq) -> None:
        """A constrained request's matcher, on its sequence (worker/grammar.py `Grammars.constrain`)."""
        self.sampler.grammars.constrain(seq)

    def prepare(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Eager inputs of a plan from the persistent batch state (worker/input_batch.py)."""
        step = self.input_batch.build(plan)
        return (*self.input_batch.eager_inputs(step), step.logits_rows)

    def prepare_reference(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The slow reference of `prepare`: every input rebuilt from Python lists."""
        return reference_inputs(plan, self.block_size, self.device)

    def run(self, plan: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        """One step: {request_id: (token, logprob | None)} of the sampling sequences (a plan without
        drafts: a drafted one's kept drafts come with `launch`'s `SampledTokens.accepted`)."""
        assert not plan.drafted, "a plan with drafts: launch() returns the drafts it kept"
        return self.launch(plan).to_host()

    @torch.inference_mode()
    def launch(
        self, plan: SchedulerOutput, prev: SampledTokens | None = None, feeds: frozenset[str] = frozenset()
    ) -> SampledTokens:
        """Queue one step on the device; its tokens stay there (`SampledTokens`). `feeds`: requests
        whose token at their step start is a placeholder for what `prev` (the step before, still
        maybe running) sampled: read from `prev.tokens` on the device, no host sync (async
        scheduling). On CPU the step has run when this returns."""
        if torch.get_num_threads() != self.config.num_threads:
            # Another runner in this process (tests) changed torch's global pool; the compiled
            # step also guards on it.
            torch.set_num_threads(self.config.num_threads)
        for seq in plan.preempted:
            self.input_batch.drop(seq.request_id)
        feed = None
        if feeds:
            assert prev is not None, "placeholders to feed without the step that samples them"
            rows = prev.rows  # {request_id: row}, built once per step
            feed = (prev.tokens, {rid: rows[rid] for rid in feeds})
        reads = [(i, s) for i, s in enumerate(plan.scheduled) if s.seq.reads_prompt]  # mostly none
        scored, pooled = scored_chunks(reads), pooled_chunks(reads)
        # structured output: the constrained rows' masks are computed beside the forward pass
        if constrained := [s.seq for s in plan.scheduled if s.samples and s.seq.matcher is not None]:
            self.sampler.grammars.start(constrained)
        hidden, sampling, (prompt, sums) = self._forward(plan, feed, scored, pooled)
        if not sampling:
            out = SampledTokens([], torch.empty(0, dtype=torch.int64, device=self.device))
        elif plan.drafted:  # speculative decoding: keep the drafts the sampled rows confirm
            drafts = {s.seq.request_id: s.draft for s in plan.scheduled if s.draft}
            out = self.sampler.verify(self._sample(sampling, hidden, drafted=True), drafts)
        else:
            out = self._sample(sampling, hidden)
        out.prompt, out.pool_sums = prompt, sums
        out.embeddings = last_rows(hidden, sampling) if reads and sampling else []
        return out

    def _forward(
        self, plan: SchedulerOutput, feed=None, scored: list[tuple[int, ScheduledSeq]] = (), pooled=()
    ) -> tuple[torch.Tensor, list, tuple[list, list]]:
        """Hidden states of the sampling rows (S, C), their sequences in the same order, and what
        the step read off prompt rows: the prompt logprobs of the `scored` (index in the plan,
        share) chunks (worker/prompt_logprobs.py) and the row sums of the `pooled` ones
        (worker/pooling.py)."""
        batch = self.input_batch
        graphs = self.cuda_graphs
        tokens, rows = feed if feed is not None else (None, None)
        lora = self.adapters.slots(plan) if self.adapters is not None else None  # None: no adapter row
        if graphs is not None and not scored and not pooled:  # these run eager
            # decode rows of the base model replay their graph (captured without adapter deltas)
            decode = [
                s for i, s in enumerate(plan.scheduled) if s.num_new_tokens == 1 and not (lora and lora[i])
            ]
            size = bucket_for(len(decode), graphs.sizes) if decode else None
            if size is not None and len(decode) == len(plan.scheduled):
                step = batch.build(plan, feed=rows)
                hidden = graphs.run(step, size, tokens)
                return (
                    take_rows(hidden, step.sample_seq_idx),
                    [plan.scheduled[i].seq for i in step.sample_seq_idx],
                    ([], []),
                )
            if size is not None:
                # Mixed step: the prompt chunks and the LoRA rows in one eager launch, the base
                # decode rows in their graph (distinct sequences: neither reads what the other writes).
                live = {s.seq.request_id for s in plan.scheduled}
                graphed = {id(s) for s in decode}
                kept = [i for i, s in enumerate(plan.scheduled) if id(s) not in graphed]
                eager = SchedulerOutput([plan.scheduled[i] for i in kept])
                pstep = batch.build(eager, live, feed=rows)
                input_ids, positions, meta = batch.eager_inputs(pstep, tokens)
                slots = [lora[i] for i in kept] if lora is not None else []
                with (
                    self.adapters.active(slots, pstep.query_start_loc)
                    if any(slots)
                    else contextlib.nullcontext()
                ):
                    h_p = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
                dstep = batch.build(SchedulerOutput(decode), live, feed=rows)
                h_d = take_rows(graphs.run(dstep, size, tokens), dstep.sample_seq_idx)
                seqs = [eager.scheduled[i].seq for i in pstep.sample_seq_idx]
                seqs += [decode[i].seq for i in dstep.sample_seq_idx]
                return torch.cat([take_rows(h_p, pstep.logits_rows), h_d]), seqs, ([], [])
        step = batch.build(plan, feed=rows)
        input_ids, positions, meta = batch.eager_inputs(step, tokens)
        if lora is not None:  # LoRA rows: the C++ op adds their deltas, else the wrappers (eager)
            with self.adapters.active(lora, step.query_start_loc):
                if self.cpu_layers is not None:
                    hidden = self.cpu_layers(input_ids, positions, meta, self.adapters.op_inputs())
                else:
                    hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        elif self.cpu_compiled is not None:
            hidden = self.cpu_compiled(input_ids, positions, meta)  # (T, C)
        elif self.cpu_layers is not None:
            hidden = self.cpu_layers(input_ids, positions, meta)  # (T, C), the same as self.model's
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)  # (T, C)
        starts = step.query_start_loc
        prompt = score_prompt_rows(self.model, hidden, starts, scored) if scored else []
        sums = chunk_sums(hidden, starts, pooled) if pooled else []
        seqs = [plan.scheduled[i].seq for i in step.sample_seq_idx]
        return take_rows(hidden, step.logits_rows), seqs, (prompt, sums)

    def _sample(self, sampling: list, hidden: torch.Tensor, drafted: bool = False) -> SampledTokens:
        def logits(upcast: bool) -> torch.Tensor:
            return self.model.compute_logits(hidden, upcast=upcast)

        return self.sampler.sample(sampling, logits, self.logits_observer, drafted)
