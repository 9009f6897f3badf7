"""Token ids -> the bytes they stand for, and a stream of them -> text, as the backend's decoder
would join them, so that a split multi-byte character is told from invalid bytes by the bytes.

Contract:
- Input: a `tokenizers.Tokenizer` backend (`build_byte_table(backend)`).
- Output: a `ByteTable`, or None when the backend's decoder is not one reproduced here exactly:
  - `ByteLevel` (byte-level BPE: GPT-2, Llama-3, Qwen2, SmolLM2): a token's characters map to bytes
    through GPT-2's bytes_to_unicode table (a token with a character outside it: its own UTF-8, as
    `tokenizers` does); the text is all of them decoded as UTF-8, one U+FFFD per maximal invalid
    subsequence (Rust's `from_utf8_lossy`, which Python's "replace" handler matches; incrementally
    it waits for the byte after ED A0..BF, a surrogate's start, before replacing both);
  - SentencePiece's `Sequence[Replace(P, C)..., ByteFallback, Fuse, Strip(c, n, 0)?]` (Llama-2,
    Mistral, TinyLlama; what common/gguf_tokenizer.py builds): `<0xXX>` pieces are bytes, and a run
    of them that is not valid UTF-8 as a whole becomes one U+FFFD per byte; other pieces are their
    text with P replaced by C; up to n leading `c` of the whole text are dropped.
  Added tokens follow the same rules (`tokenizers` decodes them with the rest); under
  skip_special_tokens the special ones are dropped before decoding, as are ids with no token.
  `table.stream(skip_special_tokens)` -> `ByteStream`: `push(ids) -> str`, `flush() -> str`; the
  outputs concatenate to `backend.decode(all_ids, skip_special_tokens)`, and hold back only what
  the ids still to come can change: a trailing incomplete UTF-8 sequence (byte-level), or the
  current run of `<0xXX>` pieces while it is valid so far (SentencePiece: one invalid byte later
  in the run would turn the whole run into U+FFFD).
- State: the table (one small object per id, built once per tokenizer: ~0.1 s for 49k ids) is
  read-only; a stream holds at most 3 bytes (byte-level) or the current byte run, however long: a
  stretch of text outside a SentencePiece vocabulary streams once a text piece (or flush) ends it.
- Fails: never; a table that disagrees with `backend.decode` on any single token (and, for
  SentencePiece, any token after a plain one) is not returned (None: the caller falls back).
- Proven by tests/test_detokenizer_bytes.py (every vocabulary kind of tests/tiny_models.py and the
  embedded GGUF: random ids, byte tokens and specials, streamed in groups, equal `backend.decode`).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Sequence

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"
# what `u8::from_str_radix` accepts in the two bytes between "<0x" and ">" (ByteFallback's test)
_HEX_BYTE = re.compile(rb"\+?[0-9a-fA-F]{1,2}")


@dataclasses.dataclass(frozen=True)
class ByteTable:
    """Per id: bytes (byte-level: the token's bytes; SentencePiece: a `<0xXX>` piece's one byte),
    str (a SentencePiece text piece, replacements done) or None (no token: always dropped)."""

    kind: str  # "byte_level" or "byte_fallback"
    pieces: tuple[bytes | str | None, ...]
    special_ids: frozenset[int]
    strip_char: str = " "
    strip_leading: int = 0

    def stream(self, skip_special_tokens: bool) -> ByteStream:
        return ByteStream(self, skip_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The whole text at once (no incremental state): what the build checks against."""
        pieces = self._kept(token_ids, skip_special_tokens)
        if self.kind == "byte_level":
            return b"".join(pieces).decode("utf-8", "replace")
        out, run = [], bytearray()
        for piece in [*pieces, ""]:
            if isinstance(piece, bytes):
                run += piece
                continue
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append(_REPLACEMENT_CHAR * len(run))
                run.clear()
            out.append(piece)
        text = "".join(out)
        cut = len(text) - len(text.lstrip(self.strip_char))
        return text[min(cut, self.strip_leading) :]

    def _kept(self, token_ids: Sequence[int], skip_special_tokens: bool) -> list[bytes | str]:
        dropped = self.special_ids if skip_special_tokens else frozenset()
        n = len(self.pieces)
        return [p for i in token_ids if 0 <= i < n and i not in dropped and (p := self.pieces[i]) is not None]


