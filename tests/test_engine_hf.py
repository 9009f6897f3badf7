"""Engine vs Hugging Face transformers on the real SmolLM2 GGUF (float32).

Acceptance 1: logits of the paged engine (prompt prefilled in chunks, then decode) match
`LlamaForCausalLM` within max relative error 1e-4. Acceptance 2 (second half): greedy generation
equals transformers' greedy `generate` for >= 32 tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from worker.types import SamplingParams

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three prime numbers and explain why 1 is not prime."},
    ],
]


@pytest.fixture(scope="module")
def hf_model():
    """transformers' LlamaForCausalLM on the same GGUF, float32: the reference no one here wrote,
    loaded in half the time: transformers parses the whole GGUF twice (config, then tensors: 3.5 s
    each, mostly the 49k-token vocabulary) and builds gguf's tensor-name map once per submodule
    (397 times, 5 s). Both are pure functions of their arguments, so they are memoized while it
    loads; the conversion itself (name mapping, q/k un-permutation, dequantization) is
    transformers' and gguf's own, and gives the same weights."""
    import gguf
    from transformers import AutoModelForCausalLM

    from common.model_files import default_model_path

    path = default_model_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_match_transformers_chunked_prefill_then_decode(make_engine, tokenizer, hf_model):
    # A 7-token budget forces every prompt through several prefill chunks, ending mid-block.
    engine = make_engine(max_num_batched_tokens=7, num_speculative_tokens=0)  # one row per step
    captured: dict[str, list[torch.Tensor]] = {}

    def observe(request_ids, logits):
        for rid, row in zip(request_ids, logits):
            captured.setdefault(rid, []).append(row.clone())

    engine.runner.logits_observer = observe
    try:
        prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        engine.runner.logits_observer = None
    rids = sorted(captured)
    assert len(rids) == 3
    for rid, prompt, output in zip(rids, prompts, outputs):
        full = torch.tensor([prompt + output[:-1]])
        with torch.no_grad():
            ref = hf_model(full).logits[0, len(prompt) - 1 :].float()  # (6, V)
        ours = torch.stack(captured[rid])  # (6, V)
        assert ours.shape == ref.shape
        err = rel_err(ours, ref)
        assert err <= 1e-4, f"{rid}: max relative error {err:.2e}"


def test_greedy_matches_transformers_generate(make_engine, tokenizer, hf_model):
    engine = make_engine()
    prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            # An explicit mask: the prompt holds <|im_end|> (id 2), which HF would take for padding.
            ids = torch.tensor([prompt])
            ref = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert len(out) == 32
        assert out == ref, f"engine {out}\nhf     {ref}"


def test_paris(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer.encode_chat(PROMPTS[0])
    [out] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=20))
    assert tokenizer.decode(out, skip_special_tokens=True) == "The capital of France is Paris."
