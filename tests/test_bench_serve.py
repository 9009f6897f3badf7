"""The logic of `make bench-serve` without llama.cpp or a server: the docs section replacement
(benchmarks/report.py), the ratio maths, the load tester's command line and summaries as the
harness reads them (benchmarks/serve_points.py), the report (benchmarks/serve_report.py), the
worker log parsing (benchmarks/serve_sides.py), the CPU and memory figures
(benchmarks/host_stats.py) and the command line (benchmarks/bench_serve.py). llama.cpp's side:
tests/test_llamacpp.py; `make eval`'s perplexity: tests/test_eval_ppl.py.
"""

from __future__ import annotations

import os
import time

import pytest

from benchmarks import bench_serve as bs
from benchmarks import host_stats as hs
from benchmarks import report
from benchmarks import serve_points as sp
from benchmarks import serve_report as sr
from benchmarks import serve_sides as ss

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
    assert sp.ratio(30.0, 120.0) == pytest.approx(0.25)
    assert sr.format_ratio(30.0, 120.0) == "ratio 0.25x"
    assert sr.format_ratio(250.0, 100.0) == "ratio 2.50x"
    assert sr.format_ratio(None, 1.0) == sr.format_ratio(1.0, 0.0) == "ratio n/a"
    assert sr.format_ratio(1.0, None) == "ratio n/a"


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
    numbers = sp.point_numbers(summarize_point(records, (TenantSpec(),), {}))
    # window: first send 0 s -> last end 1.5 + 127 * 0.3 = 39.6 s; 256 tokens
    assert numbers["output_tok_s"] == pytest.approx(256 / 39.6)
    assert numbers["tpot_p50_ms"] == pytest.approx(200.0)  # mean of 100 and 300 ms (p50 of two)
    assert numbers["ttft_p50_ms"] == pytest.approx(1000.0)
    assert numbers["mean_output_tokens"] == 128
    assert sp.side_problem(numbers, 128) is None
    assert "shorter" in sp.side_problem(numbers, 129)


def test_side_problems_name_failures_and_silence():
    from loadtest.config import TenantSpec
    from loadtest.summary import summarize_point

    failed = sp.point_numbers(
        summarize_point([_record("default", 0, 0.0, 0, 0, 0, status="UNAVAILABLE")], (TenantSpec(),), {})
    )
    assert "failed" in sp.side_problem(failed, 128) and "UNAVAILABLE" in sp.side_problem(failed, 128)
    assert sp.side_problem(sp.point_numbers({"completed": 0, "failed": 0}), 128) == "no request completed"
    silent = sp.point_numbers({"completed": 2, "failed": 0, "output_tokens": 0, "client_output_tokens": 0})
    assert sp.side_problem(silent, 128) == "no tokens streamed"


def test_loadtest_command_line_is_the_workload_asked_for():
    from loadtest.cli import parse_args

    argv = sp.loadtest_argv("llamacpp=http://127.0.0.1:8080", 8, 3, 45, "uniform:64:256", 128, "/tmp/x")
    config = parse_args(argv)
    [tenant], [target] = config.tenants, config.targets
    assert target.api == "openai" and target.address == "http://127.0.0.1:8080"
    assert tenant.closed_loop and tenant.concurrency == 8
    assert tenant.input_len.kind == "uniform" and tenant.input_len.params == (64, 256)
    assert tenant.output_len.spec == "128" and config.ignore_eos and config.temperature == 0
    assert config.seed == 3 and config.duration_s == 45 and config.warmup_s == 0
    warm = parse_args(
        sp.loadtest_argv("ours=127.0.0.1:1", 32, 0, 0, "uniform:64:256", 8, "/tmp/x", num_requests=32)
    )
    assert warm.num_requests == 32 and warm.targets[0].api == "grpc"


def test_llama_server_context_holds_every_slot():
    assert bs.llama_ctx(32, 256, 128) == 32 * (256 + 128 + 16)
    a = bs.parse_args(["--quick"])
    assert a.concurrency_list == [1, 8, 32] and a.duration_s == bs.QUICK_DURATION_S
    assert a.parallel == 32 and a.max_input == 256
    with pytest.raises(SystemExit):
        bs.parse_args(["--concurrencies", "0"])


def test_worker_args_reach_our_worker_command(tmp_path):
    a = bs.parse_args(["--worker-arg=--stream-interval=4", "--worker-arg=--max-num-seqs=16"])
    assert a.worker_args == ["--stream-interval=4", "--max-num-seqs=16"]
    ours = ss.OurStack(None, 2, tmp_path, a.worker_args)
    assert ours.worker_args()[-2:] == ["--stream-interval=4", "--max-num-seqs=16"]
    assert ours.commands()[0].endswith("--num-threads 2 --stream-interval=4 --max-num-seqs=16")
    assert bs.parse_args([]).worker_args == []
    assert "--stream" not in ss.OurStack(None, 2, tmp_path).commands()[0]


