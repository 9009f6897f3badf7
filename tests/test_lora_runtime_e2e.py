"""LoRA adapters loaded and unloaded at run time, end to end: a real worker with `--lora-dir` and
no adapters at start-up, behind a real router with a tenants file. An admin tenant loads an
adapter over HTTP (vLLM's POST /v1/load_lora_adapter); it is listed and serves PEFT's own greedy
tokens; other tenants are refused; bad names and paths are refused naming the problem; unloading
frees the name; a worker restarted without the adapter gets it back from the router."""

from __future__ import annotations

import json
import signal

import grpc
import openai
import pytest

from protos.llm.v1 import worker_pb2, worker_pb2_grpc
from router.tenants import hash_key
from tests.openai_helpers import http_url, post
from tests.procs import (
    open_channel,
    ready,
    running_router,
    scrape,
    start_worker,
    wait_all_blocks_free,
    wait_until,
)
from tests.test_lora_e2e import _adapter, _peft_greedy
from tests.test_lora_e2e import _generate as _generate_as
from tests.tiny_models import write_checkpoint

peft = pytest.importorskip("peft")
ADMIN, USER = "sk-admin-5e1f0c9a7b3d", "sk-user-2a8c6e4f1d9b"
TENANTS = (
    f"tenants:\n  - name: ops\n    key_sha256: {hash_key(ADMIN)}\n    admin: true\n"
    f"  - name: app\n    key_sha256: {hash_key(USER)}\n"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, logs):
    root = tmp_path_factory.mktemp("lora-runtime")
    path = write_checkpoint("llama3", root / "base", seed=5)
    lora_dir = root / "adapters"
    _adapter(path, lora_dir / "sql", 1, ["q_proj", "v_proj", "down_proj"])
    (lora_dir / "loop").symlink_to(lora_dir / "loop")  # resolving it raises
    (lora_dir / "linked").mkdir()  # its weights a link to a file outside --lora-dir
    (lora_dir / "linked" / "adapter_config.json").write_bytes(
        (lora_dir / "sql" / "adapter_config.json").read_bytes()
    )
    (lora_dir / "linked" / "adapter_model.safetensors").symlink_to(path / "model.safetensors")
    args = (
        "--model",
        str(path),
        "--served-model-name",
        "tiny",
        "--lora-dir",
        str(lora_dir),
        "--metrics-port",
        "0",
    )
    worker = start_worker(logs, *args)
    try:
        ready(worker)
        user = (("authorization", f"Bearer {USER}"),)
        with running_router(
            logs,
            [worker.address],
            "--model",
            f"tiny={path}",
            "--http-port",
            "0",
            "--metrics-port",
            "0",
            tenants=TENANTS,
            metadata=user,
        ) as router:
            yield router, worker, path, lora_dir, args
    finally:
        worker.stop()


def _post(router, route: str, key: str, body: dict) -> tuple[int, dict]:
    return post(f"{http_url(router)}/{route}", json.dumps(body).encode(), key)


USER_KEY = (("authorization", f"Bearer {USER}"),)


def _generate(router, model: str) -> list[int]:
    return _generate_as(router, model, USER_KEY)


def _models(router) -> dict[str, dict]:
    with openai.OpenAI(base_url=http_url(router), api_key=USER, max_retries=0, timeout=30) as client:
        return {m.id: m.model_extra for m in client.models.list().data}


def test_an_admin_loads_and_unloads_an_adapter_at_run_time(stack, logs):
    router, worker, path, lora_dir, _ = stack
    assert set(_models(router)) == {"tiny"}
    user = (("authorization", f"Bearer {USER}"),)
    with running_router(
        logs, [worker.address], "--model", f"tiny={path}", "--http-port", "0", tenants=TENANTS, metadata=user
    ) as other:  # another router replica: it learns of the adapter from the worker's info_version
        _load_and_unload(router, other, worker, path, lora_dir)


def _load_and_unload(router, other, worker, path, lora_dir) -> None:
    status, denied = _post(router, "load_lora_adapter", USER, {"lora_name": "sql", "lora_path": "sql"})
    assert status == 403 and "admin tenant" in denied["error"]["message"]
    status, loaded = _post(router, "load_lora_adapter", ADMIN, {"lora_name": "sql", "lora_path": "sql"})
    assert status == 200, loaded
    assert loaded == {
        "object": "lora_adapter",
        "lora_name": "sql",
        "base_model": "tiny",
        "num_workers": 1,
    }
    assert _models(router)["sql"]["parent"] == "tiny"  # listed as soon as the call returned
    assert _generate(router, "sql") == _peft_greedy(path, lora_dir / "sql")
    assert _generate(router, "tiny") == _peft_greedy(path, None)
    wait_until(lambda: "sql" in _models(other), 10, "the other router to list the adapter")
    assert _generate(other, "sql") == _peft_greedy(path, lora_dir / "sql")
    for body, status, message in [
        ({"lora_name": "sql", "lora_path": "sql"}, 400, "served already"),
        ({"lora_name": "tiny", "lora_path": "sql"}, 400, "served already"),
        ({"lora_name": "x", "lora_path": str(path)}, 400, "not a directory inside --lora-dir"),
        ({"lora_name": "x", "lora_path": "../base"}, 400, "not a directory inside --lora-dir"),
        ({"lora_name": "x", "lora_path": "nothing-here"}, 400, "no adapter_config.json"),
        ({"lora_name": "x y", "lora_path": "sql"}, 400, "adapter name"),
        ({"lora_name": "x" * 20000, "lora_path": "sql"}, 400, "adapter name"),
        ({"lora_name": "x", "lora_path": "a" * 5000}, 400, "4096"),
        ({"lora_name": "x", "lora_path": "loop"}, 400, "not a directory inside --lora-dir"),
        ({"lora_name": "x", "lora_path": "linked"}, 400, "not a directory inside --lora-dir"),
        ({"lora_name": "x", "lora_path": "sql", "base_model": "other"}, 400, "base_model"),
        ({"lora_name": "x"}, 400, "path: required"),
        ({"lora_path": "sql"}, 400, "lora_name: required"),
        ({"lora_name": 3, "lora_path": "sql"}, 400, "lora_name: must be a string"),
    ]:
        got, reply = _post(router, "load_lora_adapter", ADMIN, body)
        assert got == status and message in reply["error"]["message"], (body, reply)
        assert "127.0.0.1" not in json.dumps(reply)
    assert set(_models(router)) == {"tiny", "sql"}  # the refused loads left nothing behind
    loaded = scrape(worker)
    status, gone = _post(router, "unload_lora_adapter", ADMIN, {"lora_name": "sql"})
    assert status == 200 and gone["num_workers"] == 1, gone
    assert set(_models(router)) == {"tiny"}
    wait_until(lambda: set(_models(other)) == {"tiny"}, 10, "the other router to drop the adapter")
    with pytest.raises(grpc.RpcError) as refused:
        _generate(router, "sql")
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "unknown model 'sql'" in refused.value.details()
    )
    status, again = _post(router, "unload_lora_adapter", ADMIN, {"lora_name": "sql"})
    assert status == 404 and "not loaded" in again["error"]["message"]
    wait_all_blocks_free(worker.address)
    _check_metrics(router, worker, loaded)


