"""One canonical name per LoRA adapter directory (common/adapter_names.py, checked by the router's
autoloader and admin and by the worker), the tenants file's `adapters` allow-list and
`max_autoloaded_adapters` (router/tenants.py, router/lora_autoload.py), and the worker's refusal of
paths that lead out of --lora-dir (worker/lora_files.py). The real router and worker:
tests/test_lora_autoload_e2e.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from common.adapter_names import name_problem
from router.errors import Overloaded, PermissionDenied, ValidationError
from router.lora_autoload import Autoloader
from router.tenants import Tenant, Tenants, hash_key
from tests.test_lora_autoload import FakeAdmin

BAD_SPELLINGS = {  # all of them `sql`'s directory under --lora-dir
    "sql/": "a trailing '/'",
    "sql/.": "a '.' path segment",
    "sql//": "a trailing '/'",
    "sql//x": "an empty path segment",
    "x/../sql": "a '..' path segment",
    "a/./b": "a '.' path segment",
}


def test_one_spelling_per_directory():
    for good in ("sql", "org/sql", "llama-3.1:lora@v2", "a.b/c..d", "x/.hidden"):
        assert name_problem(good) == "", good
    for bad, why in BAD_SPELLINGS.items():
        problem = name_problem(bad)
        assert f"adapter name {bad!r} is not canonical: {why}" in problem, problem
    assert name_problem("x/../sql").endswith("use 'sql'") and name_problem("sql/.").endswith("use 'sql'")
    # no suggestion that would itself be refused (or lead above --lora-dir)
    assert "use" not in name_problem("x/../..") and "use" not in name_problem("a/../../b")
    assert "1-128 of" in name_problem("../sql") and "1-128 of" in name_problem("x y")  # as before


def test_the_autoloader_refuses_other_spellings_by_name_and_loads_nothing():
    async def main():
        admin = FakeAdmin(slots=4)
        auto = Autoloader(admin, retry_s=60)
        assert await auto.ensure("sql", set(admin.held))
        for bad in BAD_SPELLINGS:
            assert auto.would_load(bad, set(admin.held))  # goes on to ensure's refusal
            with pytest.raises(ValidationError) as refused:
                await auto.ensure(bad, set(admin.held))
            assert f"model: adapter name {bad!r} is not canonical" in str(refused.value)
        assert admin.calls == [("load", "sql")] and set(admin.held) == {"sql"}
        assert not auto.would_load("../sql", set(admin.held))  # not a name at all: unknown model

    asyncio.run(main())


def _tenant(name: str, **limits) -> Tenant:
    return Tenant(name, hash_key(name), **limits)


def test_a_tenant_holds_at_most_its_max_autoloaded_adapters():
    async def main():
        admin = FakeAdmin(slots=3)
        auto = Autoloader(admin, retry_s=60)
        capped, other = _tenant("capped", max_autoloaded_adapters=2), _tenant("other")
        for name in ("a", "b"):
            assert await auto.ensure(name, set(admin.held), tenant=capped)
        assert not await auto.ensure("a", set(admin.held), tenant=capped)  # served: no load, no count
        calls = list(admin.calls)
        with pytest.raises(Overloaded) as refused:
            await auto.ensure("c", set(admin.held), tenant=capped)
        message = str(refused.value)
        assert "tenant 'capped' holds 2 adapter(s)" in message and "max_autoloaded_adapters (2)" in message
        assert "'a', 'b'" in message and refused.value.retry_after_ms == 1000
        assert admin.calls == calls  # no load, no unload to make room
        # Another tenant's loads make room: a goes (the least recently named), capped holds b only.
        assert await auto.ensure("x", set(admin.held), tenant=other)
        assert await auto.ensure("y", set(admin.held), tenant=other)
        assert set(admin.held) == {"b", "x", "y"}
        assert await auto.ensure("c", set(admin.held), tenant=capped)  # b makes room
        assert await auto.ensure("d", set(admin.held), tenant=capped)  # x makes room
        assert set(admin.held) == {"y", "c", "d"}
        with pytest.raises(Overloaded):
            await auto.ensure("e", set(admin.held), tenant=capped)
        del admin.held["c"]  # unloaded by an admin (or another router): counted no more
        assert await auto.ensure("e", set(admin.held), tenant=capped)
        assert set(admin.held) == {"y", "d", "e"}

    asyncio.run(main())


def test_a_failed_load_and_concurrent_waiters_count_once_or_not_at_all():
    async def main():
        admin = FakeAdmin(slots=4)
        admin.missing.add("gone")
        auto = Autoloader(admin, retry_s=0.0)
        one = _tenant("one", max_autoloaded_adapters=1)
        with pytest.raises(ValidationError):
            await auto.ensure("gone", set(admin.held), tenant=one)  # failed: counts nothing
        admin.gate = asyncio.Event()
        first = asyncio.create_task(auto.ensure("a", set(admin.held), tenant=one))
        await asyncio.sleep(0)  # its load is under way (held at the gate)
        second = asyncio.create_task(auto.ensure("a", set(admin.held), tenant=one))  # waits: no load
        with pytest.raises(Overloaded):  # a load under way counts
            await auto.ensure("b", set(admin.held), tenant=one)
        admin.gate.set()
        assert await first and await second
        assert admin.calls == [("load", "gone"), ("load", "a")]
        none = _tenant("none", max_autoloaded_adapters=0)
        with pytest.raises(Overloaded) as refused:
            await auto.ensure("b", set(admin.held), tenant=none)
        assert "holds 0 adapter(s) loaded on demand for its requests (none)" in str(refused.value)
        assert await auto.ensure("b", set(admin.held))  # no tenant (a caller without one): no limit

    asyncio.run(main())


def test_the_tenants_file_reads_adapters_and_the_autoload_limit():
    text = f"""
