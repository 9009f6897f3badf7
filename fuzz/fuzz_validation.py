"""Coverage-guided fuzzing (atheris/libFuzzer) of what the router does with a client's bytes before
any worker sees them: parse -> validate -> tokenize -> fit to the context, and the stream path's
detokenizer and stop-string matcher on arbitrary token ids.

Contract
- input: libFuzzer byte strings. The first byte picks the mode: the rest parsed as a
  `GenerateRequest` (what the gRPC server hands the servicer), or a request built field by field
  from a `FuzzedDataProvider` (reaches deep field values that random bytes rarely encode).
- output: nothing; a crash is any exception other than protobuf's `DecodeError` (bytes that are not
  a message, which the router answers INVALID_ARGUMENT) or `ValidationError` whose message
  starts with a field name. libFuzzer then exits non-zero and writes the input as `crash-*`.
- run: `.venv/bin/python fuzz/fuzz_validation.py -atheris_runs=100000 [corpus_dir]`;
  tests/test_fuzz_input.py runs it for a bounded number of inputs.
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
from types import SimpleNamespace

import atheris

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from google.protobuf.message import DecodeError  # noqa: E402 - after the path set-up

from protos.llm.v1 import generation_pb2 as pb  # noqa: E402

with atheris.instrument_imports(include=["router", "common"]):  # coverage of our own code only
    import common.detokenizer
    import router.stop_strings
    import router.validation
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer
    from router.config import Limits
    from router.errors import ValidationError
    from router.service import GenerationService

TOKENIZER = Tokenizer.from_gguf(default_model_path())
MODEL = router.validation.ModelSpec("smollm", max_model_len=1088, vocab_size=TOKENIZER.vocab_size)
MODELS = {MODEL.name: MODEL}
LIMITS = Limits(max_prompt_chars=20_000)  # tokenizing is the slow part: keep inputs small
# A refusal names the field it is about ("sampling.pooling: unknown value 105"): every sampling
# field is checked (penalties, logit bias, pooling, logprobs counts), so any of their names.
FIELD = re.compile(
    r"^(request|request_id|model|input|prompt|chat\.(messages|tools)(\[\d+\](\.[a-z_]+(\[\d+\])?)*)?|token_ids\.ids|"
    r"sampling\.[a-z_]+|stopping\.(max_tokens|stop(\[\d+\])?|"
    r"stop_token_ids)): "
)
ROLES = ("system", "user", "assistant", "tool", "", "User", "<|im_start|>")
_MODELS = SimpleNamespace(tokenizer=lambda model: TOKENIZER)  # the one model the harness serves
_tokenize = GenerationService._tokenize.__get__(SimpleNamespace(_models=_MODELS, _limits=LIMITS))


def _float(fdp: atheris.FuzzedDataProvider) -> float:
    special = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 1e-45, 3.4e38)
    return special[fdp.ConsumeIntInRange(0, len(special) - 1)] if fdp.ConsumeBool() else fdp.ConsumeFloat()


def _built(fdp: atheris.FuzzedDataProvider) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 140)),
        model=fdp.PickValueInList(["", "", "smollm", "other"]),
        priority=fdp.ConsumeIntInRange(-(2**31), 2**31 - 1),
    )
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 0:
        piece = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 600))
        req.prompt = piece * fdp.ConsumeIntInRange(1, 40)
    elif kind == 1:
        req.chat.SetInParent()
        for _ in range(fdp.ConsumeIntInRange(0, 8)):
            req.chat.messages.add(
                role=fdp.PickValueInList(list(ROLES)),
                content=fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 200)),
            )
    elif kind == 2:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 1200), 0, 2**32 - 1))
    s = req.sampling
    if fdp.ConsumeBool():
        s.temperature = _float(fdp)
    if fdp.ConsumeBool():
        s.top_p = _float(fdp)
    s.top_k = fdp.ConsumeIntInRange(0, 2**32 - 1)
    s.logprobs = fdp.ConsumeIntInRange(0, 3)
    if fdp.ConsumeBool():
        s.seed = fdp.ConsumeIntInRange(0, 2**64 - 1)
    stop = req.stopping
    if fdp.ConsumeBool():
        stop.max_tokens = fdp.ConsumeIntInRange(0, 2**32 - 1)
    stop.stop.extend(
        fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 80))
        for _ in range(fdp.ConsumeIntInRange(0, 10))
    )
    stop.stop_token_ids.extend(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 70), 0, 2**32 - 1))
    stop.ignore_eos = fdp.ConsumeBool()
    return req


def _stream(fdp: atheris.FuzzedDataProvider, stops: tuple[str, ...]) -> None:
    """The relay's per-token path: ids -> detokenizer -> stop strings."""
    ids = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 64), 0, TOKENIZER.vocab_size - 1)
    detok = common.detokenizer.IncrementalDetokenizer(TOKENIZER, skip_special_tokens=True)
    matcher = router.stop_strings.StopStringMatcher(stops)
    out, stopped = "", False
    for start in range(0, len(ids), 3):
        text, stopped = matcher.push(detok.push(ids[start : start + 3]))
        out += text
        if stopped:
            break
    if not stopped:
        tail, stopped = matcher.push(detok.flush())
        out += tail if stopped else tail + matcher.flush()
    full = TOKENIZER.decode(ids, skip_special_tokens=True)
    assert full.startswith(out), (out, full)
    assert stopped or out == full, (out, full)


def fuzz_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeBool():
        req = pb.GenerateRequest()
        try:
            req.ParseFromString(fdp.ConsumeBytes(fdp.remaining_bytes()))
        except DecodeError:
            return
    else:
        req = _built(fdp)
    try:
        valid = router.validation.validate(req, LIMITS, MODELS)
        prompt_ids = _tokenize(valid)
        max_tokens = router.validation.fit_to_context(valid, len(prompt_ids), LIMITS)
    except ValidationError as err:
        assert FIELD.match(str(err)), str(err)
        return
    assert 1 <= max_tokens and len(prompt_ids) + max_tokens <= MODEL.max_model_len
    _stream(fdp, valid.stop)


def main() -> None:
    atheris.Setup(sys.argv, fuzz_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
