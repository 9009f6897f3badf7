"""LoRA adapters loaded on demand (`--lora-autoload`, router/lora_autoload.py), end to end: a real
worker with `--lora-dir` and room for one adapter, behind a real router. A request naming an
adapter directory loads it (PEFT's own greedy tokens); naming another unloads the least recently
used one to make room, and the first comes back when named again; concurrent requests for one new
name share one load; a name that is not there is refused as an unknown model and not tried again
for --lora-autoload-retry-s; another spelling of an adapter's name is refused, never a second adapter
of its directory; a tenant's allow-list and autoload limit refuse before any load; an adapter an
admin loaded is never unloaded to make room."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from router.tenants import hash_key
from tests.openai_helpers import http_url, post
from tests.procs import ready, running_router, scrape, start_worker, wait_all_blocks_free
from tests.test_lora_e2e import _adapter, _generate, _peft_greedy
from tests.test_lora_runtime_e2e import _models
from tests.tiny_models import write_checkpoint

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, logs):
    root = tmp_path_factory.mktemp("lora-autoload")
    path = write_checkpoint("llama3", root / "base", seed=5)
    lora_dir = root / "adapters"
    _adapter(path, lora_dir / "sql", 1, ["q_proj", "v_proj", "down_proj"])
    _adapter(path, lora_dir / "poet", 2, ["o_proj", "gate_proj", "up_proj"])
    worker = start_worker(
        logs,
        *("--model", str(path), "--served-model-name", "tiny", "--lora-dir", str(lora_dir)),
        *("--max-lora-adapters", "1", "--metrics-port", "0"),
    )
    try:
        ready(worker)
        router_args = ("--model", f"tiny={path}", "--http-port", "0", "--metrics-port", "0")
        with running_router(
            logs, [worker.address], *router_args, "--lora-autoload", "--lora-autoload-retry-s", "600"
        ) as router:
            expected = {name: _peft_greedy(path, lora_dir / name) for name in ("sql", "poet")}
            yield router, worker, expected, path
    finally:
        worker.stop()


def _autoloads(router) -> dict[str, float]:
    page = scrape(router)
    name = "llm_router_lora_autoloads_total"
    return {dict(labels)["result"]: v for (n, labels), v in page.items() if n == name}


def _worker_loads(worker) -> dict[str, float]:
    page = scrape(worker)
    return {
        dict(labels)["result"]: v
        for (n, labels), v in page.items()
        if n == "llm_lora_adapter_operations_total" and dict(labels)["operation"] == "load"
    }


def _open_requests(router) -> float:
    """Requests the router counts open, all tenants: back to 0 after every refusal (claims released)."""
    return sum(v for (n, _), v in scrape(router).items() if n == "llm_router_tenant_open_requests")


def _served_and_other(main) -> tuple[set[str], str]:
    """The adapters `main` serves (one at least: `sql` is loaded when the module runs alone) and one
    it does not, which a request naming it would load."""
    if not set(_models(main)) - {"tiny"}:
        _generate(main, "sql")
    served = set(_models(main)) - {"tiny"}
    return served, ({"sql", "poet"} - served).pop()


def _refused(router, model: str, metadata=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _generate(router, model, metadata)
    return refused.value


def test_named_adapters_load_on_demand_and_the_least_recent_makes_room(stack):
    router, worker, expected, _ = stack
    assert set(_models(router)) == {"tiny"}
    assert _generate(router, "sql") == expected["sql"]
    assert set(_models(router)) == {"tiny", "sql"}
    assert _generate(router, "sql") == expected["sql"]  # served: no second load
    assert _generate(router, "poet") == expected["poet"]  # the worker holds one: sql makes room
    assert set(_models(router)) == {"tiny", "poet"}
    assert _generate(router, "sql") == expected["sql"]  # back again, in poet's place
    assert set(_models(router)) == {"tiny", "sql"}
    counts = _autoloads(router)
    assert counts.get("loaded") == 3 and counts.get("evicted") == 2, counts
    # Concurrent requests naming an adapter not loaded share one load.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _generate(router, "poet"), range(4)))
    assert results == [expected["poet"]] * 4
    counts = _autoloads(router)
    assert counts.get("loaded") == 4 and counts.get("evicted") == 3, counts
    wait_all_blocks_free(worker.address)


def test_a_name_that_is_not_there_is_an_unknown_model_and_not_retried_at_once(stack):
    router, worker, _, _ = stack
    before = _worker_loads(worker)
    first = _refused(router, "nothing-here")
    assert first.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model 'nothing-here'" in first.details() and "no adapter_config.json" in first.details()
    assert "127.0.0.1" not in first.details() and "/adapters" not in first.details()  # no path of theirs
    second = _refused(router, "nothing-here")  # from the router's memory: the worker is not asked
    assert second.code() == grpc.StatusCode.INVALID_ARGUMENT and second.details() == first.details()
    for name in ("../sql", "x y"):  # not adapter names: refused as before, no load tried
        bad = _refused(router, name)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in bad.details()
    after = _worker_loads(worker)
    assert after.get("invalid", 0) - before.get("invalid", 0) == 1, (before, after)
    # The HTTP front: the same refusal, as an OpenAI error body.
    body = json.dumps({"model": "nothing-here", "prompt": "hi", "max_tokens": 2}).encode()
    status, reply = post(f"{http_url(router)}/completions", body, None)
    assert status == 404 and "unknown model 'nothing-here'" in reply["error"]["message"], reply
    assert _autoloads(router).get("cached_failure") == 2
    assert _open_requests(router) == 0


def test_a_tenant_over_its_rate_causes_no_load(stack, logs):
    """Refused (429) before the router asks a worker to load, or unload to make room: a second
    router over the same worker, with one request a tenant's rate allows."""
    main, worker, _, path = stack
    served, other = _served_and_other(main)
    tenants = (
        f"tenants:\n  - name: limited\n    key_sha256: {hash_key('limited')}\n"
        "    rate_requests_per_s: 0.001\n    burst_requests: 1\n"
    )
    auth = (("authorization", "Bearer limited"),)
    extra = ("--model", f"tiny={path}", "--metrics-port", "0", "--lora-autoload")
    with running_router(logs, [worker.address], *extra, tenants=tenants, metadata=auth) as router:
        before = _worker_loads(worker)
        assert len(_generate(router, "tiny", auth)) > 0  # the one request its rate allows
        over = _refused(router, other, auth)
        assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in over.details()
        assert _worker_loads(worker) == before and not _autoloads(router) and _open_requests(router) == 0
    assert set(_models(main)) - {"tiny"} == served


