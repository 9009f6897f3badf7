"""The logic of `make bench-serve` and `make eval` without llama.cpp or a server: the docs section
replacement, the ratio maths, the load tester's command line and summaries as the harness reads
them, llama.cpp output parsing, and the perplexity arithmetic with known answers (an oracle with a
fixed probability, an all-zero model = uniform = vocabulary size, a tiny random model against
transformers' logits).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from benchmarks import bench_serve as bs
from benchmarks import eval_ppl as ev
from benchmarks import llamacpp as lc
from benchmarks import report

# ------------------------------------------------------------------ docs sections


def test_replace_section_appends_then_replaces_only_its_own():
    doc = "# Benchmarks\n\nintro\n\n## Other\n\nkeep me\n"
    once = report.replace_section(doc, "CPU serving vs llama.cpp", "## CPU serving vs llama.cpp\n\nv1\n")
    assert once == doc + "\n## CPU serving vs llama.cpp\n\nv1\n"
    tail = once + "\n## Later\n\n```\n## not a heading inside a fence\n```\nlast\n"
    twice = report.replace_section(tail, "CPU serving vs llama.cpp", "## CPU serving vs llama.cpp\n\nv2\n")
    assert "v1" not in twice and "v2" in twice
    assert "keep me" in twice and "## Later" in twice and "## not a heading inside a fence" in twice
    assert twice.index("## Other") < twice.index("v2") < twice.index("## Later")
    # rerun with the same body: unchanged
    same = report.replace_section(twice, "CPU serving vs llama.cpp", "## CPU serving vs llama.cpp\n\nv2\n")
    assert same == twice


def test_write_section_creates_the_file_and_keeps_other_sections(tmp_path):
    path = tmp_path / "docs" / "benchmarks.md"
    report.write_section(path, "A", "## A\n\none\n")
    report.write_section(path, "B", "## B\n\ntwo\n")
    report.write_section(path, "A", "## A\n\nthree\n")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "one" not in text and "three" in text and "two" in text
    assert text.index("## A") < text.index("## B")


# ------------------------------------------------------------------ ratios; loadtest as the harness reads it


def test_ratio_is_ours_over_theirs():
    assert bs.ratio(30.0, 120.0) == pytest.approx(0.25)
    assert bs.format_ratio(30.0, 120.0) == "ratio 0.25x"
    assert bs.format_ratio(250.0, 100.0) == "ratio 2.50x"
    assert bs.format_ratio(None, 1.0) == bs.format_ratio(1.0, 0.0) == "ratio n/a"
    assert bs.format_ratio(1.0, None) == "ratio n/a"


def _record(tenant, index, sent_s, ttft_s, gap_s, n_tokens, status="OK"):
    from loadtest.record import RequestRecord

    r = RequestRecord(tenant, index, False, 0, sent_ns=int(sent_s * 1e9), status=status)
    if status == "OK":
        r.chunk_ns = [int((sent_s + ttft_s + i * gap_s) * 1e9) for i in range(n_tokens)]
        r.chunk_tokens = [1] * n_tokens
        r.completion_tokens, r.prompt_tokens = n_tokens, 100
        r.end_ns = r.chunk_ns[-1]
        r.finish_reason = "length"
    else:
        r.end_ns = int((sent_s + 0.5) * 1e9)
    return r


def test_point_numbers_from_a_real_loadtest_summary():
    """Two requests of 128 tokens, TTFT 0.5 / 1.5 s, 0.1 s / 0.3 s per token: by hand."""
    from loadtest.config import TenantSpec
    from loadtest.summary import summarize_point

    records = [_record("default", 0, 0.0, 0.5, 0.1, 128), _record("default", 1, 0.0, 1.5, 0.3, 128)]
    numbers = bs.point_numbers(summarize_point(records, (TenantSpec(),), {}))
    # window: first send 0 s -> last end 1.5 + 127 * 0.3 = 39.6 s; 256 tokens
    assert numbers["output_tok_s"] == pytest.approx(256 / 39.6)
    assert numbers["tpot_p50_ms"] == pytest.approx(200.0)  # mean of 100 and 300 ms (p50 of two)
    assert numbers["ttft_p50_ms"] == pytest.approx(1000.0)
    assert numbers["mean_output_tokens"] == 128
    assert bs.side_problem(numbers, 128) is None
    assert "shorter" in bs.side_problem(numbers, 129)


def test_side_problems_name_failures_and_silence():
    from loadtest.config import TenantSpec
    from loadtest.summary import summarize_point

    failed = bs.point_numbers(
        summarize_point([_record("default", 0, 0.0, 0, 0, 0, status="UNAVAILABLE")], (TenantSpec(),), {})
    )
    assert "failed" in bs.side_problem(failed, 128) and "UNAVAILABLE" in bs.side_problem(failed, 128)
    assert bs.side_problem(bs.point_numbers({"completed": 0, "failed": 0}), 128) == "no request completed"
    silent = bs.point_numbers({"completed": 2, "failed": 0, "output_tokens": 0, "client_output_tokens": 0})
    assert bs.side_problem(silent, 128) == "no tokens streamed"


def test_loadtest_command_line_is_the_workload_asked_for():
    from loadtest.cli import parse_args

    argv = bs.loadtest_argv("llamacpp=http://127.0.0.1:8080", 8, 3, 45, "uniform:64:256", 128, "/tmp/x")
    config = parse_args(argv)
    [tenant], [target] = config.tenants, config.targets
    assert target.api == "openai" and target.address == "http://127.0.0.1:8080"
    assert tenant.closed_loop and tenant.concurrency == 8
    assert tenant.input_len.kind == "uniform" and tenant.input_len.params == (64, 256)
    assert tenant.output_len.spec == "128" and config.ignore_eos and config.temperature == 0
    assert config.seed == 3 and config.duration_s == 45 and config.warmup_s == 0
    warm = parse_args(
        bs.loadtest_argv("ours=127.0.0.1:1", 32, 0, 0, "uniform:64:256", 8, "/tmp/x", num_requests=32)
    )
    assert warm.num_requests == 32 and warm.targets[0].api == "grpc"


def test_llama_server_context_holds_every_slot():
    assert bs.llama_ctx(32, 256, 128) == 32 * (256 + 128 + 16)
    a = bs.parse_args(["--quick"])
    assert a.concurrency_list == [1, 8, 32] and a.duration_s == bs.QUICK_DURATION_S
    assert a.parallel == 32 and a.max_input == 256
    with pytest.raises(SystemExit):
        bs.parse_args(["--concurrencies", "0"])


def test_report_table_shows_both_sides_and_ratios():
    p = bs.Point(8, 1, ["llama.cpp", "ours"])
    p.sides["ours"] = {
        "output_tok_s": 40.0,
        "tpot_p50_ms": 150.0,
        "ttft_p50_ms": 900.0,
        "completed": 10,
        "cpu": {"other_cores": 0.25},
    }
    p.sides["llama.cpp"] = {"output_tok_s": 160.0, "tpot_p50_ms": 50.0, "ttft_p50_ms": 300.0, "completed": 30}
    [row] = bs.table_rows([p])
    assert row == [
        "8",
        "40.0",
        "160.0",
        "ratio 0.25x",
        "150.0",
        "50.0",
        "ratio 3.00x",
        "900",
        "300",
        "10 / 30",
        "0.2 / –",
    ]
    assert p.ratios() == {"output_tok_s": 0.25, "tpot_p50": 3.0}


def test_saved_run_renders_the_same_section_with_the_busy_machine_caveat(tmp_path, monkeypatch):
    import dataclasses
    import json

    p = bs.Point(1, 0, ["ours", "llama.cpp"])
    p.sides = {
        "ours": {
            "output_tok_s": 50.0,
            "tpot_p50_ms": 19.0,
            "ttft_p50_ms": 200.0,
            "completed": 4,
            "cpu": {"other_cores": 1.2},
        },
        "llama.cpp": {
            "output_tok_s": 100.0,
            "tpot_p50_ms": 9.5,
            "ttft_p50_ms": 100.0,
            "completed": 8,
            "cpu": {"other_cores": 0.1},
        },
    }
    p.commands = {"ours": "python -m loadtest --target ours=<address>"}
    run = {
        "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5, "load_average": [1.0, 1.0, 1.0]},
        "peak_rss_mib": {"worker": 800.0},
        "kv_pool": None,
        "date": "d",
        "quick": True,
        "commit": "c",
        "model_name": "m",
        "threads": 2,
        "llamacpp_version": "0.3.36",
        "input_len": "uniform:64:256",
        "output_len": 128,
        "duration_s": 10,
        "commands": {"ours": ["w", "r"], "llama.cpp": ["l"]},
        "json": "results/bench_serve/x.json",
        "worker_log": [],
        "points": [{**dataclasses.asdict(p), "ratios": p.ratios()}],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    md = bs.report_markdown(run, [p])
    assert "ratio 0.50x" in md and "ratio 2.00x" in md and "Caveat: the machine was shared" in md
    assert "0.1-1.2 of its 2 cores" in md and "python -m loadtest --target ours=<address>" in md
    one_thread = bs.report_markdown({**run, "threads": 1}, [p])
    assert "Caveat" not in one_thread and "neither side waits on a descheduled sibling" in one_thread
    monkeypatch.setattr(bs, "DOCS", tmp_path / "benchmarks.md")
    assert bs.render(path, print) == 0
    assert bs.DOCS.read_text().endswith(md.rstrip("\n") + "\n")
    run["points"][0]["problems"] = {"ours": "no tokens streamed"}
    path.write_text(json.dumps(run))
    assert bs.render(path, print) == 1


def test_kv_pool_is_read_from_the_model_runner_line():
    line = (
        "2026-11-30 12:00:00 worker INFO model Smollm2 loaded in 3.2s; 126620 KV blocks "
        "(2025920 tokens, 5564 MiB), backend torch"
    )
    assert bs.parse_kv_pool(line) == {"blocks": 126620, "tokens": 2025920, "mib": 5564}
    assert bs.parse_kv_pool("worker listening on 127.0.0.1:5") is None


def test_cpu_meter_counts_this_process_as_the_client():
    start, cpu0 = time.monotonic(), time.process_time()
    meter = bs.CpuMeter([])
    before = bs.proc_cpu_s(os.getpid())
    while time.process_time() - cpu0 < 0.2:
        pass  # burn 0.2 s of CPU on purpose: the figure under test
    usage = meter.stop()
    share = (time.process_time() - cpu0) / (time.monotonic() - start)  # cores this process used
    assert bs.proc_cpu_s(os.getpid()) - before >= 0.15
    assert usage["client_cores"] == pytest.approx(share, rel=0.3, abs=0.02) and usage["side_cores"] == 0
    assert usage["busy_cores"] >= 0.5 * usage["client_cores"] and usage["other_cores"] >= 0


def test_rss_sampler_reads_this_process():
    sampler = bs.RssSampler(os.getpid(), interval_s=0.01)
    current = bs.read_status_kib(os.getpid(), "VmRSS")
    peak = sampler.stop()
    assert current and peak is not None and peak * 1024 >= current * 0.5
    assert bs.read_status_kib(2**22 + 12345, "VmRSS") is None


# ------------------------------------------------------------------ llama.cpp output

# llama-perplexity 0.3.36 (stdout and stderr merged, as eval_ppl runs it), 3 chunks of 512
PERPLEXITY_OUTPUT = """0.00.176.819 I cmn          init: llama threadpool init, n_threads = 1
0.00.190.205 I system_info: n_threads = 1 (n_threads_batch = 1) / 2 | CPU : SSE3 = 1 | AVX512 = 1 |
0.00.190.217 I perplexity: tokenizing the input ..
0.00.203.953 I perplexity: tokenization took 13.73 ms
0.00.203.971 I perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.06.751.789 I perplexity: 6.55 seconds per pass - ETA 0.07 minutes
[1]25.1888,[2]25.1419,[3]22.7112,
0.06.883.307 I Final estimate: PPL = 22.7112 +/- 2.38435
"""


def test_llama_perplexity_output_is_parsed():
    assert lc.parse_perplexity(PERPLEXITY_OUTPUT) == (22.7112, 2.38435)
    assert lc.parse_num_chunks(PERPLEXITY_OUTPUT) == 3
    assert lc.parse_chunk_ppls(PERPLEXITY_OUTPUT) == [25.1888, 25.1419, 22.7112]
    with pytest.raises(ValueError):
        lc.parse_perplexity("perplexity: you need at least 1024 tokens")
    with pytest.raises(ValueError):
        lc.parse_num_chunks("perplexity: tokenizing the input ..")


def test_llama_server_command_and_build_cache(tmp_path, monkeypatch):
    server = lc.LlamaServer("/x/llama-server", "/m.gguf", 2, 32, 12800)
    cmd = server.command(port=1234)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "32"
    assert cmd[cmd.index("-c") + 1] == "12800" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setenv(lc.CACHE_ENV, str(tmp_path / "cache"))
    assert lc.cache_dir() == tmp_path / "cache"
    assert lc.find_built(tmp_path / "cache") is None  # nothing built there
    assert "-DGGML_NATIVE=ON" in lc.CMAKE_FLAGS and "-DGGML_AMX_INT8=OFF" in lc.CMAKE_FLAGS


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
    result = ev.perplexity(tokens, 64, _oracle(0.25, 50))
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

    ev.perplexity(tokens, n_ctx, record)
    assert [s[0] for s in seen] == [tokens[0:16], tokens[16:32]] and all(f == 8 for _, f in seen)
    assert ev.scored_targets(tokens, 1, n_ctx) == tokens[16 + 9 : 32]
    assert ev.chunk_input(tokens, 1, n_ctx, bos_id=1)[:2] == [1, 17]
    with pytest.raises(ValueError):
        ev.num_chunks(31, 16)
    assert ev.num_chunks(32, 16) == 2 and ev.num_chunks(47, 16) == 2


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
    result = ev.perplexity(tokens, 10, fn)  # 2 chunks x 4 scored tokens
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
    result = ev.perplexity(list(range(80)), 32, ev.ModelScorer(model, "float32"))
    assert result.ppl == pytest.approx(96.0, rel=1e-6) and result.count == 2 * 15


def test_model_scorer_matches_transformers_on_a_tiny_random_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.model.loader import load_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    ours = load_model(tmp_path / "tiny", "float32", "cpu")
    scorer = ev.ModelScorer(ours.model, "float32")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2 * 48 + 5,), generator=gen).tolist()
    result = ev.perplexity(tokens, 48, scorer)
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


def test_bundled_text_is_long_enough_and_read_like_llama_perplexity(tmp_path):
    text = ev.read_text(ev.TEXT)
    assert 20_000 <= len(text.encode()) <= 50_000 and not text.endswith("\n")
    f = tmp_path / "t.txt"
    f.write_text("a\n\n")
    assert ev.read_text(f) == "a\n"
