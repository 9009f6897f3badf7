"""Prefix caching on the real model (acceptance 5).

A second request sharing a 64-token prefix computes at most `prompt_len - 64` tokens; the same
prefix from another tenant (another salt) computes all of them. Outputs are unchanged by hits.
"""

from __future__ import annotations

from worker.types import SamplingParams


def computed_tokens(engine, request_id, prompt, salt):
    """Prompt tokens the engine actually computed for one request, counted from its plans."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=4), salt=salt)
    computed, out = 0, []
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            break
        computed += sum(s.num_new_tokens for s in plan.scheduled if s.seq.num_computed_tokens < len(prompt))
        tokens = engine.runner.launch(plan)
        sampled = tokens.to_host()
        for seq in engine.scheduler.update(plan, sampled, tokens.accepted):
            if seq.is_finished:
                engine.runner.release(seq.request_id)
        out.extend(sampled[request_id][:1] if request_id in sampled else [])
    return computed, out


def test_shared_prefix_is_not_recomputed_and_salt_isolates(make_engine, tokenizer):
    engine = make_engine()
    system = "You are a meticulous assistant. " * 12
    prefix = tokenizer.encode(system)[:64]
    a = prefix + tokenizer.encode(" First question: what is two plus two?")
    b = prefix + tokenizer.encode(" Second question: name a fruit.")
    n_a, out_a = computed_tokens(engine, "a", a, salt="tenant-1")
    assert n_a == len(a)
    hits_before = engine.block_manager.num_prefix_hits
    n_b, out_b = computed_tokens(engine, "b", b, salt="tenant-1")
    assert n_b <= len(b) - 64
    assert engine.block_manager.num_prefix_hits - hits_before >= 64
    n_c, out_c = computed_tokens(engine, "c", b, salt="tenant-2")
    assert n_c == len(b)
    assert out_c == out_b  # cached K/V give the same tokens as computed ones
