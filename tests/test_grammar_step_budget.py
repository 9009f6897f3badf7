"""An expensive grammar must not stall the engine step (issue 45 item 4, worker side).

Measured before this: `n: 16` with the regex `(a{1000}){1000}` took another tenant's 32-token plain
request from ~2 s alone to 31 s (this 2-vCPU box, in-process): each choice built its own matcher and
computed its first mask (~1-2 s here) on the engine thread, one after another, before the forward.

Proven here (worker/grammar.py):
- the 16 choices compile their grammar once (counted) and share its opening mask;
- that mask runs over the grammar step budget: the 16 choices fail alone (finish LENGTH, EOS their
  last token, counted as grammar failures and over-budget masks) in the step that started it, while
  a plain request beside them, and a cheap constrained one, finish as they would alone; the pool is
  whole afterwards; synchronous and async scheduling;
- the fast path (one compiled grammar per text, masks beside the forward on the mask threads) gives
  the reference path's masks (a fresh matcher per row, masks one after another) row by row, and the
  same engine outputs;
- the compiled-grammar cache is bounded; the option is checked.
No timing assertion: the proof is structural (an over-budget mask is one the step did not wait for).
"""

from __future__ import annotations

import pytest
import torch

from common.structured import grammar_for
from tests.test_async_scheduling import Request, run
from worker.config import EngineConfig
from worker.sequence import Sequence
from worker.types import FinishReason, SamplingParams

llguidance = pytest.importorskip("llguidance")

EXPENSIVE = "(a{1000}){1000}"  # its opening mask: 0.9-6 s here (lexer built lazily), ~1 ms to compile
BUDGET_S = 0.2  # well under that mask, well over a cheap one (~0.1 ms) on a loaded box
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def regex(text: str) -> str:
    return grammar_for({"type": "regex", "regex": text})


@pytest.fixture
def grammars(runner, monkeypatch):
    """The shared runner with a Grammars of its own for the test (counters from zero)."""

    def make(**attrs):
        fresh = runner.sampler.grammars.sibling()
        for name, value in attrs.items():
            setattr(fresh, name, value)
        monkeypatch.setattr(runner.sampler, "grammars", fresh)
        return fresh

    return make


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n16_expensive_choices_compile_once_and_fail_alone_beside_a_plain_request(
    make_engine, grammars, tokenizer, async_scheduling
):
    prompt = tokenizer.encode("Write the letter a many times:")
    plain = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    choice = grammar_for({"type": "choice", "choice": ["yes", "no"]})
    cheap = SamplingParams(max_tokens=8, temperature=0, grammar=choice)
    alone = run(
        make_engine(), [Request("plain", prompt, plain, 0, None), Request("cheap", prompt, cheap, 0, None)]
    )

    g = grammars(budget_s=BUDGET_S)
    engine = make_engine(async_scheduling=async_scheduling)
    expensive = [
        Request(
            f"c{i}",
            prompt,
            SamplingParams(max_tokens=8, temperature=0.8, seed=i, grammar=regex(EXPENSIVE)),
            0,
            None,
        )
        for i in range(16)
    ]
    out = run(
        engine,
        [Request("plain", prompt, plain, 0, None), Request("cheap", prompt, cheap, 0, None), *expensive],
    )
    engine.close()

    assert g.num_compiles == 2  # the 16 choices' grammar once, the cheap request's once
    eos = set(engine.runner.eos_token_ids)
    for r in expensive:
        got = out[r.request_id]
        assert got.finish_reason is FinishReason.LENGTH, (r.request_id, got)
        assert len(got.tokens) == 1 and got.tokens[0] in eos, (r.request_id, got.tokens)  # failed at once
    assert g.num_over_budget == 16 and engine.stats().num_grammar_failures == 16
    assert (engine.stats().num_grammar_over_budget, engine.stats().num_grammar_compiles) == (
        16,
        g.num_compiles,
    )
    # the others as alone: the plain request, and a constrained one whose masks are cheap
    assert out["plain"].tokens == alone["plain"].tokens and len(out["plain"].tokens) == 32
    assert out["plain"].finish_reason is FinishReason.LENGTH  # its max_tokens
    assert out["cheap"].tokens == alone["cheap"].tokens and out["cheap"].finish_reason is FinishReason.STOP
    assert tokenizer.decode([t for t in out["cheap"].tokens if t not in eos]) in ("yes", "no")
    engine.scheduler.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_without_a_budget_the_step_waits_for_the_expensive_mask(make_engine, grammars, tokenizer):
    """The other side of the budget: with none (0) the opening mask is waited for, the choices share
    it, and they fail later, on llguidance's own limit ("too many expressions constructed")."""
    g = grammars(budget_s=0)
    engine = make_engine()
    prompt = tokenizer.encode("Write the letter a many times:")
    params = [
        SamplingParams(max_tokens=4, temperature=0.8, seed=i, grammar=regex(EXPENSIVE)) for i in range(3)
    ]
    outs = engine.generate([prompt] * 3, params)
    assert g.num_compiles == 1 and g.num_over_budget == 0
    assert all(1 < len(o) <= 4 for o in outs), outs  # a token of a's, then EOS once the lexer gives up
    assert engine.stats().num_grammar_failures == 3


