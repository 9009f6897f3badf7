"""Streaming token ids -> text deltas, one request at a time.

Contract:
- Input: token ids via `push(ids)`, one or several at a time (a worker message carries several
  with speculative decoding or a stream interval), then one `flush()` at the end.
- Output: each call returns only the new text; the deltas concatenate to
  `tokenizer.decode(all_ids, skip_special_tokens)`, and no delta has a U+FFFD that the full decode
  does not have there. Two ways, picked per tokenizer:
  - bytes (`tokenizer.byte_table`, common/token_bytes.py: byte-level BPE such as Llama-3, Qwen2
    and SmolLM2, and SentencePiece with byte fallback such as Llama-2 and Mistral): the ids' bytes
    go through an incremental UTF-8 decoder, so only a trailing incomplete character is held
    (SentencePiece: the current run of `<0xXX>` pieces, which one bad byte would turn into U+FFFDs),
    invalid bytes become U+FFFD at once and a literal U+FFFD token is text like any other;
  - text (any other decoder, or `decode_bytes=False`; the reference scheme): the window of recent
    ids is decoded again and ids are held back while the text ends in U+FFFD, at most
    `MAX_PENDING_IDS` of them; a literal U+FFFD there is held too, and after six or more of them a
    multi-byte character that follows can be lost. `flush()` returns whatever is left, invalid
    bytes included (as U+FFFD).
- State: bytes: a few held bytes (or one byte run); text: a window of recent ids, at most
  `MAX_PENDING_IDS` of them not yet emitted, and `context` of them already emitted, decoded again
  only so the new text joins onto them (the prefix-offset/read-offset scheme of vLLM and TGI).
  Skipped special tokens never enter either, so each push costs O(its ids + window): linear overall.
- Fails: never on any id sequence the tokenizer can decode.
- Proven by tests/test_tokenizer.py: pushing emoji/CJK text token by token, and in groups of 1-5
  ids, concatenates to the full decode, some pushes are held back, and no delta contains U+FFFD;
  tests/test_trust_units.py: random id mixtures (specials, byte tokens) against `tokenizer.decode`
  (the slow reference) on both ways, and (text scheme) 4,096 skipped tokens cost what 1,024 do;
  tests/test_detokenizer_bytes.py: literal U+FFFD tokens emitted at once and not swallowing the
  character after them, and every vocabulary kind streamed exactly as `tokenizer.decode`.
"""

from collections.abc import Sequence

from common.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# The text scheme only: a UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens:
# ids still undecodable after this many are invalid bytes, emitted as U+FFFD rather than held (and
# re-decoded) forever.
MAX_PENDING_IDS = 8


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = False, decode_bytes: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        table = tokenizer.byte_table if decode_bytes else None
        self._bytes = table.stream(skip_special_tokens) if table is not None else None
        self._window_ids: list[int] = []
        self._num_context_ids = 0  # leading window ids whose text was already emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """The text the new ids complete; "" while a character is still incomplete."""
        if self._bytes is not None:
            return self._bytes.push(token_ids)
        if self._skip_special_tokens:
            # A skipped token adds no text, so it need not be in the window at all (decoding with
            # skip_special_tokens drops it anyway): a run of them (EOS under ignore_eos) would
            # otherwise grow the window and make every push decode it again, O(n^2).
            token_ids = [t for t in token_ids if not self._tokenizer.is_special(t)]
            if not token_ids:
                return ""
        self._window_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back, at the end of the stream."""
        if self._bytes is not None:
            return self._bytes.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        context_text = self._decode(self._window_ids[: self._num_context_ids])
        text = self._decode(self._window_ids)
        split = len(self._window_ids)  # the ids emitted now; any after it stay pending
        if not final and text.endswith(_REPLACEMENT_CHAR):
            # Hold back only the ids of the trailing partial character (at most 3 of its byte
            # tokens can be there while it is incomplete), not every id pushed since the last
            # emit: a message of several tokens (speculative drafts, a stream interval) that ends
            # mid-character would otherwise pile ids up to MAX_PENDING_IDS, and the forced emit
            # then turned a well-formed character into U+FFFD and lost it.
            pending = split - self._num_context_ids
            for k in range(1, min(3, pending) + 1):
                head = self._decode(self._window_ids[:-k])
                if not head.endswith(_REPLACEMENT_CHAR):
                    split, text = split - k, head
                    break
            else:
                if pending < MAX_PENDING_IDS:
                    return ""  # still incomplete; past MAX_PENDING_IDS: invalid bytes, emitted
        if not final and len(text) <= len(context_text):
            if split == len(self._window_ids) and text == context_text:
                # ids that decode to nothing (and are not part of a character): nothing to wait for
                self._window_ids = self._window_ids[: self._num_context_ids]
            return ""
        # the ids just emitted become the next window's context; the held ones follow it
        start = self._num_context_ids
        self._window_ids = self._window_ids[start:]
        self._num_context_ids = split - start
        return text[len(context_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
