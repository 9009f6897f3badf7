"""`make bench` credits transformers' static batches honestly (benchmarks/engine_vs_hf.py).

A static batch generates its longest requested output for every member; `batch_credit` counts that
work (generated) next to what was asked for (requested), in workload order (padded) and in
length-sorted order (fair). `hf_batches` runs batches in any order and returns results in request
order, each cut to its requested length, so the correctness guard compares the right requests.
"""

from __future__ import annotations

import torch

from benchmarks.engine_vs_hf import batch_credit, hf_batches, length_sorted_order


def test_padded_batches_do_the_longest_output_for_everyone():
    outputs = [10, 100, 20, 90]
    padded = batch_credit(outputs, 2)  # batches [10, 100], [20, 90]
    assert padded == {
        "requested_tokens": 220,
        "generated_tokens": 2 * 100 + 2 * 90,
        "padding_fraction": 1 - 220 / 380,
    }
    order = length_sorted_order([[1]] * 4, outputs)
    assert order == [0, 2, 3, 1]  # 10, 20, 90, 100
    fair = batch_credit(outputs, 2, order)  # batches [10, 20], [90, 100]
    assert fair["requested_tokens"] == 220 and fair["generated_tokens"] == 2 * 20 + 2 * 100
    # A last, partial batch counts only its own members; batch size 1 wastes nothing.
    assert batch_credit([5, 7, 3], 2)["generated_tokens"] == 2 * 7 + 1 * 3
    assert batch_credit(outputs, 1)["padding_fraction"] == 0.0


def test_sort_key_is_output_then_prompt_length():
    prompts = [[1] * 30, [1] * 10, [1] * 20, [1] * 5]
    outputs = [16, 16, 8, 16]
    assert length_sorted_order(prompts, outputs) == [2, 3, 1, 0]


def test_benchmark_workload_pads_about_half_at_batch_8():
    """The issue's claim on the real workload's lengths: at batch 8 in workload order transformers
    generates about twice the requested tokens; sorted, far less is wasted."""
    from benchmarks.engine_vs_hf import workload

    outputs = [o for _, _, o in workload(64, 0)]
    prompts = [[0] * p for _, p, _ in workload(64, 0)]
    padded = batch_credit(outputs, 8)
    fair = batch_credit(outputs, 8, length_sorted_order(prompts, outputs))
    assert padded["generated_tokens"] > 1.6 * padded["requested_tokens"]
    assert fair["padding_fraction"] < 0.15 < padded["padding_fraction"]


class EchoModel:
    """A stand-in for `generate`: appends tokens that encode (first prompt token, step), so each
    result row shows which request it came from and how many tokens were generated."""

    def __init__(self):
        self.calls = []

    def generate(self, ids, attention_mask, max_new_tokens, min_new_tokens, do_sample, pad_token_id):
        assert max_new_tokens == min_new_tokens and not do_sample
        self.calls.append((ids.shape[0], max_new_tokens))
        first = torch.stack([row[mask.bool()][0] for row, mask in zip(ids, attention_mask)])
        new = first[:, None] * 1000 + torch.arange(max_new_tokens)[None, :]
        return torch.cat([ids, new], dim=1)


def test_hf_batches_returns_request_order_cut_to_requested_lengths():
    prompts = [[1, 1, 1], [2], [3, 3], [4, 4, 4, 4]]
    outputs = [3, 1, 4, 2]
    order = length_sorted_order(prompts, outputs)  # 1 (1 token), 3 (2), 0 (3), 2 (4)
    model = EchoModel()
    results = hf_batches(model, prompts, outputs, 2, order)
    assert model.calls == [(2, 2), (2, 4)]  # each batch runs its longest output
    assert results == [[1000, 1001, 1002], [2000], [3000, 3001, 3002, 3003], [4000, 4001]]
    assert hf_batches(EchoModel(), prompts, outputs, 2) == results  # workload order too


def test_report_headline_is_the_fair_ratio(tmp_path, monkeypatch, capsys):
    """main() with both sides' subprocess results canned: the headline `ratio` divides the engine's
    tok/s by transformers' length-sorted requested tok/s; the padded ratio is reported, labelled."""
    import json
    import sys

    import benchmarks.engine_vs_hf as bench

    prompts, outputs = [[1] * 20, [2] * 10, [3] * 30, [4] * 5], [10, 100, 20, 90]
    tokens = [[7] * n for n in outputs]
    engine = {
        "elapsed_s": 2.0,
        "outputs": tokens,
        "steps": 100,
        "preemptions": 0,
        "kv_blocks": 64,
        "peak_rss_mib": 100.0,
    }
    runs = {
        "sorted": {"elapsed_s": 4.0, "outputs": tokens, **bench.batch_credit(outputs, 2, [0, 2, 3, 1])},
        "workload": {
            "elapsed_s": 8.0,
            "outputs": [t[:-1] + [8] for t in tokens],
            **bench.batch_credit(outputs, 2),
        },
    }
    hf = {"batch_size": 2, "calibration_tok_s": {"2": 50.0}, "runs": runs, "peak_rss_mib": 90.0}

    def check_output(cmd, **kwargs):
        if "--side" not in cmd:  # git rev-parse, uname -p
            return "abc1234\n"
        return json.dumps(engine if cmd[cmd.index("--side") + 1] == "engine" else hf)

    monkeypatch.setattr(bench, "encode_workload", lambda n, seed: (prompts, outputs))
    monkeypatch.setattr(bench.subprocess, "check_output", check_output)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["engine_vs_hf", "--out", str(out)])
    bench.main()
    text = capsys.readouterr().out
    # engine 220 / 2 s = 110 tok/s; fair 220 / 4 s = 55 tok/s; padded 220 / 8 s = 27.5 tok/s.
    assert (
        "engine 110.0 tok/s vs transformers 55.0 tok/s (length-sorted batches, headline, fair): ratio 2.00x"
    ) in text
    assert "(workload-order batches, padded): ratio 4.00x]" in text
    assert "240 tokens" in text and "380 tokens" in text  # work actually done, padding included
    assert "correctness guard (length-sorted batches): 4/4 requests token-identical" in text
    assert "correctness guard (workload-order batches): 0/4 requests token-identical" in text
    summary = json.loads(out.read_text())
    assert summary["ratio"] == 2.0 and summary["ratio_padded"] == 4.0
    assert summary["hf"]["runs"]["workload"]["generated_tok_s"] == 380 / 8.0