CASES = {
    "schema": (
        grammar_for({"type": "json_schema", "json_schema": {"schema": PERSON}}),
        '{"name": "Ann", "age": 31}',
    ),
    "json": (grammar_for({"type": "json_object"}), '{"a": [1, 2, {"b": null}]}'),
    "regex": (regex("[0-9]{3}-[a-z]+"), "123-abc"),
    "choice": (grammar_for({"type": "choice", "choice": ["yes", "no", "maybe"]}), "maybe"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_masks_equal_the_reference_row_by_row(runner, grammars, tokenizer, case):
    """Rows of one grammar at every position of a valid text, several at its start (the shared
    opening mask), their masks started on the mask threads and joined: each equals a fresh
    matcher's, computed alone on this thread."""
    grammar, text = CASES[case]
    g = grammars(budget_s=30.0)  # never reached: equality, not timing
    vocab = runner.model_config.vocab_size
    ids = tokenizer.encode(text)
    seqs = []
    for pos in list(range(len(ids) + 1)) + [0, 0]:
        seq = Sequence(f"{case}-{len(seqs)}", [1], SamplingParams(grammar=grammar))
        g.constrain(seq)
        if pos:
            for t in ids[:pos]:
                g.advance([seq], torch.tensor([t]))
        seqs.append((seq, pos))
    assert g.num_compiles == 1 and all(s.opening is None for s, p in seqs if p)
    g.start([s for s, _ in seqs])
    fast = g.banned([s for s, _ in seqs], vocab, runner.device)
    for row, (seq, pos) in enumerate(seqs):
        reference = llguidance.LLMatcher(g._llt(), grammar)
        assert reference.consume_tokens(ids[:pos])
        want = ~g.allowed([reference], vocab)[0]
        assert fast[row].tolist() == want.tolist(), (case, pos)
        assert not seq.grammar_failed
    assert fast[0].sum() < vocab  # something is allowed at the start


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fast_path_outputs_equal_the_reference_path(make_engine, grammars, tokenizer, async_scheduling):
    """n=3 seeded choices of a schema, a json_object, a regex and a plain row in one batch: the same
    tokens with the shared compiled grammar and parallel masks as with a fresh matcher per row and
    masks computed one after another."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Describe Ann, 31, as JSON."}])
    schema = grammar_for({"type": "json_schema", "json_schema": {"schema": PERSON}})
    requests = [
        Request(
            f"s{i}", prompt, SamplingParams(max_tokens=24, temperature=0.9, seed=i, grammar=schema), 0, None
        )
        for i in range(3)
    ]
    requests += [
        Request(
            "j",
            prompt,
            SamplingParams(max_tokens=16, temperature=0, grammar=grammar_for({"type": "json_object"})),
            0,
            None,
        ),
        Request(
            "r",
            prompt,
            SamplingParams(max_tokens=12, temperature=0.7, seed=4, grammar=regex("[0-9]{2,5}")),
            1,
            None,
        ),
        Request("p", prompt, SamplingParams(max_tokens=10, temperature=0), 0, None),
    ]
    reference = grammars(shared=False, parallel=False, budget_s=0)
    want = run(make_engine(async_scheduling=async_scheduling), requests)
    assert reference.num_compiles == 0  # nothing cached on the reference path
    fast = grammars(budget_s=30.0)
    got = run(make_engine(async_scheduling=async_scheduling), requests)
    assert fast.num_compiles == 3 and fast.num_failures == 0
    for rid, result in want.items():
        assert (got[rid].tokens, got[rid].finish_reason) == (result.tokens, result.finish_reason), rid
    assert want["r"].finish_reason is FinishReason.STOP and want["s0"].tokens


def test_the_compiled_grammar_cache_is_bounded(grammars, monkeypatch):
    import worker.grammar

    monkeypatch.setattr(worker.grammar, "GRAMMAR_CACHE_SIZE", 2)
    g = grammars()
    for text in ("a", "b", "a", "c", "a", "b"):  # b is evicted by c (a was used since)
        g.matcher(regex(text))
    assert g.num_compiles == 4 and len(g._cache) == 2


def test_the_budget_option_is_checked():
    with pytest.raises(ValueError, match="grammar_step_budget_ms"):
        EngineConfig(grammar_step_budget_ms=-1)
    assert EngineConfig().grammar_step_budget_ms == 100


def test_rows_held_up_behind_an_expensive_row_get_their_masks(runner, grammars):
    """The step's job computes rows in order: an expensive row first (its own matcher, not at a
    shared opening) holds the others up; at the budget it alone fails and the others are computed
    beside it, their masks those of fresh matchers."""
    g = grammars(budget_s=BUDGET_S)
    vocab = runner.model_config.vocab_size
    cheap = regex("[0-9]{3}")
    seqs = []
    for i, grammar in enumerate([regex(EXPENSIVE), cheap, cheap]):
        seq = Sequence(f"row{i}", [1], SamplingParams(grammar=grammar))
        g.constrain(seq)
        seq.opening = None  # as if past its start: the step's job computes it
        seqs.append(seq)
    g.start(seqs)
    banned = g.banned(seqs, vocab, runner.device)
    assert [s.grammar_failed for s in seqs] == [True, False, False]
    assert g.num_over_budget == 1 and g.num_failures == 1
    eos = sorted(t for t in runner.eos_token_ids if t < vocab)
    assert (~banned[0]).nonzero().flatten().tolist() == eos  # EOS only
    want = ~g.allowed([llguidance.LLMatcher(g._llt(), cheap)], vocab)[0]
    assert banned[1].tolist() == want.tolist() and banned[2].tolist() == want.tolist()
