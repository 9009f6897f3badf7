"""A reasoning model's structured output, end to end: a tiny random Qwen2 checkpoint whose
vocabulary has <think> and </think> (not special) and whose template opens the think block, served
by a real worker and router. The router finds it reasons (router/openai/reasoning.py) and runs a
request's format after the think block (common.structured.after_thinking): the answer is split
into reasoning_content and content, and the content keeps the format (a choice, a regex; JSON
Schemas and grammars are wrapped the same way: tests/test_structured_output.py; tool calls read
from the content: tests/test_tool_answers.py). The model is random, so a logit bias on
</think> makes it end its thinking at once; the grammar still has to let </think> through first
(without the wrapping it could not be written and the whole answer would be reasoning)."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pytest

from benchmarks.lora import write_adapter
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests.openai_helpers import http_url
from tests.procs import ready, start_router, start_worker, stop_all
from tests.tiny_models import CHATML_TEMPLATE, write_checkpoint

pytest.importorskip("llguidance")

OPENING = CHATML_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, logs):
    path = write_checkpoint("qwen2", tmp_path_factory.mktemp("thinker"), seed=3, template=OPENING, think=True)
    # a LoRA adapter of the thinker (docs/lora.md) reasons as its base model does
    shapes = {"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (128, 64)}
    adapter = write_adapter(path.parent / "deep", 2, shapes, 4, 0, 0.1)
    worker = start_worker(
        logs, "--model", str(path), "--served-model-name", "thinker", "--lora-modules", f"deep={adapter}"
    )
    procs = [worker]
    try:
        ready(worker)
        router = start_router(logs, [worker.address], "--model", f"thinker={path}", "--http-port", "0")
        procs.append(router)
        ready(router)
        close = json.loads((path / "tokenizer.json").read_text())["added_tokens"][-1]
        assert close["content"] == "</think>"
        yield router, close["id"]
    finally:
        stop_all(*procs)


def chat(client, close_id: int, model: str = "thinker", **extra):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Pick one."}],
        max_tokens=24,
        temperature=0,
        logit_bias={str(close_id): 100},
        **extra,
    )


def test_a_format_holds_after_the_think_block(stack):
    router, close_id = stack
    with openai.OpenAI(base_url=http_url(router), api_key="x", max_retries=0, timeout=120) as client:
        reply = chat(client, close_id, extra_body={"guided_choice": ["yes", "no"]})
        [choice] = reply.choices
        assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop", reply
        assert not getattr(choice.message, "reasoning_content", None)  # thinking ended at once
        [choice] = chat(client, close_id, extra_body={"guided_regex": "[0-9]{2}"}).choices
        assert re.fullmatch("[0-9]{2}", choice.message.content) and choice.finish_reason == "stop", choice
        [choice] = chat(client, close_id, "deep", extra_body={"guided_choice": ["yes", "no"]}).choices
        assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop", choice


@pytest.mark.parametrize(
    "prompt, pattern",
    [
        (None, r"</think>\s{0,8}(red|blue)"),  # a chat: the template opened the block
        ("Pick one.<think>\n", r"</think>\s{0,8}(red|blue)"),  # a raw prompt that leaves it open
        ("Pick one.<think>x</think>", r"red|blue"),  # closed: optional, and the bias cannot open it
        ("Pick one.", r"red|blue"),
    ],
    ids=["chat", "open-prompt", "closed-prompt", "plain-prompt"],
)
def test_grpc_gets_the_think_block_the_prompt_left_open(stack, prompt, pattern):
    router, close_id = stack
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            model="thinker",
            sampling=pb.SamplingParams(temperature=0, logit_bias={close_id: 100}),
            stopping=pb.StoppingCriteria(max_tokens=24),
            response_format=pb.ResponseFormat(choice=pb.Choice(options=["red", "blue"])),
        )
        if prompt is None:
            request.chat.messages.add(role="user", content="Pick one.")
        else:
            request.prompt = prompt
        text = "".join(m.chunk.text for m in stub.Generate(request, timeout=60) if m.HasField("chunk"))
    assert re.fullmatch(pattern, text), text  # raw text: the block (if any), then the format
