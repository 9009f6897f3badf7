"""Several Llama-family models behind one router, end to end over real processes.

Three tiny random checkpoints made here (tests/tiny_models.py: Llama-3 with llama3 RoPE scaling
and a byte-level BPE, Qwen2 with q/k/v bias, a SentencePiece-vocabulary Mistral) each served by
one worker; one router serves all three (the SentencePiece one from a tokenizer-only GGUF, so
router and worker read different files of one vocabulary; the Qwen2 one by hub id, from a local
Hugging Face cache made here, offline). A fourth worker claims the Llama-3 id
but serves the Qwen2 files: its tokenizer fingerprint differs and the router must never route to
it. Greedy tokens through router and worker equal transformers' on the same checkpoint.
"""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests.procs import metrics_url, ready, scrape, start_router, start_worker, stop_all
from tests.tiny_models import hub_cache, write_checkpoint, write_gguf_vocab

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MESSAGES = [{"role": "user", "content": "What is the capital of France? 日本語 😀 1234"}]
PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1)"
NUM_TOKENS = 12
WAIT_S = 60.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    kinds = ("llama3", "qwen2", "spm")
    dirs = {kind: write_checkpoint(kind, root / kind, seed=i) for i, kind in enumerate(kinds)}
    return dirs, write_gguf_vocab("spm", root / "spm-vocab.gguf")


@pytest.fixture(scope="module")
def stack(checkpoints, logs, tmp_path_factory):
    dirs, spm_gguf = checkpoints
    cache = tmp_path_factory.mktemp("hf-cache")
    hub_cache(cache, "tiny-org/qwen2", dirs["qwen2"])  # the qwen2 model is served by hub id
    with pytest.MonkeyPatch.context() as env:  # the processes inherit it: offline, this cache only
        env.setenv("HF_HUB_CACHE", str(cache))
        env.setenv("HF_HUB_OFFLINE", "1")
        yield from _stack(dirs, spm_gguf, logs)


def _stack(dirs, spm_gguf, logs):
    named = "--served-model-name"
    workers = {
        "tiny-llama3": start_worker(logs, "--model", str(dirs["llama3"]), named, "tiny-llama3"),
        "qwen2": start_worker(logs, "--model", "tiny-org/qwen2"),  # id by default: the hub id
        "tiny-spm": start_worker(logs, "--model", str(dirs["spm"]), named, "tiny-spm"),
        "impostor": start_worker(
            logs, "--model", str(dirs["qwen2"]), "--served-model-name", "tiny-llama3", "--metrics-port", "0"
        ),
    }
    router = None
    try:
        ready(*workers.values())
        models = f"tiny-llama3={dirs['llama3']},tiny-org/qwen2,tiny-spm={spm_gguf}"
        addresses = [w.address for w in workers.values()]
        router = start_router(logs, addresses, "--model", models, "--metrics-port", "0")
        ready(router)
        yield router, workers
    finally:  # side by side: each stop is mostly a drain announcement to wait out
        stop_all(*([router] if router is not None else []), *workers.values())


def _stub(router):
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.address))


def _list_models(router) -> dict[str, pb.ModelCard]:
    return {m.id: m for m in _stub(router).ListModels(pb.ListModelsRequest(), timeout=5).models}


def _wait_models(router, want: dict[str, int]) -> dict[str, pb.ModelCard]:
    deadline = time.monotonic() + WAIT_S
    while True:
        cards = _list_models(router)
        if {k: v.num_workers for k, v in cards.items()} == want:
            return cards
        assert time.monotonic() < deadline, f"router lists {cards}, want {want}:\n{router.log_tail()}"
        time.sleep(0.05)  # polling the router's view; no event to wait on across processes


def _generate(router, **fields) -> tuple[list[int], str]:
    ids, text = [], ""
    for msg in _stub(router).Generate(pb.GenerateRequest(**fields), timeout=60):
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
            text += msg.chunk.text
    return ids, text


