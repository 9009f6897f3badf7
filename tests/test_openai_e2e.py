"""The OpenAI-compatible HTTP front (issue 16 items 5-6), end to end: the official `openai` SDK
against a real router process (its HTTP port 0, announced in its log) and a real worker process.

Checked: chat and completions, streaming and not, usage with cached tokens, stop (and which stop
matched), seed, logprobs/top_logprobs, max_tokens / max_completion_tokens; the same text as the
gRPC API for the same request, the new sampling parameters included; a client that disconnects
(streaming, or waiting for a whole response) frees every KV block on the worker; the router's
trace parent; the load tester's OpenAI target (loadtest/openai_client.py) gets the same
per-request counts as its gRPC target. Errors (400 naming the parameter, 401, 429 with
Retry-After) and the per-protocol request counter: tests/test_openai_errors_e2e.py. Serving life
(503, SIGTERM drain, HTTPS, a client gone while queued): tests/test_openai_serving_e2e.py.
"""

from __future__ import annotations

import json

import pytest

from protos.llm.v1 import generation_pb2 as pb
from tests import procs
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    FRANCE,
    KEY,
    STORY,
    client,
    grpc_generate,
    grpc_tokens,
    http_url,
    post,
    post_and_leave,
    router,
    stub,
    worker,
)


def test_models_lists_the_served_model(client, stub):
    [card] = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    [model] = client.models.list().data
    assert model.id == card.id and model.model_extra["max_model_len"] == card.max_model_len


