"""Run configuration: frozen dataclasses, checked on construction, built by `cli` in one place.

Contract
- `TenantSpec`: who sends what and how fast (key, weight, arrival process or closed-loop
  concurrency, prompt source, input/output length distributions, shared-prefix length).
  `TenantSpec.from_fields(dict, base)` reads the `--tenant k=v,...` / tenants-file keys in
  `TENANT_KEYS`; unspecified keys come from `base` (the command-line defaults).
- `Target`: one server under test: a gRPC address, an OpenAI-compatible base URL, or `local`
  (a worker + router this tool starts, with extra worker arguments). Two targets = comparison.
- `RunConfig`: everything else that shapes the request stream and the report. `to_json()` is the
  repeatable record written into the report (API keys are replaced by "<set>").
- failure modes: ValueError naming the field; a non-loopback target without `allow_remote`.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import urllib.parse
from dataclasses import dataclass

from common.net import is_loopback_host
from common.tls import CLIENT_FLAGS, check_files
from loadtest.lengths import LengthDist

ARRIVAL_KINDS = ("poisson", "gamma", "constant", "closed")
TENANT_KEYS = {
    "name": "name",
    "key": "api_key",
    "weight": "weight",
    "arrival": "arrival",
    "rate": "rate_per_s",
    "burstiness": "burstiness",
    "concurrency": "concurrency",
    "prompts": "prompts",
    "input_len": "input_len",
    "output_len": "output_len",
    "prefix_len": "shared_prefix_len",
    "priority": "priority",
}
_NAME = re.compile(r"^([A-Za-z][\w.-]*)=(.+)$")


@dataclass(frozen=True)
class TenantSpec:
    name: str = "default"
    api_key: str = ""  # sent as `authorization: Bearer <key>`; never written out
    weight: float = 1.0  # fair-share weight: service is divided by it
    arrival: str = "poisson"  # poisson | gamma | constant | closed
    rate_per_s: float = 1.0  # open loop
    burstiness: float = 1.0  # gamma shape (1 = Poisson)
    concurrency: int = 1  # closed loop: requests kept in flight
    prompts: str = "synthetic"  # synthetic | bundled | PATH (.jsonl with "prompt" or .txt)
    input_len: LengthDist = LengthDist.parse("128")  # synthetic prompts only
    output_len: LengthDist = LengthDist.parse("16")
    shared_prefix_len: int = 0  # tokens of a system prompt common to the tenant's requests
    priority: int = 0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"tenant name must be letters, digits, '_', '.', '-': {self.name!r}")
        if self.arrival not in ARRIVAL_KINDS:
            raise ValueError(f"tenant {self.name}: arrival must be one of {ARRIVAL_KINDS}")
        if not self.weight > 0 or not self.rate_per_s > 0 or not self.burstiness > 0:
            raise ValueError(f"tenant {self.name}: weight, rate and burstiness must be > 0")
        if self.concurrency < 1 or self.shared_prefix_len < 0:
            raise ValueError(f"tenant {self.name}: concurrency >= 1 and prefix_len >= 0 required")

    @property
    def closed_loop(self) -> bool:
        return self.arrival == "closed"

    @classmethod
    def from_fields(cls, fields: dict, base: "TenantSpec") -> "TenantSpec":
        unknown = set(fields) - set(TENANT_KEYS)
        if unknown:
            raise ValueError(f"unknown tenant key(s) {sorted(unknown)}; known: {sorted(TENANT_KEYS)}")
        values = {}
        for key, raw in fields.items():
            attr = TENANT_KEYS[key]
            kind = type(getattr(base, attr))
            values[attr] = LengthDist.parse(raw) if kind is LengthDist else kind(raw)
        return dataclasses.replace(base, **values)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["api_key"] = "<set>" if self.api_key else ""
        out["input_len"], out["output_len"] = self.input_len.spec, self.output_len.spec
        return out


def parse_kv(text: str) -> dict[str, str]:
    """`a=1,b=x` -> {"a": "1", "b": "x"}."""
    pairs = [p for p in text.split(",") if p.strip()]
    if any("=" not in p for p in pairs):
        raise ValueError(f"expected key=value pairs separated by commas, got {text!r}")
    return {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in pairs)}


@dataclass(frozen=True)
class Target:
    name: str
    api: str  # grpc | openai
    address: str = ""  # host:port (grpc) or base URL (openai); "" until a local one starts
    local_args: tuple[str, ...] = ()  # worker arguments when this tool starts the server
    local: bool = False
    metrics_url: str = ""  # Prometheus text endpoint, scraped before and after

    @classmethod
    def parse(cls, text: str, index: int, allow_remote: bool = False) -> "Target":
        found = _NAME.match(text)
        name, spec = (found.group(1), found.group(2)) if found else ("", text)
        is_local = spec == "local" or spec.startswith("local:")
        name = name or (("local" if is_local else "target") + (str(index) if index else ""))
        if is_local:
            return cls(name, "grpc", "", tuple(shlex.split(spec[len("local:") :])), local=True)
        if spec.startswith(("http://", "https://")):
            host = urllib.parse.urlsplit(spec).hostname or ""
            api, address = "openai", spec.rstrip("/")
        else:
            address = spec.removeprefix("grpc://")
            host = address.rpartition(":")[0].strip("[]")
            api = "grpc"
        if not allow_remote and not is_loopback_host(host):
            raise ValueError(
                f"target {spec!r} is not on loopback: load only servers you run; "
                "pass --allow-remote for your own remote server"
            )
        return cls(name, api, address)


@dataclass(frozen=True)
class RunConfig:
    targets: tuple[Target, ...]
    tenants: tuple[TenantSpec, ...]
    duration_s: float | None = 30.0  # measured time per sweep point, after warm-up
    num_requests: int | None = None  # measured requests per sweep point
    warmup_s: float = 0.0  # requests sent earlier are run but not counted
    sweep: str = ""  # "" | rate | concurrency
    sweep_values: tuple[float, ...] = ()
    seed: int = 0
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    prompt_format: str = "text"  # grpc: send text (router tokenizes) or token ids
    max_concurrency: int | None = None  # open loop: client-side cap; waits are recorded
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0  # after the last send; then in-flight calls are cancelled
    slo_s: tuple[tuple[str, float], ...] = ()
    tokenizer: str = ""  # GGUF file or HF dir for synthetic prompts; "" = embedded
    out_dir: str = "loadtest-results"
    plots: bool = True
    progress: bool = True
    local_num_workers: int = 1
    tls_ca: str = ""  # gRPC targets: TLS, trusting this CA (PEM); "" = plaintext

    def __post_init__(self) -> None:
        if not 1 <= len(self.targets) <= 2:
            raise ValueError("give one target, or two to compare")
        if len({t.name for t in self.targets}) != len(self.targets):
            raise ValueError("target names must differ")
        if not self.tenants or len({t.name for t in self.tenants}) != len(self.tenants):
            raise ValueError("tenant names must be unique")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("a run is bounded: give --duration-s or --num-requests")
        if (self.duration_s is not None and self.duration_s <= 0) or self.warmup_s < 0:
            raise ValueError("duration must be > 0 and warm-up >= 0")
        if self.sweep not in ("", "rate", "concurrency") or (self.sweep and not self.sweep_values):
            raise ValueError("a sweep needs values")
        if self.prompt_format not in ("text", "tokens"):
            raise ValueError("prompt format must be text or tokens")
        if self.tls_ca:
            if any(t.local for t in self.targets):
                raise ValueError("--tls-ca is for remote gRPC targets: a local target serves plaintext")
            check_files(None, None, self.tls_ca, CLIENT_FLAGS)

    def tenants_at(self, value: float | None) -> tuple[TenantSpec, ...]:
        """The tenants at one sweep point: the swept value replaces every tenant's rate (open-loop
        tenants) or concurrency (closed-loop tenants)."""
        if not self.sweep or value is None:
            return self.tenants
        if self.sweep == "rate":
            return tuple(
                t if t.closed_loop else dataclasses.replace(t, rate_per_s=value) for t in self.tenants
            )
        return tuple(
            dataclasses.replace(t, concurrency=int(value)) if t.closed_loop else t for t in self.tenants
        )

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["targets"] = [dataclasses.asdict(t) for t in self.targets]
        out["tenants"] = [t.to_json() for t in self.tenants]
        out["slo_s"] = dict(self.slo_s)
        return out
