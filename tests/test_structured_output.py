"""Structured output (response_format: json_object, json_schema; regex over gRPC), from the grammar
to the SDK: common/structured.py builds and validates the llguidance grammar, worker/grammar.py
masks the logits, the sampler advances each request's matcher.

Checked: the format's errors name the problem; the unpacked bitmask equals llguidance's own
byte-per-token form; a constrained generation is accepted whole by a fresh matcher (the reference)
and parses as an instance of the schema (greedy and seeded sampling, in one batch with an
unconstrained row whose tokens stay those it gets alone); the same tokens with async scheduling,
preemption and an abort in a small pool; ignore_eos refused; through a
real router and worker: the OpenAI SDK's json_schema answer parses, a bad schema is a 400 naming
response_format, and a gRPC regex constrains the text."""

from __future__ import annotations

import json
import re
import types

import openai
import pytest
import torch

from common.structured import grammar_for
from protos.llm.v1 import generation_pb2 as pb
from tests import procs
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    client,
    grpc_generate,
    router,
    stub,
    worker,
)
from tests.test_async_scheduling import Request, assert_same, run
from worker.types import FinishReason, SamplingParams

llguidance = pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a JSON object describing a person named Ann who is 31."}]


def schema_grammar(schema: dict) -> str:
    return grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})


@pytest.mark.parametrize(
    "fmt, problem",
    [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "nope"),
        ({"type": "json_schema", "json_schema": {}}, "json_schema.schema: required"),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70_000]}}}, "more than"),
        ({"type": "regex", "regex": "(unclosed"}, ""),
        ({"type": "yaml"}, "must be text, json_object, json_schema, regex, choice or grammar"),
        ({"type": "choice", "choice": []}, "choice: required, a non-empty list"),
        ({"type": "choice", "choice": ["a", ""]}, "choice: required, a non-empty list"),
        ({"type": "grammar", "grammar": "root ::= ("}, "GBNF:"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "unknown name"),
        ({"type": "grammar", "grammar": ""}, "grammar: required"),
    ],
)
def test_bad_formats_raise_naming_the_problem(fmt, problem):
    with pytest.raises(ValueError) as info:
        grammar_for(fmt)
    assert problem in str(info.value) and str(info.value)


def test_mask_unpacking_equals_llguidances_byte_mask(runner, tokenizer):
    matcher = runner.grammar_matcher(schema_grammar(PERSON))
    grammars, vocab = runner.sampler.grammars, runner.model_config.vocab_size
    for text in ("", '{"name": "A'):  # the opening state, then inside a string
        if text:
            assert matcher.consume_tokens(tokenizer.encode(text))
        want = [b != 0 for b in matcher.compute_logit_bias()][:vocab]
        got = grammars.allowed([matcher], vocab)[0]
        assert got.tolist()[: len(want)] == want and sum(want) > 0
    assert matcher.consume_tokens(tokenizer.encode('nn", "age": 31}'))
    only = grammars.allowed([matcher], vocab)[0]  # complete: only EOS may follow
    assert only.nonzero().flatten().tolist() == sorted(t for t in runner.eos_token_ids if t < vocab)
    with pytest.raises(ValueError, match="grammar"):
        runner.grammar_matcher('{"grammars": "not a grammar"}')


def test_a_grammar_failing_mid_generation_is_counted(make_engine, runner, tokenizer):
    """A token the grammar does not allow (the sampler never passes one; llguidance's resource
    limits can fail a matcher mid-way): only EOS may follow, and the engine's stats count it."""
    engine = make_engine()
    before = engine.stats().num_grammar_failures
    matcher = runner.grammar_matcher(schema_grammar(PERSON))
    seq = types.SimpleNamespace(matcher=matcher)
    runner.sampler.grammars.advance([seq], torch.tensor(tokenizer.encode("x")[:1]))  # not a "{"
    only = runner.sampler.grammars.allowed([matcher], runner.model_config.vocab_size)[0]
    assert only.nonzero().flatten().tolist() == sorted(t for t in runner.eos_token_ids if t < len(only))
    assert engine.stats().num_grammar_failures == before + 1


