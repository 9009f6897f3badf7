"""Tenants and API-key authentication.

Contract
- input: the call's metadata (`authorization: Bearer <key>`) and peer address.
- output: the `Tenant` the call belongs to, or `AuthError` (UNAUTHENTICATED). The key alone names
  the tenant: no other metadata (`x-tenant`, ...) or request field is read. A call must carry
  exactly one `authorization` entry; two or more (a second key, a proxy's own header) are refused
  rather than resolved to whichever comes first. Refusal messages never echo the presented key.
- state: the tenants table, loaded once from a YAML file:

      tenants:
        - name: acme
          key_sha256: 9f86d081...   # sha256 hex of the API key; the key itself is never stored
          weight: 2.0               # fair-share weight (the fair queue divides service by it)
          max_concurrency: 16       # optional: open requests (queued + running)
          max_queued: 32            # optional: requests waiting in the router's fair queue
          rate_requests_per_s: 5    # optional: token bucket of requests ...
          burst_requests: 10        # ... holding this many (default: one second's worth, >= 1)
          rate_tokens_per_min: 60000  # optional: prompt + max_tokens per minute (burst: a minute's)
          default_priority: 0       # used when a request's priority is 0 (unset)
          max_priority: 0           # the highest priority its requests may ask for (higher:
                                    # PERMISSION_DENIED; default 0, or default_priority if
                                    # higher); priority preempts other tenants' work
          default_deadline_s: 300   # optional: the deadline of a call that sets none
          max_deadline_s: 600       # optional: no call runs longer (client deadlines are capped)
          admin: false              # optional: may load / unload LoRA adapters at run time
                                    # (router/lora_admin.py; without a file: loopback clients)
          adapters: ["sql", "chat-*"]  # optional: the LoRA adapters its requests may name
                                    # (fnmatch patterns, `*` spans `/` too; absent: all; []:
                                    # none); any other non-base model -> PERMISSION_DENIED
                                    # naming the rule, before any load or lookup
          max_autoloaded_adapters: 4  # optional: adapters --lora-autoload loaded for its
                                    # requests that it may hold at once (default 4; 0: none;
                                    # null: no limit); one more -> RESOURCE_EXHAUSTED naming
                                    # the limit, no load or eviction (router/lora_autoload.py)

  With `--router-replicas R` the table holds each tenant's share for one of R routers
  (`Tenant.share`: rates divided by R, caps divided and rounded up). max_autoloaded_adapters
  is not divided: it bounds each router's own loads (an adapter another router loaded is served
  and not loaded again), so R routers let a tenant hold up to R times it.

  Without a file there is one `default` tenant with no key, allowed only from loopback peers
  (or from anywhere with --allow-insecure-public); being alone, it may use any priority, any
  adapter, and autoload as many as the workers hold.
  `TenantsFile` reloads the file on SIGHUP or when its modification time changes, by swapping
  the immutable `Tenants`: calls in flight keep the `Tenant` they authenticated as; a bad new
  file is logged and the old table kept.
- failure modes: malformed file -> ValueError at start-up; keys are compared in constant time
  against every tenant, so timing does not reveal which digest prefix matched.
- proven by: tests/test_trust_limits.py (max_priority, deadlines),
  tests/test_router_tenants.py, tests/test_grpc_e2e.py (invalid-request table)
  (missing / wrong key), tests/test_adapter_names.py (adapters, max_autoloaded_adapters),
  tests/test_tenant_isolation.py (spoofing through metadata and fields, keys absent from logs,
  spans and metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import hashlib
import hmac
import ipaddress
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import yaml

from router.errors import AuthError, PermissionDenied

log = logging.getLogger(__name__)
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: str = ""
    weight: float = 1.0
    max_concurrency: int | None = None  # open requests: queued + running
    max_queued: int | None = None  # requests waiting in the router's fair queue
    rate_requests_per_s: float | None = None
    burst_requests: float | None = None  # None: one second's worth, at least 1
    rate_tokens_per_min: float | None = None  # prompt + max_tokens; burst: one minute's worth
    default_priority: int = 0
    max_priority: int | None = None  # highest priority it may ask for; None: 0, or default_priority
    default_deadline_s: float | None = None  # a call without a deadline gets this one
    max_deadline_s: float | None = None  # no call of the tenant runs longer
    admin: bool = False  # may load and unload LoRA adapters at run time (router/lora_admin.py)
    adapters: tuple[str, ...] | None = None  # fnmatch patterns of the adapters it may name; None: all
    max_autoloaded_adapters: int | None = 4  # adapters autoloaded for it held at once; None: no limit

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tenant name must be a non-empty string")
        if not _is_number(self.weight) or not 0 < self.weight < math.inf:
            raise ValueError(f"tenant {self.name}: weight must be a number > 0, got {self.weight!r}")
        for field in ("max_concurrency", "max_queued"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"tenant {self.name}: {field} must be an integer >= 1, got {value!r}")
        for field in ("rate_requests_per_s", "burst_requests", "rate_tokens_per_min"):
            value = getattr(self, field)
            if value is not None and (not _is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"tenant {self.name}: {field} must be a number > 0, got {value!r}")
        if self.burst_requests is not None:
            if self.rate_requests_per_s is None:
                raise ValueError(f"tenant {self.name}: burst_requests needs rate_requests_per_s")
            if self.burst_requests < 1:
                raise ValueError(f"tenant {self.name}: burst_requests must be >= 1 (one request)")
        for field in ("default_priority", "max_priority"):
            if not _is_int(getattr(self, field)):
                value = getattr(self, field)
                if value is not None or field != "max_priority":
                    raise ValueError(f"tenant {self.name}: {field} must be an integer, got {value!r}")
        if self.max_priority is None:  # 0, unless the operator gave the tenant a higher default
            object.__setattr__(self, "max_priority", max(0, self.default_priority))
        if self.default_priority > self.max_priority:
            raise ValueError(
                f"tenant {self.name}: default_priority {self.default_priority} is above its max_priority "
                f"{self.max_priority} (set max_priority too)"
            )
        for field in ("default_deadline_s", "max_deadline_s"):
            value = getattr(self, field)
            if value is not None and (not _is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"tenant {self.name}: {field} must be a number > 0, got {value!r}")
        if not isinstance(self.admin, bool):
            raise ValueError(f"tenant {self.name}: admin must be true or false, got {self.admin!r}")
        if self.adapters is not None:
            patterns = self.adapters
            if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) and p for p in patterns):
                raise ValueError(
                    f"tenant {self.name}: adapters must be a list of non-empty name patterns, "
                    f"got {patterns!r}"
                )
            object.__setattr__(self, "adapters", tuple(patterns))
        limit = self.max_autoloaded_adapters
        if limit is not None and (not _is_int(limit) or limit < 0):
            raise ValueError(
                f"tenant {self.name}: max_autoloaded_adapters must be an integer >= 0 or null, got {limit!r}"
            )
        if None not in (self.default_deadline_s, self.max_deadline_s):
            if self.default_deadline_s > self.max_deadline_s:
                raise ValueError(f"tenant {self.name}: default_deadline_s is above max_deadline_s")

    def check_priority(self, priority: int) -> None:
        """PermissionDenied for a priority above the tenant's max_priority (a higher priority runs
        before, and preempts, every other tenant's lower-priority work)."""
        if priority > self.max_priority:
            raise PermissionDenied(
                f"priority: {priority} is above the highest this tenant may use ({self.max_priority})"
            )

    def may_use(self, adapter: str) -> bool:
        """Whether the tenant's `adapters` patterns allow LoRA adapter `adapter` (`check_adapter`)."""
        try:
            self.check_adapter(adapter)
        except PermissionDenied:
            return False
        return True

    def check_adapter(self, name: str) -> None:
        """PermissionDenied unless the tenant's `adapters` patterns allow LoRA adapter `name` (any
        name when it has none). Decided from the name alone, so it tells nothing of whether such
        an adapter exists."""
        if self.adapters is None or any(fnmatch.fnmatchcase(name, p) for p in self.adapters):
            return
        shown = name if len(name) <= 128 else name[:128] + "..."
        raise PermissionDenied(
            f"model: adapter {shown!r} is not one this tenant may use (its adapters in the tenants "
            f"file: {list(self.adapters)})"
        )

    def deadline_at(self, now_s: float, remaining_s: float | None) -> float | None:
        """The call's deadline on the monotonic clock: the client's, else the tenant's default,
        capped by the tenant's maximum (None: no deadline)."""
        budget = self.default_deadline_s if remaining_s is None else remaining_s
        if self.max_deadline_s is not None:
            budget = self.max_deadline_s if budget is None else min(budget, self.max_deadline_s)
        return None if budget is None else now_s + budget

    def share(self, replicas: int) -> Tenant:
        """The limits one of `replicas` routers enforces when requests are spread evenly over them:
        rates and an explicit burst divided (a burst not below one request), caps divided and
        rounded up (never 0, so the routers together may allow up to replicas - 1 more). Weight
        and priority are shares already and stay; so does max_autoloaded_adapters, a bound on
        each router's own autoloads."""
        if replicas == 1:
            return self

        def cap(value: int | None) -> int | None:
            return None if value is None else -(-value // replicas)

        def rate(value: float | None) -> float | None:
            return None if value is None else value / replicas

        return dataclasses.replace(
            self,
            max_concurrency=cap(self.max_concurrency),
            max_queued=cap(self.max_queued),
            rate_requests_per_s=rate(self.rate_requests_per_s),
            burst_requests=None if self.burst_requests is None else max(1.0, self.burst_requests / replicas),
            rate_tokens_per_min=rate(self.rate_tokens_per_min),
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    def __init__(
        self, tenants: Iterable[Tenant], require_key: bool, allow_public: bool = False, replicas: int = 1
    ):
        # Stored as this router's share (Tenant.share): authenticate() returns what it enforces.
        self._tenants = tuple(t.share(replicas) for t in tenants)
        self.require_key = require_key
        self._allow_public = allow_public
        names = [t.name for t in self._tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        if require_key:
            for t in self._tenants:
                if not isinstance(t.key_sha256, str):  # YAML reads an unquoted all-digit digest as a number
                    raise ValueError(f"tenant {t.name}: key_sha256 must be a string (quote it in YAML)")
                if len(t.key_sha256) != 64 or any(c not in "0123456789abcdef" for c in t.key_sha256):
                    raise ValueError(f"tenant {t.name}: key_sha256 must be 64 lowercase hex digits")

    @classmethod
    def default(cls, allow_public: bool = False) -> "Tenants":
        # the only tenant: its priorities reorder only its own requests
        alone = Tenant(DEFAULT_TENANT, max_priority=2**31 - 1, max_autoloaded_adapters=None)
        return cls([alone], require_key=False, allow_public=allow_public)

    @classmethod
    def from_yaml(cls, text: str, replicas: int = 1) -> "Tenants":
        doc = yaml.safe_load(text) or {}
        entries = doc.get("tenants") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError("tenants file: expected a non-empty list under 'tenants'")
        known = set(Tenant.__dataclass_fields__)
        tenants = []
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) - known:
                raise ValueError(f"tenants file: bad entry {entry!r}; allowed keys: {sorted(known)}")
            try:
                tenants.append(Tenant(**{k: entry[k] for k in entry}))
            except TypeError as exc:  # a required key missing ("name"): a bad entry, as above
                raise ValueError(f"tenants file: bad entry {entry!r}: {exc}") from None
        return cls(tenants, require_key=True, replicas=replicas)

    @classmethod
    def load(cls, path: str | None, allow_public: bool = False, replicas: int = 1) -> "Tenants":
        if path is None:
            return cls.default(allow_public)  # no limits to share
        with open(path, encoding="utf-8") as f:
            return cls.from_yaml(f.read(), replicas)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._tenants

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]], peer: str) -> Tenant:
        if not self.require_key:
            if not (self._allow_public or is_loopback_peer(peer)):
                raise AuthError(
                    "no tenants configured: the default tenant is only served to loopback clients"
                )
            return self._tenants[0]
        headers = [v for k, v in metadata if k == "authorization"]
        if not headers:
            raise AuthError("missing API key: send metadata 'authorization: Bearer <key>'")
        if len(headers) > 1:
            raise AuthError(f"{len(headers)} authorization entries: send exactly one 'Bearer <key>'")
        header = headers[0]
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