class ByteStream:
    """One request's decoder state over a `ByteTable` (see the module contract)."""

    def __init__(self, table: ByteTable, skip_special_tokens: bool) -> None:
        self._table = table
        self._strip_left = table.strip_leading
        self._utf8 = codecs.getincrementaldecoder("utf-8")(
            "replace" if table.kind == "byte_level" else "strict"
        )
        self._run: list[str] = []  # SentencePiece: the current byte run's text, valid so far
        self._run_len = 0
        self._run_invalid = False  # its bytes so far are invalid: each further one is a U+FFFD
        self._skip = skip_special_tokens

    def push(self, token_ids: Sequence[int]) -> str:
        pieces = self._table._kept(token_ids, self._skip)
        if self._table.kind == "byte_level":
            return self._utf8.decode(b"".join(pieces))
        out = []
        for piece in pieces:
            if isinstance(piece, bytes):
                out.append(self._byte(piece))
            else:
                out.append(self._end_run())
                out.append(piece)
        return self._stripped("".join(out))

    def flush(self) -> str:
        if self._table.kind == "byte_level":
            return self._utf8.decode(b"", final=True)
        return self._stripped(self._end_run())

    def _byte(self, byte: bytes) -> str:
        if self._run_invalid:
            return _REPLACEMENT_CHAR
        self._run_len += 1
        try:
            self._run.append(self._utf8.decode(byte))
        except UnicodeDecodeError:
            # ByteFallback turns the whole run into U+FFFDs, so nothing more is worth holding
            self._run_invalid, count = True, self._run_len
            self._reset_run()
            return _REPLACEMENT_CHAR * count
        return ""

    def _end_run(self) -> str:
        if self._run_invalid or not self._run_len:
            self._run_invalid = False
            return ""
        try:
            text = "".join(self._run) + self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:  # the run ended inside a character
            text = _REPLACEMENT_CHAR * self._run_len
        self._reset_run()
        return text

    def _reset_run(self) -> None:
        self._utf8.reset()
        self._run, self._run_len = [], 0

    def _stripped(self, text: str) -> str:
        # Strip sees the whole fused text: only its first characters are ever dropped
        if not self._strip_left or not text:
            return text
        cut = 0
        while cut < min(self._strip_left, len(text)) and text[cut] == self._table.strip_char:
            cut += 1
        self._strip_left = 0 if cut < len(text) else self._strip_left - cut
        return text[cut:]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel encodes bytes as)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_table(backend: tokenizers.Tokenizer) -> ByteTable | None:
    """The backend's `ByteTable`, or None (see the module contract)."""
    decoder = backend.decoder
    if decoder is None:
        return None
    spec = json.loads(decoder.__getstate__())
    if spec.get("type") == "Sequence" and len(spec["decoders"]) == 1:
        spec = spec["decoders"][0]
    added = backend.get_added_tokens_decoder()
    size = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
    tokens = [backend.id_to_token(i) for i in range(size)]
    specials = {t.content for t in added.values() if t.special}
    # `decode` drops a special token by its text, whichever id carries it
    special_ids = frozenset(i for i, t in enumerate(tokens) if t in specials)
    if spec.get("type") == "ByteLevel":
        char_bytes = {c: bytes((b,)) for b, c in bytes_to_unicode().items()}
        pieces = tuple(None if t is None else _byte_level_bytes(t, char_bytes) for t in tokens)
        table = ByteTable("byte_level", pieces, special_ids)
    else:
        rules = _byte_fallback_rules(spec)
        if rules is None:
            return None
        replaces, strip_char, strip_leading = rules
        pieces = tuple(None if t is None else _sentencepiece_piece(t, replaces) for t in tokens)
        table = ByteTable("byte_fallback", pieces, special_ids, strip_char, strip_leading)
    return table if _agrees(backend, table) else None


def _byte_level_bytes(token: str, char_bytes: dict[str, bytes]) -> bytes:
    mapped = [char_bytes.get(c) for c in token]
    return token.encode("utf-8") if None in mapped else b"".join(mapped)  # type: ignore[arg-type]


def _byte_fallback_rules(spec: dict) -> tuple[list[tuple[str, str]], str, int] | None:
    """(Replace steps, Strip character, Strip count) of a SentencePiece decoder, or None."""
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if not steps:
        return None
    types = [s["type"] for s in steps]
    strip = steps[-1] if types[-1] == "Strip" else None
    if strip is not None:
        if strip.get("stop", 0) != 0 or len(strip.get("content", "")) != 1:
            return None
        types = types[:-1]
    head = len(types) - 2
    if head < 0 or types[head:] != ["ByteFallback", "Fuse"] or any(t != "Replace" for t in types[:head]):
        return None
    replaces = []
    for step in steps[:head]:
        pattern = step.get("pattern", {})
        if "String" not in pattern:  # a regex replacement: not reproduced here
            return None
        replaces.append((pattern["String"], step["content"]))
    return replaces, strip["content"] if strip else " ", int(strip["start"]) if strip else 0


def _sentencepiece_piece(token: str, replaces: list[tuple[str, str]]) -> bytes | str:
    for pattern, content in replaces:
        token = token.replace(pattern, content)
    raw = token.encode("utf-8")
    if len(raw) == 6 and raw.startswith(b"<0x") and raw.endswith(b">") and _HEX_BYTE.fullmatch(raw[3:5]):
        return bytes((int(raw[3:5], 16),))
    return token


def _agrees(backend: tokenizers.Tokenizer, table: ByteTable) -> bool:
    """Every token alone (and, for SentencePiece, after a plain piece, which Strip then leaves
    alone) decodes as the backend decodes it: a decoder step read wrongly shows up here."""
    ids = range(len(table.pieces))
    if table.kind == "byte_level":  # the same check, without the per-call overhead (150k tokens)
        expected = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        return expected == [(piece or b"").decode("utf-8", "replace") for piece in table.pieces]  # type: ignore[union-attr]
    batches = [[[i] for i in ids]]
    plain = next((i for i in ids if isinstance(p := table.pieces[i], str) and p.isalnum()), None)
    if plain is not None:
        batches.append([[plain, i] for i in ids])
    for batch in batches:
        expected = backend.decode_batch(batch, skip_special_tokens=False)
        if any(table.decode(one) != text for one, text in zip(batch, expected)):
            return False
    return True
