"""LoRA adapters in the engine (worker/lora.py) against PEFT's own model over transformers.

The adapters are made and saved by PEFT itself (`get_peft_model(...).save_pretrained`) on a tiny
random float32 Llama, with random A and B (PEFT starts B at zero, which would hide every error):
- `wide`: every one of the seven projections, rank 4.
- `narrow`: q, v and down only, rank 8 with a rank_pattern (q: 2), an alpha_pattern on PEFT's
  module keys (layer 1's down: 4, v: 32) and rsLoRA scaling.
Checks: each adapter's logits and the base model's equal PEFT's to 1e-4 with all three in one batch
(chunked prefill), their tokens equal their runs alone (speculative drafts on, async scheduling on),
the prefix cache never serves one adapter's blocks to another or to the base model, every KV block
comes back, and the refusals (unknown adapter, what PEFT can save that we do not serve, shapes of
another model). The quantized CPU path (int4 SmolLM2, the C++ layer op) is checked in
test_quantized_base_keeps_the_layer_op.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from benchmarks.lora import write_adapter
from tests.tiny_llama import save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.lora_files import AdapterError, load_adapter
from worker.types import SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = [
    [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19],
    [44, 12, 9],
    [3, 4, 5, 6] * 6,
]
ADAPTERS = {
    "wide": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "narrow": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 2},
        alpha_pattern={"layers.1.mlp.down_proj": 4, "self_attn.v_proj": 32},  # PEFT's module keys
        use_rslora=True,
    ),
}


def _peft_model(hf, settings: dict, seed: int):
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base checkpoint path, {name: (adapter dir, PEFT model)}, the transformers base model)."""
    root = tmp_path_factory.mktemp("lora")
    path, hf = save_tiny(root, "llama")
    adapters = {}
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        model = _peft_model(hf, settings, seed)
        model.save_pretrained(root / name)
        adapters[name] = (root / name, model)
    return path, adapters, hf


def _engine(tiny, **overrides) -> LLMEngine:
    path, adapters, _ = tiny
    entries = tuple(f"{name}={directory}" for name, (directory, _) in adapters.items())
    settings = dict(model=str(path), dtype="float32", kv_cache_bytes=2**20, lora_modules=entries)
    return LLMEngine(EngineConfig(**(settings | overrides)))


def _greedy(n: int, adapter: str = "") -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, adapter=adapter)


def test_logits_equal_peft_with_adapters_and_base_in_one_batch(tiny):
    _, adapters, hf = tiny
    engine = _engine(tiny, max_num_batched_tokens=8, num_speculative_tokens=0)  # chunked prefill
    captured: dict[str, list[torch.Tensor]] = {}

    def observe(ids, logits):
        for rid, row in zip(ids, logits):
            captured.setdefault(rid, []).append(row.clone())

    engine.runner.logits_observer = observe
    names = ["wide", "", "narrow"]
    outs = engine.generate(PROMPTS, [_greedy(5, name) for name in names])
    refs = {"": hf} | {name: model for name, (_, model) in adapters.items()}
    for i, (name, prompt, out) in enumerate(zip(names, PROMPTS, outs)):
        with torch.no_grad():
            ref = refs[name](torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
        ours = torch.stack(captured[f"offline-0-{i}"])
        err = float((ours - ref).abs().max() / ref.abs().max())
        assert err <= 1e-4, (name, err)
    # the adapters matter: each one's logits differ from the base model's
    with torch.no_grad():
        base = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert float((captured["offline-0-0"][0] - base).abs().max()) > 0.1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["drafts", "async"])
