"""`make serve` (deploy/local.py) stopping: a second Ctrl-C (or SIGTERM) while the workers drain.

`stop_stack` is what main runs once the router has stopped. The workers' stop is faked (a real
Ray start costs ~20 s of CPU); the signal is real: raised in this process in the middle of the
fake drain, with the handlers `stop_stack` installs (this process's own are restored after).
"""

from __future__ import annotations

import signal

import pytest

from deploy import local

WORKERS = ["llm-worker-0", "llm-worker-1"]


class FakeWorkers:
    """stop_workers' stand-in; `signal_in_drain`: the signal that arrives while they drain."""

    def __init__(self, signal_in_drain: signal.Signals | None):
        self.signal_in_drain = signal_in_drain
        self.calls: list[tuple[str, bool, float]] = []
        self.events: list[str] = []

    def stop(self, namespace: str, drain: bool = True, timeout_s: float = 30.0) -> list[str]:
        self.calls.append((namespace, drain, timeout_s))
        self.events.append("drain" if drain else "kill")
        if drain and self.signal_in_drain is not None:
            signal.raise_signal(self.signal_in_drain)  # its handler runs before this returns
            self.events.append("drained anyway")
        return WORKERS


@pytest.fixture
def own_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def stop(monkeypatch, fake: FakeWorkers) -> list[str]:
    monkeypatch.setattr(local, "stop_workers", fake.stop)
    try:
        return local.stop_stack("ns", 12.5, lambda: fake.events.append("ray.shutdown"))
    except KeyboardInterrupt:  # raised on, it would stop pytest's whole session: fail this test only
        pytest.fail(f"the interrupt escaped stop_stack; done before it: {fake.events}")


def test_one_stop_drains_the_workers_then_shuts_ray_down(monkeypatch, own_handlers):
    fake = FakeWorkers(signal_in_drain=None)
    assert stop(monkeypatch, fake) == WORKERS
    assert fake.calls == [("ns", True, 12.5)]
    assert fake.events == ["drain", "ray.shutdown"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_while_the_workers_drain_stops_them_at_once_and_still_shuts_ray_down(
    monkeypatch, own_handlers, sig
):
    fake = FakeWorkers(signal_in_drain=sig)
    # Handlers that do not interrupt, in place of what the router's closing event loop leaves
    # (SIGTERM's default, death: it would take pytest with it): stop_stack must install its own.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: fake.events.append(f"{signal.Signals(signum).name} unhandled"))
    assert stop(monkeypatch, fake) == WORKERS
    assert [drain for _, drain, _ in fake.calls] == [True, False]
    assert fake.events == ["drain", "kill", "ray.shutdown"]
