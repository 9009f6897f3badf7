"""LoRA adapters end to end: a real worker serving a tiny random Llama-3 checkpoint with two PEFT
adapters (`--lora-modules`), behind a real router. Each adapter is a model of its own to clients
(listed with its parent, chosen by `model`), tokenized and templated as its base model; its greedy
tokens equal PEFT's own model loaded from the same directory (`PeftModel.from_pretrained`); the
base model's stay the base model's; an unknown name is refused naming the served ids."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
import torch
import transformers

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests.openai_helpers import http_url, post
from tests.procs import open_channel, ready, start_router, start_worker, stop_all, wait_all_blocks_free
from tests.tiny_models import write_checkpoint

peft = pytest.importorskip("peft")
NUM_TOKENS = 6
PROMPT = [5, 9, 17, 33, 2, 8, 100, 41, 7, 3]


def _adapter(base_dir, out_dir, seed: int, targets: list[str]):
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def stack(tmp_path_factory, logs):
    root = tmp_path_factory.mktemp("lora-e2e")
    path = write_checkpoint("llama3", root / "base", seed=5)
    adapters = {
        "sql": _adapter(path, root / "sql", 1, ["q_proj", "v_proj", "down_proj"]),
        "poet": _adapter(path, root / "poet", 2, ["o_proj", "gate_proj", "up_proj"]),
    }
    entries = ",".join(f"{name}={d}" for name, d in adapters.items())
    worker = start_worker(
        logs, "--model", str(path), "--served-model-name", "tiny", "--lora-modules", entries
    )
    procs = [worker]
    try:
        ready(worker)
        router = start_router(logs, [worker.address], "--model", f"tiny={path}", "--http-port", "0")
        procs.append(router)
        ready(router)
        yield router, worker, path, adapters
    finally:
        stop_all(*procs)


def _generate(router, model: str, metadata=()) -> list[int]:
    request = pb.GenerateRequest(
        model=model,
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=NUM_TOKENS, ignore_eos=True),
    )
    with open_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [
            t
            for msg in stub.Generate(request, timeout=60, metadata=metadata)
            if msg.HasField("chunk")
            for t in msg.chunk.token_ids
        ]


def _peft_greedy(path, adapter_dir) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    x, out = torch.tensor([PROMPT]), []
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            out.append(int(model.eval()(x).logits[0, -1].argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_each_adapter_generates_peft_s_tokens(stack):
    router, worker, path, adapters = stack
    tokens = {name: _generate(router, name) for name in ("tiny", "sql", "poet")}
    assert tokens["tiny"] == _peft_greedy(path, None)
    for name, directory in adapters.items():
        assert tokens[name] == _peft_greedy(path, directory), name
    assert len({tuple(t) for t in tokens.values()}) == 3
    wait_all_blocks_free(worker.address)


def test_adapters_are_listed_and_served_over_http(stack):
    router, _, _, _ = stack
    with openai.OpenAI(base_url=http_url(router), api_key="x", max_retries=0, timeout=60) as client:
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "sql", "poet"}
        assert cards["sql"].model_extra["parent"] == "tiny" and "parent" not in cards["tiny"].model_extra
        assert client.models.retrieve("poet").model_extra["parent"] == "tiny"
        reply = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert reply.model == "sql" and reply.usage.completion_tokens >= 1
        # the base model's chat template and tokenizer: the prompt counts the same tokens
        base = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert reply.usage.prompt_tokens == base.usage.prompt_tokens
        text = client.completions.create(model="poet", prompt="Hello", max_tokens=3, stream=True)
        assert [c.model for c in text] and all(c.model == "poet" for c in text)
        implied = client.completions.create(model="", prompt="Hello", max_tokens=3, temperature=0)
        assert implied.model == "tiny"  # no model named: the base model, adapters aside
        with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
            client.completions.create(model="nope", prompt="Hello", max_tokens=3)


def test_unknown_adapter_over_grpc_names_the_served_ids(stack):
    router, _, _, _ = stack
    with pytest.raises(grpc.RpcError) as err:
        _generate(router, "nope")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model 'nope'" in err.value.details()


def test_run_time_loading_needs_the_worker_s_lora_dir(stack):
    """This worker has start-up adapters and no --lora-dir: a run-time load is refused as a
    conflict (409) naming the flag, and nothing changes."""
    router, _, _, adapters = stack
    url = http_url(router)
    body = json.dumps({"lora_name": "extra", "lora_path": str(adapters["sql"])}).encode()
    status, reply = post(f"{url}/load_lora_adapter", body, "x")  # no tenants file: loopback is admin
    assert status == 409 and "run-time LoRA loading is off" in reply["error"]["message"], reply
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as client:
        assert {m.id for m in client.models.list().data} == {"tiny", "sql", "poet"}
