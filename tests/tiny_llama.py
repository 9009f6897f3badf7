"""The tiny random Llama shape the kernel, graph and quantization tests share: 2 layers, GQA 4/2,
head_dim 16, hidden 64, vocabulary 128 (tied embeddings); and `save_tiny`, the same size saved by
transformers as a Hugging Face safetensors directory (Llama with llama3 RoPE scaling and an untied
lm_head, plain Llama, or Qwen2 with q/k/v bias and tied embeddings; other head counts for the
tensor-parallel tests), for the loader and engine tests."""

import torch

from worker.config import ModelConfig

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=256,
)


def save_tiny(tmp_path, kind: str, num_heads: int = 4, num_kv_heads: int = 2, tie: bool | None = None):
    """A random transformers model of `kind` (seed 0) saved under tmp_path / kind: (path, the model).
    kind: "llama3" (llama3 RoPE scaling), "llama" (plain RoPE) or "qwen2" (q/k/v bias). Embeddings
    tied by default for qwen2 only (`tie` overrides)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=127,
        tie_word_embeddings=(kind == "qwen2") if tie is None else tie,
    )
    if kind == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif kind == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        config, cls = LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0), LlamaForCausalLM
    model = cls(config).eval()
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def record_graph_replays(runner, sizes: list[int], stand_in: bool) -> None:
    """Count the runner's decode-graph replays into `sizes` (the bucket of each); with `stand_in`
    (CPU) first give it the CPU stand-in for CUDA graphs: the static-buffer forward, 4 sequences."""
    from worker.cuda_graphs import CudaGraphRunner, capture_sizes

    if stand_in:
        runner.cuda_graphs = CudaGraphRunner(
            runner.model, runner.kv_caches, runner.backend, capture_sizes(4), runner.input_batch
        )
        runner.cuda_graphs.eager_replay = True
    replay = runner.cuda_graphs.run

    def run(step, size, tokens=None):
        sizes.append(size)
        return replay(step, size, tokens)

    runner.cuda_graphs.run = run


def arrivals_on_graphs_and_eager(prompts: list[list[int]], params_for, read) -> dict[bool, dict[str, dict]]:
    """The same arrivals through the eager runner and the decode-graph runner (its CPU stand-in) on
    the TINY model: one request per step (`params_for(i)`), so prompt chunks keep joining running
    decodes; `read(record, output)` files each output into its request's record ({"tokens": [...]}
    to begin with). {graphs on: {request id: record}}; checks that the graph runner replayed a graph
    and that every KV block came back."""
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.model.llama import LlamaModel
    from worker.model_runner import ModelRunner

    results = {}
    for graphs_on in (False, True):
        torch.manual_seed(0)
        model = LlamaModel(TINY).eval()
        config = EngineConfig(kv_cache_bytes=2**20, max_num_seqs=4, max_num_batched_tokens=16)
        runner = ModelRunner.from_model(config, model)
        replays: list[int] = []
        if graphs_on:
            record_graph_replays(runner, replays, stand_in=True)
        engine = LLMEngine(config, runner=runner)
        out: dict[str, dict] = {}
        pending = list(enumerate(prompts))
        with torch.inference_mode():
            while pending or engine.has_unfinished_requests():
                if pending:
                    i, prompt = pending.pop(0)
                    engine.add_request(f"r{i}", prompt, params_for(i))
                for o in engine.step():
                    record = out.setdefault(o.request_id, {"tokens": []})
                    record["tokens"] += o.new_token_ids
                    read(record, o)
        results[graphs_on] = out
        if graphs_on:
            assert replays, "no decode step replayed a graph"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    eager, graphs = results[False], results[True]
    assert {rid: r["tokens"] for rid, r in graphs.items()} == {rid: r["tokens"] for rid, r in eager.items()}
    return results
