"""`make bench-gpu` stays runnable: its --smoke mode (tiny sizes, CPU with Triton interpreted)
runs end to end (read-only and copy bandwidth, paged attention, fused norm/RoPE, engine vs
transformers eager and static-cache + torch.compile, HBM roofline) and writes the tables, and it
needs nothing that the GPU machine lacks. The real-checkpoint check (graphs vs eager on SmolLM2)
runs at tiny size in-process, and is skipped with a reason where the GGUF cannot be loaded.

The GPU machine has torch, triton and transformers but not gguf, tokenizers, jinja2, safetensors,
prometheus_client or llguidance; each test runs the script in a subprocess where those imports fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_python(
    code: str, blocked: tuple[str, ...], env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    # One torch thread (the engine's default follows OMP_NUM_THREADS): test processes run side by
    # side on two cores, where OpenMP barriers under CPU steal made tiny ops up to 10x slower.
    return subprocess.run(
        [sys.executable, "-c", f"import sys\n{block}{code}"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_smoke_run_writes_tables(tmp_path):
    proc = run_python(
        "import runpy\nsys.argv = ['gpu_bench', '--smoke']\n"
        "runpy.run_module('benchmarks.gpu_bench', run_name='__main__')",
        blocked=("gguf", "tokenizers", "jinja2", "prometheus_client", "llguidance"),
        env={"OUT": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench_smoke.json").read_text())
    table = (tmp_path / "gpu_bench_smoke.md").read_text()
    assert table in proc.stdout
    assert res["smoke"] and res["model"]["name"] == "random-tiny"
    assert not res.get("section_errors"), res["section_errors"]
    assert res["copy"]["gbps"] > 0
    # Read-only bandwidth: torch's sum and the Triton read kernel, both checked against float64.
    read = res["read"]
    for kernel in ("torch_sum", "triton_read"):
        assert read[kernel]["gbps"] > 0 and read[kernel]["rel_err"] < 1e-5, read
    assert read["gbps"] == max(read["torch_sum"]["gbps"], read["triton_read"]["gbps"])

    assert [(r["batch_size"], r["context_len"]) for r in res["attention"]] == [
        (1, 32),
        (1, 80),
        (2, 32),
        (2, 80),
    ]
    for row in res["attention"]:
        assert row["paged_us"] > 0 and row["sdpa_us"] > 0 and 0 < row["copy_fraction"]
        assert row["read_fraction"] == row["paged_gbps"] / read["gbps"]
        assert row["kv_bytes"] == 2 * row["batch_size"] * row["context_len"] * 2 * 16 * 4
        assert row["max_rel_err_vs_sdpa"] < 1e-4  # paged kernel == SDPA on the same K/V
    assert "| batch | context | K/V MiB | paged us | paged GB/s | % of read BW | % of copy |" in table
    assert "Read-only bandwidth: **" in table

    # Fused RMSNorm(+residual) and RoPE kernels timed against the model's torch code, same results.
    assert [r["tokens"] for r in res["fused"]] == [1, 8]
    for row in res["fused"]:
        ops = ("norm", "rope", "silu")
        assert min(row[f"{op}_{side}_us"] for op in ops for side in ("torch", "fused")) > 0
        assert row["max_rel_err"] < 1e-5, row
        # RoPE + store_kv as two launches vs one, and the two-pass greedy argmax vs torch's.
        assert min(row["ropekv_pair_us"], row["ropekv_fused_us"], row["argmax_triton_us"]) > 0, row
        assert row["argmax_rows"] == row["tokens"] and row["argmax_equal"] is True, row
    assert "| tokens | norm torch | norm fused | speedup |" in table

    # gguf is blocked here (as on the GPU machine without the carried payload): skipped, with why.
    assert "gguf" in res["checkpoint"]["skipped"], res["checkpoint"]
    assert "Real checkpoint (graphs vs eager): no checkpoint here" in table

    engine_sides = ["graphs", "eager"] if torch.cuda.is_available() else ["eager"]
    assert [r["batch_size"] for r in res["engine"]] == [1, 2]
    for row in res["engine"]:
        for side in engine_sides + ["hf", "hf_compiled"]:
            assert row[side]["e2e_tok_s"] > 0 and row[side]["t_n_s"] > 0, (side, row)
        # float32, same random weights: greedy tokens equal transformers' own generate, eager and
        # static cache + compiled forward alike.
        for key in ("agreement_vs_hf", "agreement_vs_hf_compiled", "hf_compiled_vs_hf"):
            assert row[key]["identical"] == row[key]["requests"] == row["batch_size"], (key, row)
    setup = res["engine_setup"]
    assert not [k for k in setup if k.endswith("_error")], setup
    assert setup["hf_compiled_dynamo_graphs"] >= 1, setup  # generate really ran a compiled forward
    assert setup["hf_compiled_warmup_s"] > 0
    assert "| batch | graphs decode | eager decode | HF decode | HF compiled decode |" in table

    # Roofline: weights (tied embedding once) + K/V at the mean decode context, per batch size.
    cfg = res["model"]
    weights = 4 * (
        cfg["vocab_size"] * cfg["hidden_size"]
        + cfg["hidden_size"]
        + cfg["num_layers"]
        * (
            2 * cfg["hidden_size"]
            + cfg["hidden_size"] * (cfg["num_heads"] + 2 * cfg["num_kv_heads"]) * cfg["head_dim"]
            + cfg["num_heads"] * cfg["head_dim"] * cfg["hidden_size"]
            + 3 * cfg["hidden_size"] * cfg["intermediate_size"]
        )
    )
    kv_per_token = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * 4
    roof = res["roofline"]
    assert roof["read_gbps"] == read["gbps"] and roof["mean_context"] == 8 + 3 / 2
    for row in roof["rows"]:
        assert row["weight_bytes"] == weights
        assert row["kv_bytes"] == row["batch_size"] * roof["mean_context"] * kv_per_token
        for side in ("graphs", "eager"):
            if side in row:
                assert row[side]["roofline_fraction"] == pytest.approx(
                    row["bytes_per_step"] / (row[side]["step_ms"] / 1e3) / 1e9 / read["gbps"]
                )
    assert "**Engine decode vs the HBM roofline**" in table

    # Mixed-step graphs vs eager on the checkpoint (benchmarks/gpu_mixed.py): skipped, with why.
    assert "gguf" in res["mixed_checkpoint"]["skipped"], res["mixed_checkpoint"]
    assert "Real checkpoint, mixed steps (graphs vs eager): no checkpoint here" in table

    # Steady serving (benchmarks/gpu_steady.py): lockstep, then Poisson arrivals; no KV block leaks.
    steady = res["steady"]
    assert steady["lockstep"]["saturation_req_s"] > 0 and steady["kv_blocks_leaked"] == 0
    for rate in steady["rates"]:
        assert rate["requests"] >= 2 and rate["output_tok_s"] > 0, rate
        assert rate["itl_p50_ms"] > 0 and rate["ttft_p50_ms"] > 0 and rate["mean_running"] > 0, rate
    # the highest load again with async scheduling: overlapped steps, nothing leaked, in the table
    row = steady["async"]
    assert row["overlapped_steps"] > 0 and row["kv_blocks_leaked"] == 0 and row["output_tok_s"] > 0, row
    assert "**Steady serving**" in table and "% async |" in table
    # FP8: bf16, fp8 weights, fp8 weights + KV at two batch sizes; the checkpoint part says why not.
    speed = res["fp8"]["speed"]
    assert [(r["variant"], r["batch_size"]) for r in speed] == [
        (v, b) for v in ("bf16", "fp8 ch torch-act", "fp8 ch", "fp8", "fp8+kv") for b in (1, 2)
    ]
    assert all(r["t_n_s"] > 0 for r in speed)
    assert "gguf" in res["fp8"]["checkpoint"]["skipped"]
    assert "| variant | batch | decode step ms | decode tok/s | speedup vs bf16 |" in table
    # LoRA (benchmarks/gpu_lora.py): base, adapter and half-and-half rows timed; nothing leaked.
    lora = res["lora"]
    assert [r["batch_size"] for r in lora["rows"]] == [2] and lora["kv_blocks_leaked"] == 0
    assert lora["adapter_mib"] > 0 and not lora["cuda_graphs"]  # CPU: eager
    for work in ("base", "adapter", "half"):
        assert lora["rows"][0][work]["graph_replays_per_step"] == 0, lora
    assert "**LoRA**" in table and "| adapter / base | half / base |" in table
    # Decode-step kernels (benchmarks/gpu_decode.py): GEMV and fused sampling alone, then in the engine.
    decode = res["decode"]
    assert [(r["shape"], r["rows"]) for r in decode["gemv"]] == [
        (s, m) for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for m in (1, 2)
    ]
    assert all(r["gemv_rel_err"] < 1e-5 and r["gemv_us"] > 0 for r in decode["gemv"])
    assert [(r["batch"], r["same_tokens"]) for r in decode["sampling"]] == [(1, True), (2, True)]
    assert [(r["variant"], r["batch_size"]) for r in decode["engine"]] == [
        ("cublas", 1),
        ("cublas", 2),
        ("sampled torch", 2),
        ("sampled fused", 2),
        ("async", 1),
        ("async", 2),
        ("triton gemv", 1),
        ("triton gemv", 2),
        ("triton gemv + async", 1),
        ("triton gemv + async", 2),
    ]
    # Ran (3 output tokens on a busy CPU may time t_N <= t_1: then no step time, and no roofline).
    for r in decode["engine"]:
        assert r["t_n_s"] > 0 and (r["roofline"] is None) == (r["decode_step_ms"] is None), r
    assert "**Decode-step kernels**" in table and "| triton gemv + async | 2 |" in table


def test_checkpoint_check_graphs_vs_eager_runs(tmp_path, monkeypatch):
    """The real-checkpoint section at tiny size on CPU (both sides eager there): loads SmolLM2,
    tokenizes text prompts, runs both engines and compares their greedy tokens."""
    from benchmarks.gpu_bench import SMOKE
    from benchmarks.gpu_checkpoint import checkpoint_markdown, checkpoint_section

    # The engines' default thread count follows OMP_NUM_THREADS: one, as run_python's (measured
    # beside another test process: 0.8 s per engine instead of 3.6-17 s with two threads).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    res: dict = {}
    try:
        checkpoint_section(res, SMOKE, torch.device("cpu"), float("inf"), lambda: None)
    finally:
        torch.set_num_threads(threads)  # the engines set the process-wide pool
    c = res["checkpoint"]
    assert "skipped" not in c, c
    assert c["prompts"].startswith("text") and c["requests"] == 2 and c["max_tokens"] == [2, 3]
    assert c["identical"] == 2 and c["output_tokens"] == 5 and c["first_divergence"] == [None, None]
    assert not c["graphs_uses_cuda_graphs"]
    assert "**2/2 token-identical**" in "\n".join(checkpoint_markdown(res))


def test_engine_side_needs_no_optional_packages():
    """Without safetensors even transformers fails to import; our side must still build and run."""
    code = """
