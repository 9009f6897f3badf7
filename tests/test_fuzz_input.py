"""Hostile input (issue 9), in process: random and adversarial requests never get past validation as
anything but a `ValidRequest` or a field-named `ValidationError`.

1. Property tests (hypothesis) over every `GenerateRequest` field: text with control characters,
   NUL, bidi marks, special-token text and Jinja syntax, huge repeated strings, token ids past the
   vocabulary up to 2**32-1, NaN / +-inf / -0 floats, huge integers, many long repeated stop
   strings, chat messages with odd roles; and raw bytes parsed as the message. Valid requests then
   go through the servicer's own tokenization (`GenerationService._tokenize`) and `fit_to_context`,
   and random token ids through the relay's detokenizer + stop-string path.
4. atheris (pinned in requirements-dev.txt; a cp311 wheel exists): fuzz/fuzz_validation.py runs
   coverage-guided for a bounded number of inputs and must exit 0.

Through real processes (sections 2 and 3): tests/test_fuzz_e2e.py.
"""

from __future__ import annotations

import math
import pathlib
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.errors import ValidationError
from router.service import GenerationService
from router.stop_strings import StopStringMatcher
from router.validation import CHAT_ROLES, ModelSpec, ValidRequest, fit_to_context, validate

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 49152  # the embedded SmolLM2's vocabulary (checked against the tokenizer)
MODEL = ModelSpec("smollm", max_model_len=1088, vocab_size=VOCAB)
MODELS = {MODEL.name: MODEL}
# tokenizing is the slow part; the checks do not depend on it (nor on the router's message bound)
LIMITS = Limits(max_prompt_chars=20_000, max_chat_messages=256)
FIELD = re.compile(
    r"^(request|request_id|model|input|prompt|chat\.messages(\[\d+\]\.role)?|token_ids\.ids|"
    r"sampling\.(temperature|top_p|top_k|logprobs)|stopping\.(max_tokens|stop(\[\d+\])?|"
    r"stop_token_ids)): "
)

# ---------------------------------------------------------------- 1. property tests (pure)

NASTY = [
    "\x00",
    "\x01",
    "\x1b[2J",
    "\r\n",
    "\t",
    "\x7f",
    "\u0085",
    "\u2028",
    "\u202e",
    "\ufeff",
    "\ufffd",
    "😀",
    "中",
    "\U0010ffff",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "{{ 7*7 }}",
    "{% for x in y %}",
    "'",
    '"',
    "\\",
    "%s",
    " ",
    "1",
]
UINT32 = 2**32 - 1
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf strings are UTF-8
nasty_text = st.one_of(
    any_text,
    st.lists(st.sampled_from(NASTY), max_size=30).map("".join),
    st.builds(lambda piece, n: piece * n, st.sampled_from(NASTY + ["ab", "word "]), st.integers(0, 25_000)),
)
token_id = st.one_of(
    st.integers(0, VOCAB - 1),
    st.integers(0, UINT32),
    st.sampled_from([0, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, UINT32]),
)
odd_float = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 1.0, 3.4e38, -1.0]), st.floats(width=32)
)
roles = st.one_of(st.sampled_from(("", "User", "tool", "system\x00", "<|im_start|>", "assistant ")), any_text)


def optional(strategy):
    return st.one_of(st.none(), strategy)


def mostly(sane, hostile):
    """A field's values: sane 19 times in 20, so that about half the requests get past every check
    and a refusal is the hostile value under test (the text fields are hostile throughout)."""
    return st.integers(0, 19).flatmap(lambda n: hostile if n == 0 else sane)