def _admin(router, op: str, **body) -> tuple[int, dict]:
    """An admin's load or unload over HTTP (loopback, no tenants file)."""
    return post(f"{http_url(router)}/{op}_lora_adapter", json.dumps(body).encode(), None)


def test_other_spellings_of_an_adapter_are_refused_by_name_and_load_nothing(stack):
    """Once, `sql/`, `sql/.`, `sql//` and `x/../sql` each loaded `sql`'s directory as an adapter of
    its own: four entries in /v1/models, `sql` evicted, and the admin's load of `sql` refused as the
    worker was full. Now each is refused (400 naming the spelling to use) before any load."""
    router, worker, expected, _ = stack
    assert _generate(router, "sql") == expected["sql"]
    before = _worker_loads(worker)
    for bad in ("sql/", "sql/.", "sql//", "x/../sql"):
        body = json.dumps({"model": bad, "prompt": "hi", "max_tokens": 2}).encode()
        status, reply = post(f"{http_url(router)}/completions", body, None)
        message = reply["error"]["message"]
        assert status == 400 and f"adapter name {bad!r} is not canonical" in message, reply
        assert message.endswith("use 'sql'") and "/adapters" not in message
        refused = _refused(router, bad)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "not canonical" in refused.details()
        status, reply = _admin(router, "load", lora_name=bad, lora_path="sql")
        assert status == 400 and "is not canonical" in reply["error"]["message"], reply
    assert _worker_loads(worker) == before and set(_models(router)) == {"tiny", "sql"}
    assert _autoloads(router).get("bad_name") == 8 and _open_requests(router) == 0
    # The one adapter of that directory: an admin unloads it and loads it again, not refused as full.
    assert _admin(router, "unload", lora_name="sql")[0] == 200
    assert _admin(router, "load", lora_name="sql", lora_path="sql")[0] == 200
    assert _generate(router, "sql") == expected["sql"]
    assert _admin(router, "unload", lora_name="sql")[0] == 200
    assert set(_models(router)) == {"tiny"}