def test_engine_outputs_follow_the_schema_and_leave_other_rows_alone(make_engine, runner, tokenizer):
    prompt = tokenizer.encode_chat(ASK)
    grammar = schema_grammar(PERSON)
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = make_engine().generate([prompt], free)[0]
    params = [
        SamplingParams(max_tokens=48, temperature=0, grammar=grammar),
        SamplingParams(max_tokens=48, temperature=0.9, seed=5, grammar=grammar),
        free,
    ]
    outs = make_engine().generate([prompt] * 3, params)
    assert outs[2] == alone  # an unconstrained row in the batch: its tokens as alone
    for out in outs[:2]:
        reference = llguidance.LLMatcher(runner.sampler.grammars._llt(), grammar)  # a fresh matcher
        assert reference.consume_tokens(out) and reference.is_stopped(), tokenizer.decode(out)
        assert out[-1] in runner.eos_token_ids
        person = json.loads(tokenizer.decode(out[:-1]))
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert outs[0][0] != alone[0]  # unconstrained, the model opens with a code fence, not "{"


def test_async_scheduling_preemption_and_abort_keep_the_constrained_tokens(make_engine, tokenizer):
    grammar = grammar_for({"type": "json_object"})
    prompt = tokenizer.encode("A JSON object:")
    requests = [
        Request(
            f"j{i}", prompt, SamplingParams(max_tokens=20, temperature=0.7, seed=i, grammar=grammar), i, None
        )
        for i in range(3)
    ]
    requests.append(Request("abort", prompt, SamplingParams(max_tokens=20, seed=9, grammar=grammar), 1, 4))
    kwargs = dict(num_kv_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    sync_engine = make_engine(**kwargs)
    sync = run(sync_engine, requests)
    engine = make_engine(async_scheduling=True, **kwargs)
    assert_same(sync, run(engine, requests))
    engine.close()
    assert sync_engine.stats().num_preemptions > 0  # 3 x 23 tokens in a 48-token pool
    texts = [tokenizer.decode(sync[f"j{i}"].tokens) for i in range(3)]
    assert all(t.lstrip().startswith("{") and len(sync[f"j{i}"].tokens) > 4 for i, t in enumerate(texts)), (
        texts
    )
    assert sync["abort"].finish_reason is FinishReason.ABORT


def test_a_grammar_cannot_ignore_eos():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=grammar_for({"type": "json_object"}), ignore_eos=True)


def test_sdk_json_schema_answer_parses_and_a_bad_schema_is_400(client, router):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(model="", messages=ASK, max_tokens=48, response_format=fmt)
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and reply.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK, max_tokens=8, response_format=bad)
    assert info.value.param == "response_format" and "nope" in info.value.body["message"]
    counted = {
        dict(labels)["status"]: value
        for (name, labels), value in procs.scrape(router).items()
        if name == "llm_router_structured_requests_total" and ("format", "json_schema") in labels
    }
    assert counted.get("stop", 0) >= 1 and counted.get("invalid_argument", 0) >= 1, counted


def test_grpc_regex_constrains_the_text(stub):
    text, finished = grpc_generate(
        stub,
        AUTH,
        prompt="My favourite number is",
        response_format=pb.ResponseFormat(regex="[0-9]{3}"),
        sampling=pb.SamplingParams(temperature=0.8, seed=2),
        stopping=pb.StoppingCriteria(max_tokens=12),
    )
    assert re.fullmatch("[0-9]{3}", text) and finished.reason == pb.FINISH_REASON_STOP


def test_cost_benchmark_runs():
    from benchmarks.structured_output import main

    [row] = main(["--batches", "2", "--tokens", "6", "--rounds", "1"])
    assert row["batch"] == 2 and row["free_ms"] > 0 and row["constrained_ms"] > 0