@st.composite
def requests(draw) -> pb.GenerateRequest:
    printable = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=140)
    bad_model = st.sampled_from(["gpt-9", "smollm\x00", "SMOLLM"])
    req = pb.GenerateRequest(
        request_id=draw(mostly(st.sampled_from(["", "req-1"]), st.one_of(any_text, printable))),
        model=draw(mostly(st.sampled_from(["", MODEL.name]), bad_model)),
        priority=draw(mostly(st.integers(-1, 5), st.integers(-(2**31), 2**31 - 1))),
    )
    kind = draw(mostly(st.sampled_from(["prompt", "chat", "token_ids"]), st.none()))
    if kind == "prompt":
        req.prompt = draw(nasty_text)
    elif kind == "chat":
        req.chat.SetInParent()
        num = draw(mostly(st.integers(1, 6), st.sampled_from([0, LIMITS.max_chat_messages + 1])))
        for _ in range(num):
            role = draw(mostly(st.sampled_from(CHAT_ROLES), roles))
            req.chat.messages.add(role=role, content=draw(nasty_text))
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(draw(st.lists(mostly(st.integers(0, VOCAB - 1), token_id), max_size=40)))
        repeats = draw(mostly(st.sampled_from([0, 500]), st.sampled_from([1087, 1088, 5000])))
        req.token_ids.ids.extend([draw(st.integers(0, VOCAB - 1))] * repeats)
    s = req.sampling
    for name, sane in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1))):
        if (value := draw(mostly(optional(sane), odd_float))) is not None:
            setattr(s, name, value)
    s.top_k = draw(
        mostly(
            st.integers(0, 100),
            st.one_of(st.sampled_from([VOCAB, VOCAB + 1, UINT32]), st.integers(0, UINT32)),
        )
    )
    s.logprobs = draw(
        mostly(st.integers(0, 1), st.one_of(st.sampled_from([2, UINT32]), st.integers(0, UINT32)))
    )
    if (seed := draw(optional(st.integers(0, 2**64 - 1)))) is not None:
        s.seed = seed
    stop = req.stopping
    huge_int = st.one_of(st.sampled_from([0, 4096, 4097, UINT32]), st.integers(0, UINT32))
    if (max_tokens := draw(mostly(optional(st.integers(1, 64)), huge_int))) is not None:
        stop.max_tokens = max_tokens
    stop_text = nasty_text.map(lambda t: (t or "\x00")[:64])
    bad_stop = st.sampled_from(["", "x" * 65, "\x00" * 100])
    stop.stop.extend(draw(st.lists(mostly(stop_text, bad_stop), max_size=4)))
    stop.stop.extend([draw(st.sampled_from(NASTY))] * draw(mostly(st.just(0), st.sampled_from([8, 9, 1000]))))
    stop.stop_token_ids.extend(draw(st.lists(mostly(st.integers(0, VOCAB - 1), token_id), max_size=8)))
    stop.stop_token_ids.extend([draw(token_id)] * draw(mostly(st.just(0), st.sampled_from([56, 65]))))
    stop.ignore_eos = draw(st.booleans())
    return req


def check_valid(v: ValidRequest) -> None:
    """The invariants a ValidRequest promises the stages after validation."""
    assert v.model == MODEL
    assert sum(x is not None for x in (v.prompt, v.chat, v.prompt_token_ids)) == 1
    if v.prompt is not None:
        assert 0 < len(v.prompt) <= LIMITS.max_prompt_chars
    if v.chat is not None:
        assert 0 < len(v.chat) <= LIMITS.max_chat_messages
        assert all(m["role"] in CHAT_ROLES for m in v.chat) and any(m["content"] for m in v.chat)
    if v.prompt_token_ids is not None:
        assert v.prompt_token_ids and all(0 <= t < VOCAB for t in v.prompt_token_ids)
    assert math.isfinite(v.temperature) and v.temperature >= 0
    assert math.isfinite(v.top_p) and 0 < v.top_p <= 1
    assert 0 <= v.top_k <= VOCAB and isinstance(v.logprobs, bool)
    assert v.max_tokens is None or 1 <= v.max_tokens < MODEL.max_model_len
    assert len(v.stop) <= LIMITS.max_stop_strings
    assert all(0 < len(s) <= LIMITS.max_stop_string_len for s in v.stop)
    assert len(v.stop_token_ids) <= LIMITS.max_stop_token_ids
    assert all(0 <= t < VOCAB for t in v.stop_token_ids)
    assert 0 < len(v.request_id) <= LIMITS.max_request_id_len
    assert v.request_id.isascii() and v.request_id.isprintable() and " " not in v.request_id


def validate_or_field_error(req: pb.GenerateRequest) -> ValidRequest | None:
    """validate(); a refusal must be a ValidationError naming a field (anything else propagates)."""
    try:
        valid = validate(req, LIMITS, MODELS)
    except ValidationError as err:
        assert FIELD.match(str(err)), str(err)
        event(f"refused: {err.field.split('[')[0]}")
        return None
    check_valid(valid)
    event("valid")
    return valid


FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@settings(FUZZ, max_examples=400)
@given(req=requests())
def test_validate_returns_a_valid_request_or_names_the_field(req):
    validate_or_field_error(req)


@settings(FUZZ, max_examples=300)
@given(
    raw=st.one_of(st.binary(max_size=300), requests().map(lambda r: r.SerializeToString()[:4000])),
    flips=st.lists(st.tuples(st.integers(0, 3999), st.integers(0, 255)), max_size=4),
)
def test_raw_bytes_parse_or_fail_with_decode_error_only(raw, flips):
    data = bytearray(raw)
    for pos, byte in flips:
        if pos < len(data):
            data[pos] = byte
    req = pb.GenerateRequest()
    try:
        req.ParseFromString(bytes(data))
    except DecodeError:
        return
    validate_or_field_error(req)


