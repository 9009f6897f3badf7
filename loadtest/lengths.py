"""Token-length distributions for prompts and outputs, parsed from short specs.

Contract
- input: a spec string: `N` or `fixed:N`; `uniform:LO:HI` (inclusive integers);
  `normal:MEAN:STD` (rounded, clipped to [1, MEAN + 4 STD]); `file:PATH` (one integer per line,
  sampled uniformly with replacement: an empirical distribution, e.g. lengths logged in production).
- output: `LengthDist.sample(rng) -> int >= 1`; `spec` (the text it came from) for reports.
- state: frozen; a file's values are read once at parse time.
- failure modes: ValueError naming the spec for bad syntax, lengths < 1, an empty file.
- proven by: tests/test_loadtest_workload.py.
"""

from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "file")


@dataclass(frozen=True)
class LengthDist:
    kind: str
    params: tuple[float, ...] = ()
    values: tuple[int, ...] = ()  # kind "file" only
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        text = str(spec).strip()
        kind, _, rest = text.partition(":")
        if kind.isdigit() and not rest:
            kind, rest = "fixed", kind
        if kind not in KINDS:
            raise ValueError(f"length spec {spec!r}: kind must be one of {KINDS} (e.g. uniform:16:64)")
        if kind == "file":
            lines = pathlib.Path(rest).read_text(encoding="utf-8").split()
            values = tuple(int(v) for v in lines)
            if not values or min(values) < 1:
                raise ValueError(f"length spec {spec!r}: the file needs integers >= 1")
            return cls("file", (), values, text)
        try:
            params = tuple(float(p) for p in rest.split(":"))
        except ValueError:
            raise ValueError(f"length spec {spec!r}: parameters must be numbers") from None
        want = {"fixed": 1, "uniform": 2, "normal": 2}[kind]
        if len(params) != want:
            raise ValueError(f"length spec {spec!r}: {kind} takes {want} parameter(s)")
        if kind == "fixed" and params[0] < 1:
            raise ValueError(f"length spec {spec!r}: length must be >= 1")
        if kind == "uniform" and not 1 <= params[0] <= params[1]:
            raise ValueError(f"length spec {spec!r}: need 1 <= LO <= HI")
        if kind == "normal" and (params[0] < 1 or params[1] < 0):
            raise ValueError(f"length spec {spec!r}: need MEAN >= 1 and STD >= 0")
        return cls(kind, params, (), text)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(int(self.params[0]), int(self.params[1]))
        if self.kind == "normal":
            mean, std = self.params
            return int(min(max(1, round(rng.gauss(mean, std))), mean + 4 * std))
        return rng.choice(self.values)