def _greedy_reference(directory, prompt_ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    x = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            nxt = int(model(x).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


def test_lists_each_model_with_its_context_and_workers(stack, checkpoints) -> None:
    router, _ = stack
    cards = _wait_models(router, {"tiny-llama3": 1, "tiny-org/qwen2": 1, "tiny-spm": 1})
    assert all(card.max_model_len > 0 for card in cards.values())


@pytest.mark.parametrize(
    ("model", "kind"), [("tiny-llama3", "llama3"), ("tiny-org/qwen2", "qwen2"), ("tiny-spm", "spm")]
)
def test_greedy_tokens_equal_transformers(stack, checkpoints, model: str, kind: str) -> None:
    router, _ = stack
    _wait_models(router, {"tiny-llama3": 1, "tiny-org/qwen2": 1, "tiny-spm": 1})
    directory = checkpoints[0][kind]
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    greedy = pb.SamplingParams(temperature=0.0)
    stopping = pb.StoppingCriteria(max_tokens=NUM_TOKENS, ignore_eos=True)

    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    ids, text = _generate(router, model=model, chat=chat, sampling=greedy, stopping=stopping)
    rendered = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = _greedy_reference(directory, hf_tok.encode(rendered, add_special_tokens=False))
    assert ids == expected
    reference_text = hf_tok.decode(expected, skip_special_tokens=True)
    if "\ufffd" not in reference_text:  # random byte pieces: invalid UTF-8 is replaced differently
        assert text == reference_text  # (tokenizers' ByteFallback replaces a whole run of bytes)

    ids, _ = _generate(router, model=model, prompt=PROMPT, sampling=greedy, stopping=stopping)
    assert ids == _greedy_reference(directory, hf_tok.encode(PROMPT))  # with the model's BOS, if any


def test_unknown_or_missing_model_is_invalid_argument_naming_the_served_ids(stack) -> None:
    router, _ = stack
    for name, expected in (("nope", "unknown model 'nope'"), ("", "required")):
        with pytest.raises(grpc.RpcError) as err:
            _generate(router, model=name, prompt="hi")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in err.value.details() and "'tiny-llama3'" in err.value.details()


def test_worker_with_a_mismatched_tokenizer_is_not_routed_to(stack) -> None:
    router, workers = stack
    _wait_models(router, {"tiny-llama3": 1, "tiny-org/qwen2": 1, "tiny-spm": 1})
    impostor = workers["impostor"].address
    workers_url = metrics_url(router).replace("/metrics", "/workers")
    states = json.loads(urllib.request.urlopen(workers_url, timeout=5).read())
    refused = {s["worker"]: s["refused"] for s in states}
    assert "tokenizer fingerprint for model 'tiny-llama3' differs" in refused[impostor]
    assert [w for w, why in refused.items() if why] == [impostor]
    assert scrape(router)[("llm_router_worker_refused", (("worker", impostor),))] == 1
    assert f"worker {impostor} not routed: tokenizer fingerprint" in router.log_path.read_text()
    for _ in range(6):  # every one lands on the good worker
        _generate(router, model="tiny-llama3", prompt="hi", stopping=pb.StoppingCriteria(max_tokens=2))
    samples = scrape(workers["impostor"])
    assert sum(v for (name, _), v in samples.items() if name == "llm_requests_total") == 0


def test_unset_sampling_takes_the_models_generation_defaults(stack) -> None:
    """generation_config.json says temperature 0.6, top_p 0.9: a request that sets neither samples
    exactly as one that sets those values (same seed), and unlike one at 1.0."""
    router, _ = stack
    _wait_models(router, {"tiny-llama3": 1, "tiny-org/qwen2": 1, "tiny-spm": 1})
    stopping = pb.StoppingCriteria(max_tokens=16, ignore_eos=True)

    def run(**sampling):
        return _generate(
            router,
            model="tiny-org/qwen2",
            prompt="The capital",
            stopping=stopping,
            sampling=pb.SamplingParams(seed=7, **sampling),
        )[0]

    unset = run()
    assert unset == run(temperature=0.6, top_p=0.9)
    assert unset != run(temperature=1.0, top_p=1.0)


def test_loader_stops_on_generation_config_eos_ids(checkpoints, tmp_path) -> None:
    """Llama-3-Instruct names <|eot_id|> as an end token in generation_config.json only: the
    worker's engine must stop on every id listed there, not only config.json's."""
    from worker.model.loader import load_model

    copy = tmp_path / "llama3"
    copy.mkdir()
    for f in checkpoints[0]["llama3"].iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    generation = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [1, 4]}))
    config = json.loads((copy / "config.json").read_text())
    assert config["eos_token_id"] == 4
    assert load_model(copy).eos_token_ids == (4, 1)
