"""The README's first try, as written, against a real stack (worker + router processes, the
embedded SmolLM2, float32 as every shared test worker): `python -m devtools.client "What is the
capital of Germany?" --chat` answers with Berlin (tests/test_ray_serve.py asks `make serve`'s
default stack, int4 weights, the same question). The client leaves sampling unset, so the router
applies the model's documented defaults (greedy for SmolLM2, docs/serving.md "Generation
defaults") instead of temperature 1.0.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import REPO, running_router

QUESTION = "What is the capital of Germany?"
ANSWER = "The capital of Germany is Berlin."


@pytest.fixture(scope="module")
def router(plain_worker, logs):
    """A router of its own over the session's shared worker (tests/conftest.py: the embedded model)."""
    with running_router(logs, [plain_worker.address]) as proc:
        yield proc


def _client(router, *flags: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "devtools.client", QUESTION, "--chat", "--target", router.address, *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_readme_first_try_answers_berlin(router) -> None:
    answer = _client(router)  # exactly the README's command: the model's defaults apply (greedy)
    assert answer.strip() == ANSWER
    assert _client(router, "--temperature", "0") == answer


def test_explicit_sampling_still_wins_over_the_defaults(router) -> None:
    """A request that sets temperature samples (seeded: same seed, same text), not greedy."""
    sampled = [_client(router, "--temperature", "1.5", "--seed", "3", "--max-tokens", "12") for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert sampled[0].strip() != ANSWER