@pytest.fixture(scope="module")
def tokenize(tokenizer):
    assert tokenizer.vocab_size == VOCAB
    models = SimpleNamespace(tokenizer=lambda model: tokenizer)  # the one model the fuzzer serves
    return GenerationService._tokenize.__get__(SimpleNamespace(_models=models, _limits=LIMITS))


@settings(FUZZ, max_examples=150)
@given(req=requests())
def test_tokenize_and_fit_valid_requests(tokenize, req):
    valid = validate_or_field_error(req)
    if valid is None:
        return
    try:
        prompt_ids = tokenize(valid)  # the servicer's own method; it may only raise ValidationError
    except ValidationError as err:  # (a chat the template renders longer than max_prompt_chars)
        assert FIELD.match(str(err)), str(err)
        event("renders too long")
        return
    assert all(0 <= t < VOCAB for t in prompt_ids)
    try:
        max_tokens = fit_to_context(valid, len(prompt_ids), LIMITS)
    except ValidationError as err:
        assert FIELD.match(str(err)), str(err)
        event("does not fit the context")
        return
    event("fits the context")
    assert 1 <= max_tokens and len(prompt_ids) + max_tokens <= MODEL.max_model_len


@settings(FUZZ, max_examples=200)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=60),
    cuts=st.lists(st.integers(1, 5), min_size=1),
    stops=st.lists(st.one_of(st.sampled_from(NASTY).filter(bool), any_text.filter(bool)), max_size=8),
    stop_from_text=st.tuples(st.integers(0, 200), st.integers(1, 6)),
)
# CI's find: "!" then a lone byte token in one message; the stop "!" ends the stream before flush()
@example(ids=[17, 111], cuts=[2], stops=[], stop_from_text=(0, 1))
def test_detokenizer_and_stop_strings_on_random_ids(tokenizer, ids, cuts, stops, stop_from_text):
    """The relay's path, ids -> IncrementalDetokenizer -> StopStringMatcher, on any ids in the
    vocabulary: deltas join to the full decode; a stop cuts exactly before an occurrence."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    start, length = stop_from_text
    if full[start : start + length]:
        stops.append(full[start : start + length])  # so that stops really occur
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    matcher = StopStringMatcher(tuple(stops))
    deltas, out, stopped, i = [], "", False, 0
    for cut in cuts * (len(ids) + 1):
        if i >= len(ids) or stopped:
            break
        delta = detok.push(ids[i : i + cut])
        deltas.append(delta)
        text, stopped = matcher.push(delta)
        out += text
        i += cut
    if not stopped:  # the relay's end of stream
        tail = detok.flush()
        deltas.append(tail)
        text, stopped = matcher.push(tail)
        out += text if stopped else text + matcher.flush()
    if i >= len(ids):  # every id pushed; a stop skipped the relay's flush, so take the rest here
        assert "".join(deltas) + (detok.flush() if stopped else "") == full
    assert full.startswith(out)
    assert not any(s in out for s in stops), (out, stops)
    if stopped:
        assert any(full[len(out) :].startswith(s) for s in stops), (out, full, stops)
    else:
        assert out == full


# ---------------------------------------------------------------- 4. atheris

ATHERIS_RUNS = 20_000


def test_atheris_harness_runs_clean(tmp_path):
    pytest.importorskip("atheris", reason="atheris is pinned in requirements-dev.txt (cp311 wheel)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds = [
        pb.GenerateRequest(prompt="Hello <|im_end|>\x00", stopping=pb.StoppingCriteria(stop=["lo"])),
        pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]),
            sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=1),
        ),
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1, 2, 3]),
            stopping=pb.StoppingCriteria(max_tokens=4, stop_token_ids=[2]),
        ),
    ]
    for n, seed in enumerate(seeds):
        (corpus / f"seed-{n}").write_bytes(b"\x01" + seed.SerializeToString())  # odd first byte: parse mode
    start = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "fuzz" / "fuzz_validation.py"),
            f"-atheris_runs={ATHERIS_RUNS}",
            "-seed=1",
            "-max_len=4096",
            "-len_control=0",
            # libFuzzer's default 2 GiB RSS limit tripped once in a full-suite run (RSS
            # 2.1 GB at input 3,068; not reproduced alone: 108 MB flat over 20,000
            # inputs); 8 GiB still stops a runaway on this 24 GiB machine
            "-rss_limit_mb=8192",
            str(corpus),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert f"Done {ATHERIS_RUNS}" in tail, tail
    cov = re.findall(r"cov: (\d+)", tail)
    print(
        f"\natheris: {ATHERIS_RUNS} inputs in {elapsed:.1f} s, exit 0, "
        f"coverage {cov[-1] if cov else '?'} edges"
    )
