"""Stop strings over a stream of text deltas.

Contract
- input: text deltas (already detokenized) via `push`; `flush` at the end of the stream.
- output: `push` returns (text safe to emit, stopped). Text that could be the start of a stop
  string is held back until it is disambiguated; on a match, the text before the earliest match
  is returned and the stop string itself is dropped (OpenAI semantics).
- state: the held-back suffix, at most (longest stop string - 1) characters.
- failure modes: none; pushing after a stop is a programming error (assert).
- proven by: tests/test_router_stop_strings.py.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        assert all(stops), "stop strings must be non-empty"
        self._stops = tuple(stops)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        """There are stop strings to look for."""
        return bool(self._stops)

    def push(self, delta: str) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string matched"
        if not self._stops:
            return delta, False
        text = self._held + delta
        hits = [(i, n, s) for n, s in enumerate(self._stops) if (i := text.find(s)) >= 0]
        if hits:
            at, _, self.matched = min(hits)
            self.stopped = True
            self._held = ""
            return text[:at], True
        hold = self._partial_suffix_len(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """End of stream: held-back text is not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, text: str) -> int:
        for k in range(min(len(text), self._max_hold), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self._stops):
                return k
        return 0
