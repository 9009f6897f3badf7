"""The non-loopback bind rule, written once for the router, the worker and the launchers.

Contract
- A server on a loopback address needs nothing. On any other address (a public IP, 0.0.0.0, a
  node IP a launcher resolves later) it needs what authenticates its callers, unless
  `allow_insecure_public` (a network you trust, or TLS terminated in front):
  - router (`router_missing`): API keys (a tenants file) and TLS on its client port, so that keys
    never cross the network in clear text;
  - worker (`worker_missing`): mutual TLS (certificate, key and client CA) or the deployment's
    worker token (common.auth), the two things that authenticate a router to a worker.
- `refusal(host, missing, kind)` is the message every entry point shows; None when nothing is
  missing. Pure: no files are read (a launcher checks paths that exist only on the nodes).
"""

from __future__ import annotations

from common.net import is_loopback_host

_WHY = {
    "router": "API keys would cross the network in clear text or not at all",
    "worker": "routers authenticate to workers only by client certificate or the worker token",
}


def router_missing(
    host: str, allow_insecure_public: bool, tenants_file: str | None, tls_cert: str | None
) -> list[str]:
    if is_loopback_host(host) or allow_insecure_public:
        return []
    return ([] if tenants_file else ["API keys (--tenants FILE)"]) + (
        [] if tls_cert else ["TLS (--tls-cert FILE --tls-key FILE)"]
    )


def worker_missing(
    host: str,
    allow_insecure_public: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    worker_token: str | None = None,
) -> list[str]:
    if is_loopback_host(host) or allow_insecure_public or worker_token:
        return []
    return [
        flag
        for flag, value in (
            ("--tls-cert", tls_cert),
            ("--tls-key", tls_key),
            ("--tls-client-ca", tls_client_ca),
        )
        if value is None
    ]


def refusal(host: str, missing: list[str], kind: str) -> str | None:
    """The error for a `kind` ("router" | "worker") server on `host` that lacks `missing`."""
    if not missing:
        return None
    what = (
        " and ".join(missing)
        if kind == "router"
        else f"mutual TLS (missing {', '.join(missing)}) or a worker token (LLM_WORKER_TOKEN)"
    )
    verb = "serve" if kind == "router" else "bind"
    return (
        f"refusing to {verb} {host} without {what}: {_WHY[kind]}; pass them, or "
        "--allow-insecure-public on a private network"
    )
