"""`make bench-gpu` stays runnable: its --smoke mode (tiny sizes, CPU with Triton interpreted)
runs end to end (copy, paged attention, fused norm/RoPE, engine vs transformers) and writes the
tables, and it needs nothing that the GPU machine lacks.

The GPU machine has torch, triton and transformers but not gguf, tokenizers, jinja2 or safetensors;
each test runs the script in a subprocess where those imports fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, blocked: tuple[str, ...], env: dict | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_smoke_run_writes_tables(tmp_path):
    proc = run_python("import runpy\nsys.argv = ['gpu_bench', '--smoke']\n"
                      "runpy.run_module('benchmarks.gpu_bench', run_name='__main__')",
                      blocked=("gguf", "tokenizers", "jinja2"), env={"OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench_smoke.json").read_text())
    table = (tmp_path / "gpu_bench_smoke.md").read_text()
    assert table in proc.stdout
    assert res["smoke"] and res["model"]["name"] == "random-tiny"
    assert res["copy"]["gbps"] > 0

    assert [(r["batch_size"], r["context_len"]) for r in res["attention"]] == \
        [(1, 32), (1, 80), (2, 32), (2, 80)]
    for row in res["attention"]:
        assert row["paged_us"] > 0 and row["sdpa_us"] > 0 and 0 < row["copy_fraction"]
        assert row["kv_bytes"] == 2 * row["batch_size"] * row["context_len"] * 2 * 16 * 4
        assert row["max_rel_err_vs_sdpa"] < 1e-4        # paged kernel == SDPA on the same K/V
    assert "| batch | context | K/V MiB | paged us | paged GB/s | % of copy |" in table

    # Fused RMSNorm(+residual) and RoPE kernels timed against the model's torch code, same results.
    assert [r["tokens"] for r in res["fused"]] == [1, 8]
    for row in res["fused"]:
        assert min(row[f"{op}_{side}_us"] for op in ("norm", "rope") for side in ("torch", "fused")) > 0
        assert row["max_rel_err"] < 1e-5, row
    assert "| tokens | norm torch | norm fused | speedup |" in table

    engine_sides = ["graphs", "eager"] if torch.cuda.is_available() else ["eager"]
    assert [r["batch_size"] for r in res["engine"]] == [1, 2]
    for row in res["engine"]:
        for side in engine_sides + ["hf"]:
            assert row[side]["e2e_tok_s"] > 0 and row[side]["t_n_s"] > 0, (side, row)
        # float32, same random weights: greedy tokens equal transformers' own generate.
        assert row["agreement_vs_hf"]["identical"] == row["agreement_vs_hf"]["requests"] == row["batch_size"]
    assert not [k for k in res["engine_setup"] if k.endswith("_error")], res["engine_setup"]
    assert "| batch | graphs decode | eager decode | HF decode |" in table


def test_engine_side_needs_no_optional_packages():
    """Without safetensors even transformers fails to import; our side must still build and run."""
    code = """
import torch
from benchmarks import gpu_bench
from worker.engine import LLMEngine
from worker.config import EngineConfig
from worker.model_runner import ModelRunner
from worker.types import SamplingParams
model, hf, why = gpu_bench.build_models(gpu_bench.TINY, torch.float32, torch.device("cpu"))
config = EngineConfig(kv_cache_bytes=2**20, attention_backend="torch")
engine = LLMEngine(config, runner=ModelRunner.from_model(config, model))
[out] = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
print(len(out), hf is None, why)
"""
    proc = run_python(code, blocked=("gguf", "tokenizers", "jinja2", "safetensors"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    num_tokens, hf_missing, why = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert num_tokens == "3"
    if hf_missing == "True":
        assert why.startswith("transformers unavailable"), why


def test_gpu_session_tests_need_no_server_packages():
    """`make gpu-session` runs these test modules (and tests/conftest.py) on the GPU machine,
    which lacks the server-side packages (gRPC health/reflection, OpenTelemetry, Ray, gguf)."""
    code = ("import tests.conftest, tests.test_kernels, tests.test_cuda_graphs\n"
            "print('imported')")
    proc = run_python(code, blocked=("gguf", "opentelemetry", "ray", "grpc_health", "grpc_reflection",
                                     "cryptography", "tokenizers", "jinja2", "safetensors"),
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("imported")
