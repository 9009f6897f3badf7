"""Tokenize / Detokenize: the token ids Generate would see for a prompt or a chat, and their text,
from the router's own tokenizers (no worker, no admission).

Contract
- input: `pb.TokenizeRequest` (model, a prompt or a chat, `add_special_tokens` for a prompt,
  default true as Generate, `with_pieces`) / `pb.DetokenizeRequest` (model, token ids).
- output: `pb.TokenizeResponse` (the model's id, the ids, `max_model_len` from a connected worker
  or 0 when none is, and with `with_pieces` each id's bytes: `token_pieces`) /
  `pb.DetokenizeResponse` (the text, special tokens written out).
- state: a tokenize pool of its own (one thread, eight waiting: router/tokenize_pool.py), so these
  calls never wait in Generate's pool nor crowd it, and a flood is refused (RESOURCE_EXHAUSTED),
  never queued unbounded. The service takes the tenant's admission claim for each call (its
  request rate and concurrency), as for Generate.
- failure modes: `ValidationError` naming the field: an unknown model (or none named when several
  are served), a prompt over `max_prompt_chars`, a chat that router/chat_validation.py refuses or
  the template refuses or that renders longer than `max_prompt_chars`, more token ids than the
  model's context (MAX_DETOKENIZE_IDS while no worker is connected) or one outside the vocabulary.
- proven by: tests/test_openai_tokens_e2e.py (gRPC and HTTP against a real router).
"""

from __future__ import annotations

import jinja2

from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.chat_validation import validate_chat
from router.config import Limits
from router.errors import ValidationError
from router.models import ModelTable
from router.tokenize_pool import TokenizePool

# Ids one Detokenize may send while no worker tells the model's context (with one: max_model_len).
MAX_DETOKENIZE_IDS = 131_072


def token_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[bytes]:
    """Each id's own bytes, as the decoder joins them (common/token_bytes.py: byte-level BPE's
    bytes, a SentencePiece piece's text, a special token's text); a tokenizer whose decoder has no
    byte table gives each id's text decoded alone (a split character is U+FFFD there)."""
    table = tokenizer.byte_table
    if table is None:
        return [tokenizer.decode([t]).encode() for t in ids]
    pieces = [table.pieces[t] if t < len(table.pieces) else None for t in ids]
    return [p.encode() if isinstance(p, str) else p or b"" for p in pieces]


class TokenApi:
    def __init__(self, models: ModelTable, registry, limits: Limits):
        self._models, self._registry, self._limits = models, registry, limits
        # A pool of its own, smaller than Generate's: these calls cannot crowd generations out of
        # theirs, and a flood of them is refused (RESOURCE_EXHAUSTED) after a few waiting.
        self._pool = TokenizePool(threads=1, max_waiting=8)

    def _model(self, name: str) -> str:
        served = self._models.ids()
        if name:
            if self._models.get(name) is None:
                raise ValidationError("model", f"unknown model {name!r}; this router serves {served}")
            return name
        if len(served) != 1:
            raise ValidationError("model", f"required: this router serves several models, {served}")
        return served[0]

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        name = self._model(request.model)
        tokenizer = self._models.tokenizer(name)
        kind = request.WhichOneof("input")
        if kind == "chat":
            valid = validate_chat(request.chat, self._limits)

            def encode() -> list[int]:
                limit = self._limits.max_prompt_chars
                try:
                    return tokenizer.encode_chat(
                        list(valid["chat"]),
                        tools=list(valid["tools"]),
                        max_chars=limit,
                        # the ids a generation of these messages gets (router/service.py)
                        parse_special_in_messages=self._limits.parse_special_tokens_in_messages,
                    )
                except (ValueError, TypeError, RecursionError, jinja2.TemplateError) as exc:  # (as Generate)
                    raise ValidationError("chat.messages", str(exc)) from None

        else:
            prompt, limit = request.prompt, self._limits.max_prompt_chars
            if len(prompt) > limit:
                raise ValidationError("prompt", f"longer than {limit} characters")
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True

            def encode() -> list[int]:
                return tokenizer.encode(prompt, add_special_tokens=special)

        if request.with_pieces:
            plain = encode

            def encode() -> tuple[list[int], list[bytes]]:
                ids = plain()
                return ids, token_pieces(tokenizer, ids)

            ids, pieces = await self._pool.run(encode)
        else:
            ids, pieces = await self._pool.run(encode), []
        spec = self._registry.models().get(name)
        return pb.TokenizeResponse(
            model=name, token_ids=ids, max_model_len=spec.max_model_len if spec else 0, pieces=pieces
        )

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        name = self._model(request.model)
        tokenizer = self._models.tokenizer(name)
        ids = request.token_ids
        spec = self._registry.models().get(name)
        limit = spec.max_model_len if spec else MAX_DETOKENIZE_IDS  # (its text stays one context's)
        if len(ids) > limit:
            raise ValidationError("token_ids", f"{len(ids)} ids, more than {limit} (the model's context)")
        vocab = tokenizer.vocab_size

        def decode() -> str:  # (in the pool: a million ids are checked off the event loop)
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValidationError("token_ids", f"token id {bad} is outside the vocabulary (size {vocab})")
            return tokenizer.decode(list(ids))

        text = await self._pool.run(decode)
        return pb.DetokenizeResponse(model=name, text=text)