def test_report_table_shows_both_sides_and_ratios():
    p = sp.Point(8, 1, ["llama.cpp", "ours"])
    p.sides["ours"] = {
        "output_tok_s": 40.0,
        "tpot_p50_ms": 150.0,
        "ttft_p50_ms": 900.0,
        "completed": 10,
        "cpu": {"other_cores": 0.25},
    }
    p.sides["llama.cpp"] = {"output_tok_s": 160.0, "tpot_p50_ms": 50.0, "ttft_p50_ms": 300.0, "completed": 30}
    [row] = sr.table_rows([p])
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

    p = sp.Point(1, 0, ["ours", "llama.cpp"])
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
    md = sr.report_markdown(run, [p])
    assert "ratio 0.50x" in md and "ratio 2.00x" in md and "Caveat: the machine was shared" in md
    assert "0.1-1.2 of its 2 cores" in md and "python -m loadtest --target ours=<address>" in md
    one_thread = sr.report_markdown({**run, "threads": 1}, [p])
    assert "Caveat" not in one_thread and "neither side waits on a descheduled sibling" in one_thread
    monkeypatch.setattr(bs, "DOCS", tmp_path / "benchmarks.md")
    monkeypatch.setattr(bs, "PLOT", tmp_path / "bench-serve.png")
    assert bs.render(path, print) == 0
    assert bs.DOCS.read_text().endswith(md.rstrip("\n") + "\n")
    assert "![ours vs llama.cpp per concurrency](bench-serve.png)" in md
    assert bs.PLOT.read_bytes().startswith(b"\x89PNG")  # the picture the section shows
    run["points"][0]["problems"] = {"ours": "no tokens streamed"}
    path.write_text(json.dumps(run))
    bs.PLOT.unlink()
    assert bs.render(path, print) == 1
    assert not bs.PLOT.exists()  # a failed run draws nothing
    run["points"][0]["problems"] = {}
    path.write_text(json.dumps({**run, "worker_args": ["--stream-interval=4"]}))
    assert bs.render(path, print) == 1  # not our defaults: the section shows those
    assert not bs.PLOT.exists()


def test_plot_of_a_saved_run(tmp_path):
    """The README's picture from a saved run: a PNG of three panels; a side without a figure at a
    point draws no bar and 'n/a' for its ratio instead of failing; an unreadable run exits 1."""
    import json

    from benchmarks import serve_plot

    def side(tok_s, tpot, ttft):
        return {"output_tok_s": tok_s, "tpot_p50_ms": tpot, "ttft_p50_ms": ttft}

    run = {
        "machine": {"cpu": "AMD EPYC", "cores": 2},
        "date": "2026-12-01 21:18 UTC",
        "model": "/x/SmolLM2-135M-Instruct.Q4_1.gguf",
        "model_name": "m",
        "threads": 2,
        "points": [
            {
                "concurrency": 1,
                "sides": {"ours": side(120.0, 7.5, 73.0), "llama.cpp": side(90.0, 7.9, 389.0)},
            },
            {"concurrency": 8, "sides": {"ours": side(460.0, 15.0, None), "llama.cpp": {}}},
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = tmp_path / "plot.png"
    assert serve_plot.main([str(path), "--out", str(out)]) == 0
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 2 * height  # three panels side by side
    (tmp_path / "bad.json").write_text("{")
    assert serve_plot.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "no.png")]) == 1
    assert not (tmp_path / "no.png").exists()


def test_kv_pool_is_read_from_the_model_runner_line():
    line = (
        "2026-11-30 12:00:00 worker INFO model Smollm2 loaded in 3.2s; 126620 KV blocks "
        "(2025920 tokens, 5564 MiB), backend torch"
    )
    assert ss.parse_kv_pool(line) == {"blocks": 126620, "tokens": 2025920, "mib": 5564}
    assert ss.parse_kv_pool("worker listening on 127.0.0.1:5") is None


def test_cpu_meter_counts_this_process_as_the_client():
    start, cpu0 = time.monotonic(), time.process_time()
    meter = hs.CpuMeter([])
    before = hs.proc_cpu_s(os.getpid())
    while time.process_time() - cpu0 < 0.2:
        pass  # burn 0.2 s of CPU on purpose: the figure under test
    usage = meter.stop()
    share = (time.process_time() - cpu0) / (time.monotonic() - start)  # cores this process used
    assert hs.proc_cpu_s(os.getpid()) - before >= 0.15
    assert usage["client_cores"] == pytest.approx(share, rel=0.3, abs=0.02) and usage["side_cores"] == 0
    assert usage["busy_cores"] >= 0.5 * usage["client_cores"] and usage["other_cores"] >= 0


def test_rss_sampler_reads_this_process():
    sampler = hs.RssSampler(os.getpid(), interval_s=0.01)
    current = hs.read_status_kib(os.getpid(), "VmRSS")
    peak = sampler.stop()
    assert current and peak is not None and peak * 1024 >= current * 0.5
    assert hs.read_status_kib(2**22 + 12345, "VmRSS") is None