class TenantsFile:
    """The current `Tenants` of a file, swapped whole when the file is reloaded.

    `reload()` (SIGHUP) reads the file again; `watch(poll_s)` reloads when its modification time,
    size or inode changes (an editor's save or an atomic rename). A file that does not parse is
    logged and the previous table kept, so a typo never locks every tenant out.
    """

    def __init__(self, path: str | None, allow_public: bool = False, replicas: int = 1):
        self.path = path
        self._allow_public = allow_public
        self._replicas = replicas
        self._stamp = self._stat()
        self.current = Tenants.load(path, allow_public, replicas)  # a bad file at start-up is fatal
        self.num_reloads = 0

    def reload(self) -> bool:
        if self.path is None:
            return False
        self._stamp = self._stat()  # taken before reading: a later write changes it again
        try:
            tenants = Tenants.load(self.path, self._allow_public, self._replicas)
        except Exception as exc:  # noqa: BLE001 - any bad file keeps the tenants (and the watch) going
            log.error(
                "tenants file %s not reloaded, keeping the previous %d tenant(s): %s",
                self.path,
                len(self.current.tenants),
                exc,
            )
            return False
        self.current = tenants
        self.num_reloads += 1
        log.info("tenants file %s reloaded: %d tenant(s)", self.path, len(tenants.tenants))
        return True

    def reload_if_changed(self) -> bool:
        if self.path is None or self._stat() in (None, self._stamp):
            return False
        return self.reload()

    async def watch(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            self.reload_if_changed()

    def _stat(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