def _check_metrics(router, worker, loaded: dict) -> None:
    """The worker's LoRA gauges with the adapter loaded (`loaded`) and after the unload, its
    operations by result (the five path refusals reached it; refused outright, none is rolled
    back: router/lora_admin.py DEFINITE), the router's
    requests and tokens by served model (the refused request for the unloaded name carries none)."""
    unloaded = scrape(worker)
    ops = {
        labels: value
        for (name, labels), value in unloaded.items()
        if name == "llm_lora_adapter_operations_total"
    }
    assert ops == {
        (("operation", "load"), ("result", "ok")): 1,
        (("operation", "load"), ("result", "invalid")): 5,
        (("operation", "unload"), ("result", "ok")): 1,
    }, ops
    gauges = [
        {n: v for (n, _), v in page.items() if n.startswith("llm_lora_")} for page in (loaded, unloaded)
    ]
    assert gauges[0]["llm_lora_adapters"] == 1 and gauges[1]["llm_lora_adapters"] == 0
    assert gauges[0]["llm_lora_adapters_max"] == gauges[1]["llm_lora_adapters_max"] == 16
    assert gauges[0]["llm_lora_adapter_memory_bytes"] > 0 == gauges[1]["llm_lora_adapter_memory_bytes"]
    # rank 4 on q, v and down of 2 layers in float32: A [4, in] and B^T [4, out] per projection,
    # q's and v's B^T the full q|k|v width (block-diagonal)
    assert gauges[0]["llm_lora_adapter_memory_bytes"] == 2 * 4 * 4 * (2 * (64 + 128) + (128 + 64))
    # --kv-cache-mb (tests/procs.py) sizes the pool as given: nothing set aside
    assert gauges[0]["llm_lora_reserved_memory_bytes"] == gauges[1]["llm_lora_reserved_memory_bytes"] == 0
    page = scrape(router)
    by_model = {labels: v for (n, labels), v in page.items() if n == "llm_router_requests_by_model_total"}
    assert by_model == {
        (("model", "sql"), ("status", "length")): 1,
        (("model", "tiny"), ("status", "length")): 1,
    }
    tokens = {labels: v for (n, labels), v in page.items() if n == "llm_router_tokens_by_model_total"}
    assert tokens[(("kind", "generation"), ("model", "sql"))] == 6
    assert tokens[(("kind", "prompt"), ("model", "sql"))] == 10


def test_a_restarted_worker_gets_the_router_s_adapters_back(stack, logs):
    router, worker, path, lora_dir, args = stack
    status, loaded = _post(router, "load_lora_adapter", ADMIN, {"lora_name": "again", "lora_path": "sql"})
    assert status == 200, loaded
    port = worker.address.rpartition(":")[2]
    worker.stop()
    restarted = start_worker(logs, *args, "--port", port)  # the same address, no adapter loaded
    try:
        ready(restarted)
        wait_until(lambda: "again" in _models(router), 30, "the router to load the adapter again")
        assert _generate(router, "again") == _peft_greedy(path, lora_dir / "sql")
        # Unloaded while the worker hangs (SIGSTOP: unreachable, adapters kept): the router drops
        # it at once and unloads it from the worker when that answers again.
        restarted.signal(signal.SIGSTOP)
        wait_until(lambda: "again" not in _models(router), 30, "the router to take the hung worker out")
        status, gone = _post(router, "unload_lora_adapter", ADMIN, {"lora_name": "again"})
        assert status == 200 and gone["num_workers"] == 0, gone
        restarted.signal(signal.SIGCONT)
        wait_until(lambda: not _worker_adapters(restarted), 30, "the router to unload it from the worker")
        wait_until(lambda: set(_models(router)) == {"tiny"}, 30, "the worker to be routed to again")
    finally:
        restarted.signal(signal.SIGCONT)
        restarted.stop()


def _worker_adapters(worker) -> list[str]:
    with open_channel(worker.address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return list(info.adapters)