def test_a_mixed_batch_gives_each_request_its_tokens_alone(tiny, mode):
    settings = dict(num_speculative_tokens=4) if mode == "drafts" else dict(async_scheduling=True)
    engine = _engine(tiny, max_num_batched_tokens=16, **settings)
    names = ["narrow", "", "wide", "narrow", "wide", ""]
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    params = [_greedy(12, name) for name in names]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in together[:3]}) == 3  # adapters change what is generated
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_never_crosses_adapters(tiny):
    engine = _engine(tiny, enable_prefix_caching=True)
    prompt = list(range(1, 50))  # three full blocks of 16

    def run(adapter: str) -> tuple[list[int], int]:
        rid = f"r{engine.num_steps}-{adapter}"
        engine.add_request(rid, prompt, _greedy(4, adapter))
        tokens, cached = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                cached = max(cached, out.num_cached_tokens)
        return tokens, cached

    base, cached = run("")
    assert cached == 0
    wide, cached = run("wide")
    assert cached == 0 and wide != base  # the base model's blocks are not the adapter's
    again, cached = run("wide")
    assert cached == 48 and again == wide  # its own blocks are
    narrow, cached = run("narrow")
    assert cached == 0
    fresh = _engine(tiny, enable_prefix_caching=True)
    assert fresh.generate([prompt], _greedy(4, "narrow")) == [narrow]


def test_unknown_adapter_is_refused(tiny):
    engine = _engine(tiny)
    with pytest.raises(ValueError, match=r"adapter 'nope' is not served here \(adapters: wide, narrow\)"):
        engine.add_request("x", [1, 2, 3], _greedy(2, "nope"))
    assert engine.info.adapters == ("wide", "narrow")


def _saved(tmp_path, hf, name: str, **settings):
    model = _peft_model(hf, settings, 7)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(target_modules=["q_proj"], use_dora=True), "DoRA"),
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["q_proj", "lm_head"]), "embeddings and lm_head are not supported"),
        (dict(target_modules=["q_proj"], lora_bias=True), "LoRA biases"),
        (dict(target_modules=["q_proj"], init_lora_weights="olora"), "trains against a changed base"),
    ],
    ids=["dora", "modules-to-save", "lm-head", "bias", "olora"],
)
def test_what_peft_saves_that_is_not_served_is_refused(tiny, tmp_path, settings, message):
    _, _, hf = tiny
    directory = _saved(tmp_path, hf, "bad", r=4, **settings)
    with pytest.raises(ValueError, match=message):
        _engine(tiny, lora_modules=(f"bad={directory}",))


def test_bad_entries_and_other_models_are_refused(tiny, tmp_path):
    path, adapters, _ = tiny
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        _engine(tiny, lora_modules=("just-a-path",))
    with pytest.raises(ValueError, match="cannot read .*adapter_config.json"):
        _engine(tiny, lora_modules=(f"gone={tmp_path / 'missing'}",))
    wide = adapters["wide"][0]
    with pytest.raises(ValueError, match="two adapters named 'a'"):
        _engine(tiny, lora_modules=(f"a={wide}", f"a={wide}"))
    other, other_hf = save_tiny(tmp_path, "llama", num_heads=8, num_kv_heads=8)  # q/k/v of other shapes
    directory = _saved(tmp_path, other_hf, "other", r=4, target_modules=["k_proj"])
    with pytest.raises(ValueError, match="k_proj: A .* do not fit the base model"):
        _engine(tiny, lora_modules=(f"other={directory}",))
    config = json.loads((wide / "adapter_config.json").read_text())
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="peft_type 'IA3'"):
        load_adapter("ia3", tmp_path / "ia3", None, torch.float32, "cpu")
    (tmp_path / "ga").mkdir()  # LoRA-GA subtracts its initial B A from the base weights it trains
    (tmp_path / "ga" / "adapter_config.json").write_text(
        json.dumps(config | {"init_lora_weights": "lora_ga"})
    )
    with pytest.raises(ValueError, match="'lora_ga' trains against a changed base"):
        load_adapter("ga", tmp_path / "ga", None, torch.float32, "cpu")
    # malformed configs, no weights: ValueErrors naming the adapter, never the directory's path
    engine, weights = _engine(tiny, lora_modules=()), (wide / "adapter_model.safetensors").read_bytes()
    for i, (bad, message) in enumerate(
        [
            ([1, 2], "not a JSON object"),
            (config | {"alpha_pattern": {"q_proj(": 4}}, "malformed config"),
            (config | {"lora_alpha": None}, "malformed config"),
            (config | {"lora_alpha": float("nan")}, "malformed config"),  # JSON's NaN: outputs were 0s
            (config | {"alpha_pattern": ["q_proj"]}, "malformed config"),
            (config, "no adapter_model.safetensors"),
        ]
    ):
        (tmp_path / f"m{i}").mkdir()
        (tmp_path / f"m{i}" / "adapter_config.json").write_text(json.dumps(bad))
        if i < 5:
            (tmp_path / f"m{i}" / "adapter_model.safetensors").write_bytes(weights)
        with pytest.raises(ValueError, match=message) as caught:
            load_adapter(f"m{i}", tmp_path / f"m{i}", engine.runner.model, torch.float32, "cpu")
        assert str(tmp_path) not in str(caught.value)
    with pytest.raises(ValueError, match="not served with tensor parallelism"):
        EngineConfig(model=str(path), lora_modules=(f"wide={wide}",), tensor_parallel_size=2)


