"""End-to-end fuzzing (fuzz/fuzz_e2e.py) through both fronts of a real router: hostile gRPC calls
never get UNKNOWN or INTERNAL, hostile HTTP requests to the OpenAI-compatible front never get a
5xx (nor do size-amplifying bodies: `n` x huge fields, nested schemas, long tool histories; the
router's event-loop lag over them is reported, not checked), the KV pool is whole afterwards, the
router still serves and logs no traceback. A short run here, through a router of its own over the
session's shared worker (tests/conftest.py), its amplifying bodies at a tenth of their size; the
issue's 10,000-input run, with a worker of its own, with --runslow (`make test-all`) or
`python -m fuzz.fuzz_e2e`."""

from __future__ import annotations

import pytest

from fuzz import fuzz_e2e


def test_short_fuzz_run_through_grpc_and_http(plain_worker, capsys):
    argv = ["--worker", plain_worker.address, "--grpc-calls", "100", "--http-calls", "150", "--seed", "5"]
    argv += ["--amplify-calls", "40", "--amplify-scale", "0.1"]  # size-amplifying bodies, a tenth the size
    assert fuzz_e2e.main([*argv, "--out", ""]) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_ten_thousand_inputs(capsys):
    code = fuzz_e2e.main(["--grpc-calls", "10000", "--http-calls", "2000", "--seed", "9", "--out", ""])
    assert code == 0, capsys.readouterr().out