def test_chat_matches_grpc_and_reports_usage(client, stub):
    reply = client.chat.completions.create(model="", messages=FRANCE, max_completion_tokens=8, temperature=0)
    text, finished = grpc_generate(
        stub,
        AUTH,
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in FRANCE]),
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=8),
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == text and "Paris" in text
    assert (
        choice.finish_reason
        == {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[finished.reason]
    )
    assert reply.usage.completion_tokens == finished.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens == finished.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # the gRPC call ran second on the same prompt: its blocks were cached
    assert finished.usage.cached_prompt_tokens > 0


def test_completions_stream_equals_whole_and_reports_cached_tokens(client):
    whole = client.completions.create(model="", prompt=STORY, max_tokens=6, temperature=0)
    stream = client.completions.create(
        model="",
        prompt=STORY,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert whole.object == "text_completion"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text != ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    # same prompt twice: the second found its full blocks in the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_opens_with_the_role(client):
    chunks = list(
        client.chat.completions.create(model="", messages=FRANCE, max_tokens=4, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_ends_the_text_and_is_reported(client):
    full = client.completions.create(model="", prompt=STORY, max_tokens=12, temperature=0).choices[0].text
    words = full.split()
    stop = " " + words[len(words) // 2]
    cut = client.completions.create(model="", prompt=STORY, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop


def test_stop_token_id_is_reported_on_grpc(stub, client):
    _, ids, done = grpc_tokens(
        stub,
        AUTH,
        prompt=STORY,
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=6),
    )
    _, stopped = grpc_generate(
        stub,
        AUTH,
        prompt=STORY,
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=6, stop_token_ids=[ids[2]]),
    )
    assert stopped.reason == pb.FINISH_REASON_STOP and stopped.usage.completion_tokens == 3
    assert stopped.WhichOneof("stop_reason") == "stop_token_id" and stopped.stop_token_id == ids[2]
    assert done.WhichOneof("stop_reason") is None  # length: no stop matched
    reply = client.completions.create(
        model="", prompt=STORY, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[2]]}
    )
    assert reply.choices[0].model_extra["stop_reason"] == ids[2]


def test_seed_reproduces_and_logprobs_have_top_n(client):
    def story(seed):
        return client.completions.create(model="", prompt=STORY, max_tokens=8, temperature=1.0, seed=seed)

    a, b, c = story(7), story(7), story(8)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    a = client.chat.completions.create(
        model="", messages=FRANCE, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=3
    )
    content = a.choices[0].logprobs.content
    assert len(content) == a.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    legacy = client.completions.create(model="", prompt=STORY, max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == legacy.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_top_logprobs_agree_on_both_apis(client, stub):
    http = client.completions.create(model="", prompt=STORY, max_tokens=3, temperature=0, logprobs=2)
    chunks = [
        msg.chunk
        for msg in stub.Generate(
            pb.GenerateRequest(
                prompt=STORY,
                sampling=pb.SamplingParams(temperature=0, logprobs=1, top_logprobs=2),
                stopping=pb.StoppingCriteria(max_tokens=3),
            ),
            metadata=AUTH,
        )
        if msg.HasField("chunk")
    ]
    chosen = [lp for c in chunks for lp in c.logprobs]
    tops = [list(t.logprobs) for c in chunks for t in c.top_logprobs]
    assert all(len(c.top_logprobs) == len(c.token_ids) for c in chunks) and len(tops) == 3
    lp = http.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert [sorted(t.values(), reverse=True) for t in lp.top_logprobs] == [
        pytest.approx(t, abs=1e-4) for t in tops
    ]
    assert all(t[0] == pytest.approx(c, abs=1e-5) for t, c in zip(tops, chosen))  # greedy: the top one


def test_echo_scores_prompts_as_lm_eval_does(client, stub, router):
    """Prompt logprobs on gRPC (`sampling.prompt_logprobs`), then the request lm-evaluation-harness's
    local-completions sends for loglikelihood (token-id prompts in a batch, echo, logprobs 1,
    max_tokens 1): a greedy continuation scored in context has the generation's logprobs and is
    greedy by lm-eval's test; `max_tokens` 0 returns the prompt alone; echo streams too."""
    messages = list(
        stub.Generate(
            pb.GenerateRequest(
                prompt=STORY,
                sampling=pb.SamplingParams(temperature=0, logprobs=1, prompt_logprobs=2),
                stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True),
            ),
            metadata=AUTH,
        )
    )
    chunks = [m.chunk for m in messages if m.HasField("chunk")]
    assert [c.HasField("prompt_logprobs") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    scored = chunks[0].prompt_logprobs
    context = list(scored.token_ids)
    assert messages[-1].finished.usage.prompt_tokens == len(context) == len(scored.logprobs) + 1
    assert messages[-1].finished.usage.cached_prompt_tokens == 0  # computed whole, never from the cache
    pairs = zip(scored.top_logprobs, scored.logprobs)
    assert all(len(t.token_ids) == 2 and t.logprobs[0] >= lp for t, lp in pairs)
    continuation = [t for c in chunks for t in c.token_ids]
    generated = [lp for c in chunks for lp in c.logprobs]

    # lm_eval/models/openai_completions.py: LocalCompletionsAPI's loglikelihood payload and parsing
    body = {"model": "", "prompt": [context + continuation[:5], context], "temperature": 0}
    body |= {"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    status, reply = post(f"{http_url(router)}/completions", json.dumps(body).encode(), KEY)
    assert status == 200, reply
    first, second = sorted(reply["choices"], key=lambda c: c["index"])
    lp = first["logprobs"]
    assert len(lp["tokens"]) == len(context) + 5 + 1 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(context)] == pytest.approx(list(scored.logprobs), abs=1e-4)
    tail, tops = lp["token_logprobs"][len(context) : -1], lp["top_logprobs"][len(context) : -1]
    assert tail == pytest.approx(generated[:5], abs=1e-3)
    assert all(tok == max(top.values()) for tok, top in zip(tail, tops))  # lm-eval's is_greedy
    assert first["text"].startswith(STORY) and second["text"].startswith(STORY)
    assert len(second["logprobs"]["tokens"]) == len(context) + 1

    only = client.completions.create(model="", prompt=STORY, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == STORY and choice.finish_reason == "length" and only.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(context) and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(list(scored.logprobs), abs=1e-4)
    assert "".join(choice.logprobs.tokens) == STORY  # SmolLM2's pieces concatenate to the prompt
    offsets = [sum(map(len, choice.logprobs.tokens[:i])) for i in range(len(context))]
    assert choice.logprobs.text_offset == offsets

    whole = client.completions.create(model="", prompt=context, max_tokens=4, temperature=0, echo=True)
    stream = client.completions.create(
        model="", prompt=context, max_tokens=4, temperature=0, echo=True, stream=True
    )
    streamed = "".join(part.choices[0].text for part in stream if part.choices)
    plain = client.completions.create(model="", prompt=context, max_tokens=4, temperature=0)
    assert whole.choices[0].text == streamed == STORY + plain.choices[0].text


SAMPLING = dict(temperature=0.8, seed=11, presence_penalty=0.6, frequency_penalty=0.4)
EXTRAS = dict(min_p=0.05, repetition_penalty=2.0, top_k=40)  # vLLM's names, as extra_body


def test_new_sampling_parameters_give_the_same_text_on_both_apis(client, stub):
    bias_token = 1000
    http = client.completions.create(
        model="", prompt=STORY, max_tokens=8, **SAMPLING, logit_bias={str(bias_token): 5.0}, extra_body=EXTRAS
    )
    text, _ = grpc_generate(
        stub,
        AUTH,
        prompt=STORY,
        sampling=pb.SamplingParams(**SAMPLING, **EXTRAS, logit_bias={bias_token: 5.0}),
        stopping=pb.StoppingCriteria(max_tokens=8),
    )
    assert http.choices[0].text == text
    plain = client.completions.create(model="", prompt=STORY, max_tokens=8, temperature=0.8, seed=11)
    assert plain.choices[0].text != text  # the parameters did change the draw
    forced = client.completions.create(
        model="", prompt=STORY, max_tokens=4, temperature=0, logit_bias={str(bias_token): 100.0}
    )
    _, ids, _ = grpc_tokens(
        stub,
        AUTH,
        prompt=STORY,
        sampling=pb.SamplingParams(temperature=0, logit_bias={bias_token: 100.0}),
        stopping=pb.StoppingCriteria(max_tokens=4),
    )
    assert ids == [bias_token] * 4 and forced.usage.completion_tokens == 4


def worker_requests(worker) -> dict[str, float]:
    """The worker's llm_requests_total by final status (stop, length, cancelled, ...)."""
    samples = procs.scrape(procs.worker_metrics_address(worker.address))
    return {
        dict(labels)["status"]: v for (name, labels), v in samples.items() if name == "llm_requests_total"
    }


def test_disconnecting_clients_free_their_kv(client, router, worker):
    """Both calls would run 400 tokens (seconds): the worker must end them as cancelled, at once."""
    before = worker_requests(worker)
    long = dict(model="", prompt=STORY, max_tokens=400, temperature=0)
    with client.completions.create(stream=True, extra_body={"ignore_eos": True}, **long) as stream:
        next(iter(stream))  # a token arrived: the sequence holds KV blocks now
        busy = procs.worker_load(worker.address)
        assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
    load, _ = procs.wait_all_blocks_free(worker.address)
    assert load.num_running == 0
    # a whole (non-streaming) response the client stops waiting for, once its sequence runs
    started = post_and_leave(
        f"{http_url(router)}/completions",
        json.dumps({**long, "ignore_eos": True}).encode(),
        KEY,
        lambda: procs.worker_load(worker.address).num_running == 1,
        "the whole response's sequence running",
    )
    assert not started  # nothing to read before the whole response
    procs.wait_all_blocks_free(worker.address)

    def cancelled() -> float:
        return worker_requests(worker).get("cancelled", 0.0) - before.get("cancelled", 0.0)

    procs.wait_until(lambda: cancelled() >= 2, 30, "the worker counting both calls cancelled")
    after = worker_requests(worker)
    assert cancelled() == 2 and after.get("length", 0.0) == before.get("length", 0.0), (before, after)


def test_traceparent_parents_the_router_span_of_an_http_request(client, sink):
    trace_id, parent_id = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    reply = client.completions.create(
        model="",
        prompt="hi",
        max_tokens=1,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "http-trace-1"},
    )
    assert reply.id == "cmpl-http-trace-1"

    def root(spans):
        return [s for s in spans if s.trace_id == trace_id and s.name == "llm.v1.Generation/Generate"]

    [span] = root(sink.wait_for(lambda spans: bool(root(spans)), timeout_s=30))
    assert span.parent_span_id == parent_id and span.service == "llm-router"
    assert span.attributes["llm.protocol"] == "http"
    assert span.attributes["llm.request_id"] == "http-trace-1"
    stages = {s.name for s in sink.spans() if s.trace_id == trace_id and s.parent_span_id == span.span_id}
    assert {"auth", "validate", "admission", "queue", "route"} <= stages


def test_load_tester_openai_target_counts_equal_the_grpc_target(router, worker, tmp_path):
    """`python -m loadtest` with two targets, the router's gRPC port and its HTTP front: the same
    seeded plan gets the same per-request server counts (usage) on both."""
    from loadtest.cli import main

    out = tmp_path / "report"
    argv = [
        "--target",
        f"grpc={router.address}",
        "--target",
        f"openai={http_url(router)}",
        "--num-requests",
        "4",
        "--rate",
        "4",
        "--seed",
        "5",
        "--tenant",
        f"name=tests,key={KEY},input_len=uniform:16:40",
        "--output-len",
        "5",
        "--prompt-format",
        "tokens",
        "--out-dir",
        str(out),
        "--no-plots",
        "--no-progress",
    ]
    assert main(argv) == 0
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    by_target = {name: [r for r in requests if r["target"] == name] for name in ("grpc", "openai")}
    assert len(by_target["grpc"]) == len(by_target["openai"]) == 4
    for rows in by_target.values():
        assert all(r["status"] == "OK" for r in rows), [r["error"] for r in rows]
    counts = {
        name: sorted((r["input_len"], r["prompt_tokens"], r["completion_tokens"]) for r in rows)
        for name, rows in by_target.items()
    }
    assert counts["grpc"] == counts["openai"]
    assert all(p == n and c == 5 for n, p, c in counts["grpc"])
    procs.wait_all_blocks_free(worker.address)