@pytest.mark.parametrize(
    "k, n", [(576, 960), (40, 50), (80, 112)], ids=["smollm2-qkv", "odd-widths", "vector-tails"]
)
def test_the_op_s_lora_add_is_the_wrappers_sum(k, n):
    """worker/kernels/cpu_layers.cpp lora_add against LoRA's float32 formula: at most one bfloat16
    ulp apart (another summation order; 1e-5 where O(1) terms cancel), on the rows named only, for
    1 to 9 rows (tiles of 1-4 rows, one or several; widths with and without vector tails); with a
    block-diagonal B^T, reading only the shards' blocks gives the same sums as reading all of it."""
    from worker.kernels import cpu_ext

    if not cpu_ext.available():
        pytest.skip("the llm_cpu extension did not build here (no compiler?)")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, k, generator=gen).bfloat16()
    out = torch.randn(11, n, generator=gen).bfloat16()
    a = (torch.randn(48, k, generator=gen) * 0.1).bfloat16()
    bt = (torch.randn(48, n, generator=gen) * 0.1).bfloat16()
    cuts = [0, n // 2, n * 3 // 4, n]  # three shards of 16 rank rows each, like q|k|v
    shards = torch.tensor([[16 * i, 16 * i + 16, cuts[i], cuts[i + 1]] for i in range(3)])
    block = torch.zeros_like(bt)
    for r0, r1, n0, n1 in shards.tolist():
        block[r0:r1, n0:n1] = bt[r0:r1, n0:n1]
    none = torch.empty(0, dtype=torch.int64)
    for count in range(1, 10):
        rows = torch.randperm(11, generator=gen)[:count]
        others = [i for i in range(11) if i not in rows.tolist()]
        for weights, blocks in ((bt, none), (block, shards)):
            ref = out.clone()
            ref[rows] = (out[rows].float() + (x[rows].float() @ a.float().t()) @ weights.float()).bfloat16()
            ours = out.clone()
            torch.ops.llm_cpu.lora_add_(ours, x, a, weights, blocks, rows)
            assert torch.equal(ours[others], out[others])
            # one bfloat16 ulp, or float32's rounding of O(1) terms where they cancel to ~0
            ulp = (ref[rows].float().abs() * 2**-7).clamp_min(1e-5)
            assert bool(((ours[rows].float() - ref[rows].float()).abs() <= ulp).all()), (count, blocks)
            assert float((ours[rows] != ref[rows]).float().mean()) < 0.02
        full = out.clone()
        torch.ops.llm_cpu.lora_add_(full, x, a, block, none, rows)
        assert torch.equal(ours, full)  # the skipped blocks are zeros: nothing changes
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.llm_cpu.lora_add_(ours, x, a, bt, none, torch.tensor([11]))
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        torch.ops.llm_cpu.lora_add_(ours, x, a.float(), bt, none, rows)
    with pytest.raises(ValueError, match="shard 0 out of range"):
        torch.ops.llm_cpu.lora_add_(ours, x, a, bt, torch.tensor([[0, 16, 0, n + 1]]), rows)
    with pytest.raises(ValueError, match=r"int64 \[S, 4\]"):
        torch.ops.llm_cpu.lora_add_(ours, x, a, bt, torch.tensor([0, 16, 0, n]), rows)


def _prompt_logprobs(engine: LLMEngine, seqs: list[list[int]], adapters: list[str]) -> list[float]:
    for i, (seq, adapter) in enumerate(zip(seqs, adapters)):
        sampling = SamplingParams(max_tokens=1, prompt_logprobs=0, adapter=adapter)
        engine.add_request(f"score-{engine.num_steps}-{i}", seq, sampling)
    found: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                found[out.request_id] = [float(lp) for lp in out.prompt_logprobs]
    return [lp for rid in sorted(found) for lp in found[rid]]


def test_quantized_base_keeps_the_layer_op(tmp_path):
    """The embedded int4 SmolLM2 with adapters loaded: steps without an adapter row run the C++
    layer op as before and give the tokens of a worker without adapters; a zero adapter gives the
    base model's tokens too, a random one changes them; with the op's LoRA deltas or the Python
    layer loop's wrappers, the same logprobs."""
    shapes = {"q_proj": (576, 576), "v_proj": (576, 192), "down_proj": (1536, 576)}
    zero = write_adapter(tmp_path / "zero", 30, shapes, 8, 0, 0.0)
    rand = write_adapter(tmp_path / "rand", 30, shapes, 8, 1, 0.05)
    common = dict(kv_cache_bytes=64 * 2**20, max_num_batched_tokens=32, num_threads=1)
    plain = LLMEngine(EngineConfig(**common))
    served = LLMEngine(EngineConfig(**common, lora_modules=(f"zero={zero}", f"rand={rand}")))
    if plain.runner.cpu_layers is None:
        pytest.skip("the C++ layer op does not build here (worker/kernels/cpu_layers.py logs why)")
    assert served.runner.cpu_layers is not None
    prompts = [[1, 504, 3458, 282, 4649, 314, 216], [1, 19, 25, 31, 33, 42] * 3, [1, 7788, 29]]
    base = plain.generate(prompts, _greedy(10))
    names = ["zero", "", "rand"]
    mixed = served.generate(prompts, [_greedy(10, n) for n in names])
    assert mixed[:2] == base[:2]  # the zero adapter and the base model: the base model's tokens
    assert mixed[2] != base[2]
    # The op's LoRA deltas (C++ lora_add) against the wrappers' (the Python layer loop): the
    # logprob of every token of each generated sequence, teacher-forced. (Not greedy tokens: a
    # random adapter saturates the logits into exact bfloat16 ties, broken either way.)
    loop = LLMEngine(
        EngineConfig(**common, cpu_layer_op=False, lora_modules=(f"zero={zero}", f"rand={rand}"))
    )
    assert loop.runner.cpu_layers is None
    seqs = [p + out for p, out in zip(prompts, mixed)]
    ours, ref = _prompt_logprobs(served, seqs, names), _prompt_logprobs(loop, seqs, names)
    # Two float32 sums of one delta, rounded to bfloat16, differ by an ulp now and then, which this
    # random adapter amplifies: measured mean 0.05-0.07 nats, max 0.6 (the same as between the
    # wrappers' float32 sum and a float64 one); a delta on wrong rows or linears is nats.
    diffs = [abs(a - b) for a, b in zip(ours, ref)]
    assert sum(diffs) / len(diffs) <= 0.15 and max(diffs) <= 1.5, diffs
    assert ours != _prompt_logprobs(served, seqs, [""] * 3)
    op, calls = served.runner.cpu_layers, []
    served.runner.cpu_layers = lambda *args: calls.append(1) or op(*args)
    assert served.generate(prompts, _greedy(10)) == base  # base-only steps: the op, unchanged
    assert calls
    assert served.block_manager.num_free_blocks == served.block_manager.num_blocks
    # --lora-dir: every linear wrapped up front, the adapter loaded at run time into the op's inputs
    runtime = LLMEngine(EngineConfig(**common, lora_dir=str(tmp_path)))
    assert runtime.runner.cpu_layers is not None
    assert runtime.generate(prompts, _greedy(10)) == base
    runtime.load_adapter("rand", "rand")
    assert runtime.generate(prompts, [_greedy(10, n) for n in ("", "", "rand")]) == [*base[:2], mixed[2]]


def test_adapters_load_and_unload_at_run_time(tiny):
    """--lora-dir: adapters loaded between steps give the tokens of the same adapters loaded at
    start-up; unloading waits for their requests; a name loaded again with other weights never
    hits the prefix-cache blocks of its earlier load; every refusal names its reason."""
    path, adapters, _ = tiny
    root = adapters["wide"][0].parent
    prompts = [PROMPTS[0] * 3, PROMPTS[1]]  # the first spans three full blocks: cached
    ref = _engine(tiny, enable_prefix_caching=True)
    want = {name: ref.generate(prompts, [_greedy(6, name)] * 2) for name in ("wide", "narrow", "")}
    engine = _engine(
        tiny,
        lora_modules=(),
        lora_dir=str(root),
        max_lora_adapters=2,
        enable_prefix_caching=True,
        async_scheduling=True,
    )
    assert engine.info.adapters == ()
    assert engine.generate(prompts, [_greedy(6)] * 2) == want[""]
    engine.load_adapter("wide", "wide")  # relative to --lora-dir
    engine.load_adapter("other", str(adapters["narrow"][0]))  # absolute, inside it
    assert engine.info.adapters == ("wide", "other")
    assert engine.generate(prompts, [_greedy(6, "wide")] * 2) == want["wide"]
    assert engine.generate(prompts, [_greedy(6, "other")] * 2) == want["narrow"]
    refusals = [
        ("wide", "narrow", "exists", "loaded already"),
        ("x", "narrow", "full", "max-lora-adapters"),
        ("x", "no-such-dir", "invalid", "no adapter_config.json"),  # full, but the path is named first
    ]
    for name, where, kind, message in refusals:
        with pytest.raises(AdapterError, match=message) as caught:
            engine.load_adapter(name, where)
        assert caught.value.kind == kind
    engine.add_request("busy", prompts[1], _greedy(8, "wide"))
    engine.step()
    with pytest.raises(AdapterError, match="1 request"):
        engine.unload_adapter("wide")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_adapter("wide")
    with pytest.raises(ValueError, match="not served here"):
        engine.add_request("gone", prompts[1], _greedy(2, "wide"))
    with pytest.raises(AdapterError, match="not loaded"):
        engine.unload_adapter("wide")
    for name, where, message in [
        ("a", "../" + path.name, "not a directory inside"),
        ("a", "/etc", "not a directory inside"),
        ("a", "missing", "no adapter_config.json"),
        ("bad name!", "narrow", "adapter name"),
    ]:
        with pytest.raises(AdapterError, match=message):
            engine.load_adapter(name, where)
    # "wide" again, with narrow's weights: the same tokens as narrow, not wide's cached blocks
    engine.load_adapter("wide", "narrow")
    assert engine.generate(prompts, [_greedy(6, "wide")] * 2) == want["narrow"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(AdapterError, match="run-time LoRA loading is off") as caught:
        ref.load_adapter("x", "wide")
    assert caught.value.kind == "off"
