"""The perplexity arithmetic of `make eval` (benchmarks/ppl_method.py) with known answers: an oracle
with a fixed probability, an all-zero model = uniform = vocabulary size, llama.cpp's uncertainty
formula, a tiny random model against transformers' logits, the bundled text as read; the verdict
and the report table (benchmarks/eval_ppl.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import eval_ppl as ev
from benchmarks import ppl_method as pm

# ------------------------------------------------------------------ perplexity arithmetic


def _oracle(p: float, vocab: int):
    """logits_fn giving probability p to the true next token (its input knows the chunk)."""

    def fn(ids, first):
        n = len(ids)
        logits = torch.full((n - 1 - first, vocab), math.log((1 - p) / (vocab - 1)), dtype=torch.float64)
        for row, pos in enumerate(range(first, n - 1)):
            logits[row, ids[pos + 1]] = math.log(p)
        return logits

    return fn


def test_perplexity_of_an_oracle_is_one_over_its_probability():
    tokens = [(7 * i + 3) % 50 for i in range(64 * 3 + 17)]  # 3 chunks of 64, tail of 17 dropped
    result = pm.perplexity(tokens, 64, _oracle(0.25, 50))
    assert result.ppl == pytest.approx(4.0, rel=1e-9)
    assert result.uncertainty < 1e-6  # every token the same NLL: no spread
    assert result.num_chunks == 3 and result.count == 3 * (64 - 32 - 1)
    assert result.chunk_ppls == pytest.approx([4.0] * 3)


def test_scoring_uses_the_second_half_of_each_chunk_against_the_next_token():
    n_ctx = 16
    tokens = list(range(40))
    seen = []

    def record(ids, first):
        seen.append((ids, first))
        return torch.zeros(n_ctx - first - 1, 64)

    pm.perplexity(tokens, n_ctx, record)
    assert [s[0] for s in seen] == [tokens[0:16], tokens[16:32]] and all(f == 8 for _, f in seen)
    assert pm.scored_targets(tokens, 1, n_ctx) == tokens[16 + 9 : 32]
    assert pm.chunk_input(tokens, 1, n_ctx, bos_id=1)[:2] == [1, 17]
    with pytest.raises(ValueError):
        pm.num_chunks(31, 16)
    assert pm.num_chunks(32, 16) == 2 and pm.num_chunks(47, 16) == 2


def test_uncertainty_is_llamacpps_formula():
    # half the tokens at p = 0.5, half at p = 0.125: NLL ln2 and ln8
    def fn(ids, first):
        rows = len(ids) - 1 - first
        logits = torch.zeros(rows, 8, dtype=torch.float64)
        for row in range(rows):
            target = ids[first + row + 1]
            if row % 2 == 0:
                logits[row, target] = math.log(7.0)  # 7 / (7 + 7) = 0.5
        return logits

    tokens = [i % 8 for i in range(2 * 10)]
    result = pm.perplexity(tokens, 10, fn)  # 2 chunks x 4 scored tokens
    nll = [math.log(2), math.log(8)] * 4
    mean = sum(nll) / 8
    var = sum(v * v for v in nll) / 8 - mean * mean
    assert result.count == 8
    assert result.ppl == pytest.approx(math.exp(mean))
    assert result.uncertainty == pytest.approx(math.exp(mean) * math.sqrt(var / 7))


def _tiny_config(vocab=96):
    from worker.config import ModelConfig

    return ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position=256,
    )


def test_an_all_zero_model_has_the_vocabulary_size_as_perplexity():
    from worker.model.llama import LlamaModel

    model = LlamaModel(_tiny_config(96)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.reset_rope()
    result = pm.perplexity(list(range(80)), 32, pm.ModelScorer(model, "float32"))
    assert result.ppl == pytest.approx(96.0, rel=1e-6) and result.count == 2 * 15


def test_model_scorer_matches_transformers_on_a_tiny_random_model(tmp_path):
    from tests.tiny_llama import save_tiny
    from worker.model.loader import load_model

    path, hf = save_tiny(tmp_path, "llama3")
    ours = load_model(path, "float32", "cpu")
    scorer = pm.ModelScorer(ours.model, "float32")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2 * 48 + 5,), generator=gen).tolist()
    result = pm.perplexity(tokens, 48, scorer)
    # independent answer: transformers' logits per chunk, torch's cross entropy on the second half
    losses = []
    with torch.no_grad():
        for i in range(2):
            chunk = tokens[i * 48 : (i + 1) * 48]
            logits = hf(torch.tensor([chunk])).logits[0]
            assert torch.allclose(scorer(chunk, 24), logits[24:47], rtol=1e-4, atol=1e-4)
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits[24:47].double(), torch.tensor(chunk[25:48]), reduction="none"
                )
            )
    expected = math.exp(float(torch.cat(losses).mean()))
    assert result.ppl == pytest.approx(expected, rel=1e-5) and result.count == 2 * 23


def test_eval_verdict_and_table():
    rows = [
        {
            "label": "float32",
            "ppl": 20.0,
            "uncertainty": 0.5,
            "count": 100,
            "seconds": 1.0,
            "weights_mib": {"float32": 500.0},
        },
        {
            "label": ev.VARIANTS[2][0],
            "ppl": 20.1,
            "uncertainty": 0.5,
            "count": 100,
            "seconds": 1.0,
            "weights_mib": {"bfloat16": 100.0, "uint8": 60.0},
        },
    ]
    assert ev.verdict(rows) == "quantized vs float32: +0.50% (target within 1%: met)"
    rows[1]["ppl"] = 20.4
    assert ev.verdict(rows) == "quantized vs float32: +2.00% (target within 1%: NOT met)"
    assert ev.verdict(rows[:1] + [{"label": ev.VARIANTS[2][0], "error": "boom"}]).endswith("(a row failed)")
    served = {**rows[1], "label": ev.SERVED, "ppl": 20.16}
    served["cpu_paths"] = {"int8_activation_modules": 121, "dequant_gemm_modules": 0, "dense_copy_bytes": 0}
    assert ev.verdict([*rows, served]) == (
        "quantized vs float32: +0.80% (target within 1%: met); bf16-activation kernels +2.00%"
    )
    assert ev.verdict([*rows, {"label": ev.SERVED, "error": "boom"}]).endswith("(a row failed)")
    run = {
        "machine": {"cpu": "AMD EPYC", "cores": 2},
        "rows": rows,
        "date": "d",
        "commit": "c",
        "model_name": "m",
        "model": "/x/m.gguf",
        "text": "t.txt",
        "text_bytes": 10,
        "num_tokens": 5000,
        "n_ctx": 512,
        "num_chunks": 9,
        "threads": 2,
        "verdict": ev.verdict(rows),
        "command": "python -m x",
        "json": "results/eval_ppl/x.json",
    }
    md = ev.report_markdown(run)
    assert md.startswith("## Perplexity (make eval)")
    assert "| quantized (bf16, auto) | 20.4000 | 0.5000 | +2.00% | 100 |" in md
    assert "uint8 60 MiB" in md
    md = ev.report_markdown({**run, "rows": [*rows, served]})
    assert "| quantized as served (CPU paths) | 20.1600 |" in md
    assert "int8 activations in 121 modules, dequantize-then-GEMM in 0 |" in md


def test_bundled_text_is_long_enough_and_read_like_llama_perplexity(tmp_path):
    text = pm.read_text(ev.TEXT)
    assert 20_000 <= len(text.encode()) <= 50_000 and not text.endswith("\n")
    f = tmp_path / "t.txt"
    f.write_text("a\n\n")
    assert pm.read_text(f) == "a\n"
