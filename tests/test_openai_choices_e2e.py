"""Several choices in one OpenAI request, end to end (the official `openai` SDK, a real router
and worker; tests/openai_helpers.py's stack): `n` and a completions batch of prompts are one
generation per choice, prompt-major (index = prompt * n + j), the j-th choice of a prompt sampled
with seed + j. Checked: each choice's text is exactly that of the single request it stands for;
usage counts each prompt once and every completion token; a stream carries every choice (role
chunk, deltas, finish, one usage chunk) and equals the whole answer; per-choice logprob offsets;
a tenant's concurrency limit refuses the whole request (429) when one choice is over it, and a
client that leaves a multi-choice stream frees every KV block on the worker."""

from __future__ import annotations

import openai
import pytest

from tests import procs
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    FRANCE,
    PAIR_KEY,
    STORY,
    client,
    http_url,
    router,
    stub,
    worker,
)

FOX = "The quick brown fox"


def test_batch_of_prompts_with_n_is_each_choice_single_request(client):
    prompts, n, seed = [STORY, FOX], 2, 7
    common = dict(model="", max_tokens=6, temperature=1.0, logprobs=1, extra_body={"ignore_eos": True})
    reply = client.completions.create(
        prompt=prompts, n=n, seed=seed, **common, extra_headers={"X-Request-Id": "batch-1"}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3] and reply.id == "cmpl-batch-1"
    singles = [
        client.completions.create(prompt=prompts[k // n], seed=seed + k % n, **common) for k in range(4)
    ]
    assert [c.text for c in reply.choices] == [s.choices[0].text for s in singles]
    assert reply.choices[0].text != reply.choices[1].text  # seed + j: distinct samples of one prompt
    for choice, single in zip(reply.choices, singles):
        assert choice.logprobs.tokens == single.choices[0].logprobs.tokens
        assert choice.logprobs.text_offset[0] == 0  # each choice's offsets start at its own text
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens + singles[2].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_n_stream_equals_the_whole_answer(client):
    args = dict(model="", messages=FRANCE, n=3, max_completion_tokens=8, temperature=0.9, seed=3)
    whole = client.chat.completions.create(**args)
    texts, roles, finishes, usage = {}, {}, {}, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            roles[c.index] = roles.get(c.index) or c.delta.role
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices} and len(texts) == 3
    assert roles == dict.fromkeys(range(3), "assistant")
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    assert usage[0].prompt_tokens == whole.usage.prompt_tokens  # the prompt once, not three times


def test_a_choice_over_the_tenants_limit_refuses_the_request_and_frees_every_block(router, worker):
    with openai.OpenAI(base_url=http_url(router), api_key=PAIR_KEY, max_retries=0, timeout=120) as pair:
        ok = pair.completions.create(model="", prompt=STORY, n=2, max_tokens=2, temperature=0)
        assert len(ok.choices) == 2 and ok.choices[0].text == ok.choices[1].text  # greedy: the same
        with pytest.raises(openai.RateLimitError) as info:  # 3 open requests > max_concurrency 2
            pair.completions.create(
                model="", prompt=STORY, n=3, max_tokens=200, extra_body={"ignore_eos": True}
            )
        assert info.value.status_code == 429 and int(info.value.response.headers["retry-after"]) >= 1
        procs.wait_all_blocks_free(worker.address)  # the two admitted choices were cancelled
        long = dict(
            model="", prompt=STORY, n=2, max_tokens=400, temperature=0, extra_body={"ignore_eos": True}
        )
        with pair.completions.create(stream=True, **long) as stream:
            next(iter(stream))  # both choices have their first token: both hold KV blocks
            assert procs.worker_load(worker.address).num_running == 2
    load, _ = procs.wait_all_blocks_free(worker.address)
    assert load.num_running == 0


def test_choices_beyond_the_workers_room_run_in_turn(client, worker):
    """16 x (prompt + 12) tokens are more than this router may reserve on the worker (its whole
    pool): the first choices run to the end and free their room for the rest (waiting for every
    choice's first token before reading any further held that room forever)."""
    capacity = procs.worker_load(worker.address).num_total_blocks * 16
    prompt = " ".join([STORY] * 3)
    reply = client.completions.create(
        model="",
        prompt=prompt,
        n=16,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=90,
    )
    assert 16 * (reply.usage.prompt_tokens + 12) > capacity
    assert reply.usage.completion_tokens == 16 * 12 and len({c.text for c in reply.choices}) == 1
