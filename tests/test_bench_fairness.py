"""`make bench-fairness` reads its figures honestly (benchmarks/fairness_figures.py, fairness.py).

Synthetic load-test records on the run's clock: tenants whose requests overlap (always one waiting
for its first token) are backlogged; the b / a service ratio counts only the time in which both
were; the verdict passes weights honoured within the tolerance, and names the reason otherwise
(too little backlog, a ratio outside the tolerance, a swing over the bound). The plot draws a run
whose backlog series is empty (the old benchmark crashed on mismatched series lengths). Load
levels are multiples of the measured capacity; bad arguments are usage errors; a stack that does
not start ends the run with exit status 1 and the reason, not a traceback.
"""

from __future__ import annotations

import pytest

from benchmarks import fairness
from benchmarks.fairness_figures import CELL_S, backlogged_cells, fairness_figures, plot, verdict
from loadtest.record import NS_PER_S, RequestRecord
from loadtest.summary import summarize_point
from loadtest.sweep import PointResult

TENANTS = [fairness.BenchTenant("a", 1.0, 32, 16), fairness.BenchTenant("b", 2.0, 32, 16)]
RATES = {"a": 2.0, "b": 1.0}
DURATION_S = 20.0
END = DURATION_S + 3  # requests keep coming past the window, so the last cells still wait


def stream(tenant: str, every_s: float, wait_s: float, until_s: float = DURATION_S, start_s: float = 0.01):
    """Requests sent every `every_s`, each waiting `wait_s` for its first token, then 16 tokens."""
    out, t, i = [], start_s, 0
    while t < until_s:
        first = t + wait_s
        out.append(
            RequestRecord(
                tenant,
                i,
                False,
                int(t * NS_PER_S),
                sent_ns=int(t * NS_PER_S),
                end_ns=int((first + 0.1) * NS_PER_S),
                chunk_ns=[int(first * NS_PER_S), int((first + 0.1) * NS_PER_S)],
                chunk_tokens=[1, 15],
                input_len=32,
                prompt_tokens=32,
                completion_tokens=16,
            )
        )
        t, i = t + every_s, i + 1
    return out


def point(records, mode: str = "vtc") -> PointResult:
    specs = fairness.specs_for(TENANTS + [fairness.BenchTenant("c", 1.0, 32, 16)], {**RATES, "c": 0.1})
    return PointResult(mode, "run", None, records, summarize_point(records, specs, {}))


def figures(records) -> dict:
    return fairness_figures(point(records), TENANTS, RATES, 0.0, DURATION_S, 272)


def test_both_backlogged_with_twice_the_service_passes():
    # b finishes a request every 0.25 s, a every 0.5 s; each waits 2 s, so one is always waiting
    f = figures(stream("a", 0.5, 2.0, until_s=END) + stream("b", 0.25, 2.0, until_s=END))
    assert f["both_backlogged_fraction"] == 1.0
    assert f["service_ratio_b_a"] == pytest.approx(2.0, rel=0.02)
    assert f["weighted_ratio"] == pytest.approx(1.0, rel=0.02)
    assert f["max_window_difference"] < f["bound_window"]
    assert verdict(f, tolerance=0.1, min_backlogged=0.95) is None


def test_equal_service_is_weights_not_honoured():
    f = figures(stream("a", 0.25, 2.0, until_s=END) + stream("b", 0.25, 2.0, until_s=END))
    assert f["service_ratio_b_a"] == pytest.approx(1.0, rel=0.02)
    why = verdict(f, tolerance=0.1, min_backlogged=0.95)
    assert why and "weights not honoured" in why and "1.00" in why


def test_a_tenant_that_never_waits_is_not_backlogged_and_the_run_cannot_show_the_weights():
    # b's requests are answered at once (sent every 1 s, first token 0.05 s later): no backlog
    f = figures(stream("a", 0.5, 2.0, until_s=END) + stream("b", 1.0, 0.05))
    assert f["tenants"]["a"]["backlogged_fraction"] == 1.0
    assert f["tenants"]["b"]["backlogged_fraction"] == 0.0
    assert f["both_backlogged_fraction"] == 0.0 and f["gap_series"]["t_s"] == []
    why = verdict(f, tolerance=0.1, min_backlogged=0.95)
    assert why and "cannot show the weights" in why


def test_refused_requests_wait_for_nothing():
    refused = [
        RequestRecord("a", i, False, int(i * 1e8), sent_ns=int(i * 1e8), end_ns=int(i * 1e8) + 1000)
        for i in range(200)
    ]
    for r in refused:
        r.status = "RESOURCE_EXHAUSTED"
    assert not any(backlogged_cells(refused, "a", 0.0, int(DURATION_S / CELL_S)))


def test_plot_draws_a_run_without_backlog(tmp_path):
    f = figures(stream("a", 0.5, 2.0) + stream("b", 1.0, 0.05))
    levels = [{"load": 3.0, "rates": RATES, "figures": [f, f]}]
    plot(levels, [[point(stream("a", 0.5, 2.0)), point(stream("b", 1.0, 0.05), "fcfs")]], tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_load_levels_are_multiples_of_the_measured_capacity():
    rates = fairness.level_rates(3.0, capacity_req_s=1.5, light_share=0.05)
    assert rates["a"] + rates["b"] == pytest.approx(4.5)
    assert rates["a"] == pytest.approx(2 * rates["b"])
    assert rates["c"] == pytest.approx(0.075)


@pytest.mark.parametrize(
    "argv", [["--loads", "x"], ["--loads", "0"], ["--weights", "1,2"], ["--duration-s", "0"]]
)
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        fairness.parse_args(argv)
    assert exit_.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_stack_that_does_not_start_is_a_reason_and_exit_1_not_a_traceback(tmp_path, capsys):
    # the workers refuse a negative KV pool at start-up: the run cannot be measured, and says why
    argv = ["--kv-cache-mb", "-1", "--out-dir", str(tmp_path), "--no-progress"]
    assert fairness.main(argv) == 1
    err = capsys.readouterr().err
    assert "bench-fairness: the run could not be measured: RuntimeError" in err
    assert "Traceback" not in err.split("bench-fairness:")[-1]
