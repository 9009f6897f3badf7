"""A constrained request whose grammar fails at the worker ends with finish reason LENGTH, not STOP.

Proven here: the regex `(a{1000}){1000}` passes the router's check (router/validation.py `_grammar`,
llguidance's validate_grammar) but its matcher fails mid-generation at the worker ("lexer error: too
many expressions constructed"). Only EOS is allowed after that, so the request ends at once; its
text does not match the regex, and it must say so: finish reason LENGTH (cut short, as OpenAI
clients read it; worker/grammar.py, worker/scheduler.py `_stop_reason`), with the worker's grammar
failure counter up by one. A grammar that completes in the same batch still ends STOP. Both with
the synchronous and the async scheduler.

Found by review 2026-12-04 (it ended STOP with the text 'aaaa': a client could not tell it from a
valid answer, only a metric recorded it).
"""

from __future__ import annotations

import re

import pytest

from router.validation import _grammar
from tests.test_async_scheduling import Request, run
from worker.types import FinishReason, SamplingParams

pytest.importorskip("llguidance")

FAILING = "(a{1000}){1000}"  # a million a's: a legal regex the router admits, too big for the lexer
COMPLETING = "a{2}"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_grammar_that_fails_at_the_worker_ends_length_and_is_counted(
    make_engine, tokenizer, async_scheduling
):
    engine = make_engine(async_scheduling=async_scheduling)
    prompt = tokenizer.encode("Write the letter a many times:")
    eos = set(engine.runner.eos_token_ids)

    def request(rid: str, regex: str) -> Request:
        grammar = _grammar("regex", regex)  # no ValidationError: admitted
        return Request(rid, prompt, SamplingParams(max_tokens=8, temperature=0, grammar=grammar), 0, None)

    before = engine.stats().num_grammar_failures
    out = run(engine, [request("failing", FAILING), request("completing", COMPLETING)])

    failing = out["failing"]
    text = tokenizer.decode([t for t in failing.tokens if t not in eos])
    assert not re.fullmatch(FAILING, text)  # cut short: not in the grammar's language
    assert failing.tokens[-1] in eos  # ended at once by the EOS forced after the failure...
    assert len(failing.tokens) < 8  # ...not by max_tokens
    assert failing.finish_reason is FinishReason.LENGTH, (failing.finish_reason, text)
    assert engine.stats().num_grammar_failures == before + 1  # counted once

    completing = out["completing"]
    assert completing.finish_reason is FinishReason.STOP
    assert re.fullmatch(COMPLETING, tokenizer.decode([t for t in completing.tokens if t not in eos]))
