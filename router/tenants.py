"""Tenants and API-key authentication.

Contract
- input: the call's metadata (`authorization: Bearer <key>`) and peer address.
- output: the `Tenant` the call belongs to, or `AuthError` (UNAUTHENTICATED).
- state: the tenants table, loaded once from a YAML file:

      tenants:
        - name: acme
          key_sha256: 9f86d081...   # sha256 hex of the API key; the key itself is never stored
          weight: 2.0               # fair-share weight (used by the fair queue)
          max_concurrency: 16       # optional; used by admission
          rate_tokens_per_s: 5000   # optional; used by admission

  Without a file there is one `default` tenant with no key, allowed only from loopback peers
  (or from anywhere with --allow-insecure-public).
- failure modes: malformed file -> ValueError at start-up; keys are compared in constant time
  against every tenant, so timing does not reveal which digest prefix matched.
- proven by: tests/test_router_tenants.py, tests/test_grpc_validation.py (missing / wrong key).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

import yaml

from router.errors import AuthError

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: str = ""
    weight: float = 1.0
    max_concurrency: int | None = None
    rate_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenant name must not be empty")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name}: weight must be > 0")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback_peer(peer: str) -> bool:
    """`peer` as grpc reports it: 'ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path'."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Tenants:
    def __init__(self, tenants: Iterable[Tenant], require_key: bool, allow_public: bool = False):
        self._tenants = tuple(tenants)
        self.require_key = require_key
        self._allow_public = allow_public
        names = [t.name for t in self._tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        if require_key:
            for t in self._tenants:
                if len(t.key_sha256) != 64 or any(c not in "0123456789abcdef" for c in t.key_sha256):
                    raise ValueError(f"tenant {t.name}: key_sha256 must be 64 lowercase hex digits")

    @classmethod
    def default(cls, allow_public: bool = False) -> "Tenants":
        return cls([Tenant(DEFAULT_TENANT)], require_key=False, allow_public=allow_public)

    @classmethod
    def from_yaml(cls, text: str) -> "Tenants":
        doc = yaml.safe_load(text) or {}
        entries = doc.get("tenants") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError("tenants file: expected a non-empty list under 'tenants'")
        known = set(Tenant.__dataclass_fields__)
        tenants = []
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) - known:
                raise ValueError(f"tenants file: bad entry {entry!r}; allowed keys: {sorted(known)}")
            tenants.append(Tenant(**{k: entry[k] for k in entry}))
        return cls(tenants, require_key=True)

    @classmethod
    def load(cls, path: str | None, allow_public: bool = False) -> "Tenants":
        if path is None:
            return cls.default(allow_public)
        with open(path, encoding="utf-8") as f:
            return cls.from_yaml(f.read())

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._tenants

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]], peer: str) -> Tenant:
        if not self.require_key:
            if not (self._allow_public or is_loopback_peer(peer)):
                raise AuthError("no tenants configured: the default tenant is only served to loopback clients")
            return self._tenants[0]
        header = next((v for k, v in metadata if k == "authorization"), None)
        if header is None:
            raise AuthError("missing API key: send metadata 'authorization: Bearer <key>'")
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("malformed authorization metadata: expected 'Bearer <key>'")
        digest = hash_key(key.strip())
        found = None
        for tenant in self._tenants:  # no early exit: every digest is compared
            if hmac.compare_digest(digest, tenant.key_sha256):
                found = tenant
        if found is None:
            raise AuthError("invalid API key")
        return found