tenants:
  - name: narrow
    key_sha256: {hash_key("narrow")}
    adapters: ["sql", "chat-*"]
    max_autoloaded_adapters: 3
  - name: open
    key_sha256: {hash_key("open")}
  - name: unbounded
    key_sha256: {hash_key("unbounded")}
    max_autoloaded_adapters: null
    adapters: []
"""
    narrow, open_, unbounded = Tenants.from_yaml(text).tenants
    assert narrow.adapters == ("sql", "chat-*") and narrow.max_autoloaded_adapters == 3
    assert open_.adapters is None and open_.max_autoloaded_adapters == 4  # the defaults
    assert unbounded.adapters == () and unbounded.max_autoloaded_adapters is None
    for allowed in ("sql", "chat-a", "chat-a/b"):
        narrow.check_adapter(allowed)
        open_.check_adapter(allowed)
    for refused in ("sql2", "poet", "SQL"):
        with pytest.raises(PermissionDenied) as denied:
            narrow.check_adapter(refused)
        assert f"adapter {refused!r} is not one this tenant may use" in str(denied.value)
        assert "['sql', 'chat-*']" in str(denied.value)
    with pytest.raises(PermissionDenied):
        unbounded.check_adapter("sql")  # an empty list: no adapter at all
    assert Tenants.default().tenants[0].max_autoloaded_adapters is None  # alone: the workers' slots
    # each of 3 routers bounds its own autoloads: not divided
    assert Tenants.from_yaml(text, replicas=3).tenants[1].max_autoloaded_adapters == 4
    for bad in ("adapters: sql", "adapters: [1]", 'adapters: [""]', "max_autoloaded_adapters: -1"):
        entry = f"tenants:\n  - name: t\n    key_sha256: {hash_key('t')}\n    {bad}\n"
        with pytest.raises(ValueError, match="adapters"):
            Tenants.from_yaml(entry)
    with pytest.raises(ValueError, match="max_autoloaded_adapters"):
        Tenant("t", max_autoloaded_adapters=True)


# --- the worker: names, and paths that lead out of --lora-dir ---------------------------------


@pytest.fixture
def lora_dir(tmp_path):
    root = tmp_path / "adapters"
    for name in ("sql", "org/chat"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (root / "out").symlink_to(outside)  # a directory link out of --lora-dir
    (root / "up").symlink_to("..")  # a link to --lora-dir's parent
    (root / "leaky").mkdir()
    (root / "leaky" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    (root / "alias").symlink_to("sql")  # inside: the operator's second name for sql
    return root


def test_the_worker_refuses_other_spellings_and_paths_out_of_its_lora_dir(lora_dir):
    lora_files = pytest.importorskip("worker.lora_files")
    AdapterError, path_of = lora_files.AdapterError, lora_files.runtime_adapter_path
    config = SimpleNamespace(lora_dir=str(lora_dir), max_lora_adapters=8, lora_modules=())
    assert path_of(config, (), "sql", "sql") == (lora_dir / "sql").resolve()
    assert path_of(config, (), "org/chat", "org/chat") == (lora_dir / "org" / "chat").resolve()
    for bad in BAD_SPELLINGS:  # the autoloader's path is the name: each one refused by name
        with pytest.raises(AdapterError) as refused:
            path_of(config, ("sql",), bad, bad)
        assert refused.value.kind == "invalid" and "is not canonical" in str(refused.value)
    for path in ("../outside", "out", "up/outside", "leaky", str(lora_dir.parent / "outside"), "sql/../.."):
        with pytest.raises(AdapterError) as refused:
            path_of(config, (), "x", path)
        message = str(refused.value)
        assert refused.value.kind == "invalid" and "is not a directory inside --lora-dir" in message, path
        assert str(lora_dir.parent) not in message.replace(repr(path), "")  # only the path it was given
    # an admin's path may be spelled any way that stays inside: the name is what must be canonical
    assert path_of(config, (), "chat", "sql/../org/./chat") == (lora_dir / "org" / "chat").resolve()
    assert path_of(config, (), "other", "alias") == (lora_dir / "sql").resolve()