def test_a_worker_without_llguidance_refuses_and_a_failed_add_fails_only_its_request(runner, monkeypatch):
    import asyncio

    import worker.grammar
    from worker.async_engine import AsyncEngine
    from worker.engine import LLMEngine
    from worker.grammar import Grammars

    monkeypatch.setattr(worker.grammar, "llguidance", None)
    monkeypatch.setattr(runner.sampler, "grammars", Grammars.for_model(None, ()))  # as on such a worker
    with pytest.raises(ValueError, match="unavailable on this worker: the llguidance package"):
        runner.grammar_matcher(grammar_for({"type": "json_object"}))

    engine = AsyncEngine(LLMEngine(runner.config, runner=runner))
    real_add = engine.engine.add_request

    def add(request_id, *args):
        if request_id == "broken":
            raise OSError("disk gone")  # not the request's fault: INTERNAL for it, the loop goes on
        return real_add(request_id, *args)

    monkeypatch.setattr(engine.engine, "add_request", add)
    engine.start()

    async def main():
        with pytest.raises(RuntimeError, match="could not be added"):
            await anext(engine.generate("broken", [1, 2, 3], SamplingParams(max_tokens=2)))
        return [
            o async for o in engine.generate("fine", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        ]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 2


def test_dev_client_sends_each_format(tmp_path):
    from devtools.client import build_request, parser

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    parse = lambda *flags: build_request(parser().parse_args(["hi", *flags]))  # noqa: E731
    assert parse("--json").response_format.json_object
    assert json.loads(parse("--json-schema", str(schema)).response_format.json_schema) == PERSON
    assert parse("--json-schema", '{"type": "integer"}').response_format.json_schema == '{"type": "integer"}'
    assert parse("--regex", "[0-9]+").response_format.regex == "[0-9]+"
    assert list(parse("--choice", "yes", "no").response_format.choice.options) == ["yes", "no"]
    assert parse("--grammar", 'root ::= "a"').response_format.grammar == 'root ::= "a"'
    (tmp_path / "g.gbnf").write_text('root ::= "b"')
    assert parse("--grammar", str(tmp_path / "g.gbnf")).response_format.grammar == 'root ::= "b"'
    assert parse().response_format.WhichOneof("kind") is None


THINKING = {  # text -> accepted with the block required (opened), optional (not opened)
    '<o>hm, one.<c>\n\n{"name": "Ann", "age": 31}': (False, True),
    'hm, one.<c>\n\n{"name": "Ann", "age": 31}': (True, False),
    '<c>{"name": "Ann", "age": 31}': (True, False),
    '{"name": "Ann", "age": 31}': (False, True),
    'hm </think> spelled out<c>{"name": "Ann", "age": 31}': (False, False),  # only the token ends it
    'hm<c>{"name": "Ann"}': (False, False),  # the answer still keeps the schema
    'hm<c>{"name": "Ann", "age": 31}<c>': (False, False),
}


@pytest.mark.parametrize("opened", [True, False], ids=["opened", "not-opened"])
def test_after_thinking_runs_the_format_after_the_think_block(opened):
    """A reasoning model's grammar (common.structured.after_thinking) against llguidance matchers on a
    vocabulary with <think> and </think> added: free text up to the </think> token, whitespace, then
    the schema; with `opened` the block is required, else optional and opened by <think>."""
    from common.structured import after_thinking
    from tests.tiny_models import build_tokenizer, thinking_tokenizer
    from worker.grammar import Grammars

    tok, base = thinking_tokenizer("qwen2"), build_tokenizer("qwen2")  # base: "</think>" spelled out
    open_id, close_id = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    grammars = Grammars(tok.to_str, (tok.token_to_id("<|im_end|>"),))
    grammar = after_thinking(schema_grammar(PERSON), opened, open_id, close_id)
    for text, accepted in THINKING.items():
        ids = []
        for part in text.replace("<o>", "\0<o>\0").replace("<c>", "\0<c>\0").split("\0"):
            ids += {"<o>": [open_id], "<c>": [close_id]}.get(part) or (base.encode(part).ids if part else [])
        matcher = grammars.matcher(grammar)
        ok = all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
        assert ok == accepted[0 if opened else 1], (text, matcher.get_error()[:300])