def test_a_tenant_names_only_its_adapters_and_autoloads_at_most_its_limit(stack, logs):
    """A second router over the same worker with a tenants file: `narrow` may use `chat-*` only (the
    base model too), `capped` may autoload none; both refused before the worker is asked to load."""
    main, worker, _, path = stack
    served, other = _served_and_other(main)
    tenants = (
        f"tenants:\n  - name: narrow\n    key_sha256: {hash_key('narrow')}\n"
        '    adapters: ["chat-*"]\n'
        f"  - name: capped\n    key_sha256: {hash_key('capped')}\n    max_autoloaded_adapters: 0\n"
    )
    narrow, capped = (("authorization", "Bearer narrow"),), (("authorization", "Bearer capped"),)
    extra = ("--model", f"tiny={path}", "--http-port", "0", "--metrics-port", "0", "--lora-autoload")
    with running_router(logs, [worker.address], *extra, tenants=tenants, metadata=narrow) as router:
        before = _worker_loads(worker)
        assert len(_generate(router, "tiny", narrow)) > 0  # a base model is no adapter
        for name in (other, "nothing-here"):  # the same answer whether it exists or not
            denied = _refused(router, name, narrow)
            assert denied.code() == grpc.StatusCode.PERMISSION_DENIED, denied.details()
            assert f"adapter {name!r} is not one this tenant may use" in denied.details()
            assert "['chat-*']" in denied.details()
        body = json.dumps({"model": other, "prompt": "hi", "max_tokens": 2}).encode()
        status, reply = post(f"{http_url(router)}/completions", body, "narrow")
        assert status == 403 and "may use" in reply["error"]["message"], reply
        over = _refused(router, other, capped)
        assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, over.details()
        assert "tenant 'capped' holds 0 adapter(s)" in over.details()
        assert "max_autoloaded_adapters (0)" in over.details()
        assert _worker_loads(worker) == before and _autoloads(router) == {"tenant_limit": 1}
        assert _open_requests(router) == 0
        with openai.OpenAI(base_url=http_url(router), api_key="narrow", max_retries=0, timeout=30) as client:
            listed = {m.id for m in client.models.list().data}
        assert listed == {"tiny"}, listed  # `served` holds one: the adapters it may not use are not listed
    assert set(_models(main)) - {"tiny"} == served


def test_an_adapter_an_admin_loaded_is_never_unloaded_to_make_room(stack):
    router, worker, expected, _ = stack
    loaded = set(_models(router)) - {"tiny"}
    for name in loaded:  # an autoloaded one: unloaded by the admin (loopback, no tenants file)
        status, reply = post(
            f"{http_url(router)}/unload_lora_adapter", json.dumps({"lora_name": name}).encode(), None
        )
        assert status == 200, reply
    status, reply = post(
        f"{http_url(router)}/load_lora_adapter",
        json.dumps({"lora_name": "sql", "lora_path": "sql"}).encode(),
        None,
    )
    assert status == 200, reply
    full = _refused(router, "poet")
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in full.details()
    assert dict(full.trailing_metadata()).get("retry-after-ms") == "1000"
    assert set(_models(router)) == {"tiny", "sql"} and _generate(router, "sql") == expected["sql"]
    assert _autoloads(router).get("full") == 1 and _open_requests(router) == 0
