"""A process that exits while an engine thread is inside a step, without close() / shutdown():
it must exit cleanly. Before the exit hooks (worker/step_thread.py `stop_at_exit`), Python's
finalization ended the daemon thread inside a torch call by a forced unwind through pybind11's
noexcept GIL release, and the process aborted ("terminate called without an active exception",
exit status -6), every time in the async-scheduling case below.

Each case runs in its own Python process (real threads, real torch), the tiny random model."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SETUP = """
import asyncio, dataclasses, threading
from tests.test_async_scheduling import tiny_config, tiny_runner
from worker.async_engine import AsyncEngine
from worker.engine import LLMEngine
from worker.types import SamplingParams
long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
"""

# A step is in flight on the executor thread when the script ends (async scheduling keeps one
# launched ahead of the step whose outputs step() returns).
LLM_ENGINE = """
config = dataclasses.replace(tiny_config(max_model_len=256), async_scheduling=True)
engine = LLMEngine(config, runner=tiny_runner(config))
engine.add_request("a", [1, 2, 3], long)
for _ in range(10):
    engine.step()
assert engine.has_in_flight
print("exiting", flush=True)
"""

# The loop thread is generating (it never runs out of work) when the script ends.
ASYNC_ENGINE = """
config = dataclasses.replace(tiny_config(max_model_len=256), async_scheduling={overlap})
engine = AsyncEngine(LLMEngine(config, runner=tiny_runner(config)))
engine.start()

async def first_tokens():
    stream = engine.generate("a", [1, 2, 3], long)
    for _ in range(5):
        await anext(stream)
    # Left open: the request goes on in the engine thread (no abort is posted until it closes).
    return stream

kept = asyncio.run(first_tokens())
assert any(t.name == "engine-loop" and t.is_alive() for t in threading.enumerate())
print("exiting", flush=True)
"""


def run_script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SETUP + body)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_clean_exit(proc: subprocess.CompletedProcess) -> None:
    assert "exiting" in proc.stdout, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_exit_with_a_step_in_flight_on_the_executor():
    assert_clean_exit(run_script(LLM_ENGINE))


@pytest.mark.parametrize("overlap", [False, True])
def test_exit_while_the_engine_loop_generates(overlap):
    assert_clean_exit(run_script(ASYNC_ENGINE.format(overlap=overlap)))