import torch
from benchmarks.gpu_bench import TINY
from benchmarks.gpu_engine import build_models
from worker.engine import LLMEngine
from worker.config import EngineConfig
from worker.model_runner import ModelRunner
from worker.types import SamplingParams
model, hf, why = build_models(TINY, torch.float32, torch.device("cpu"))
config = EngineConfig(kv_cache_bytes=2**20, attention_backend="torch", enforce_eager=True)
engine = LLMEngine(config, runner=ModelRunner.from_model(config, model))
[out] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
print(len(out), hf is None, why)
"""
    proc = run_python(
        code, blocked=("gguf", "tokenizers", "jinja2", "safetensors", "llguidance"), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    num_tokens, hf_missing, why = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert num_tokens == "3"
    if hf_missing == "True":
        assert why.startswith("transformers unavailable"), why


def test_gpu_session_tests_need_no_server_packages():
    """`make gpu-session` runs these test modules (and tests/conftest.py) on the GPU machine,
    which lacks the server-side packages (gRPC health/reflection, OpenTelemetry, Ray, gguf)."""
    code = "import tests.conftest, tests.test_kernels, tests.test_cuda_graphs\nprint('imported')"
    proc = run_python(
        code,
        blocked=(
            "gguf",
            "opentelemetry",
            "ray",
            "grpc_health",
            "grpc_reflection",
            "cryptography",
            "tokenizers",
            "jinja2",
            "safetensors",
            "llguidance",
        ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("imported")
