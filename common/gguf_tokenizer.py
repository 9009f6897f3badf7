"""A GGUF file's vocabulary -> a `tokenizers.Tokenizer` that splits text as llama.cpp does.

Contract
- input: GGUF metadata (`common.model_files.read_gguf_metadata`).
- output: `build_gguf_backend(metadata) -> tokenizers.Tokenizer`:
  - `tokenizer.ggml.model == "gpt2"` (byte-level BPE, what Llama-3, Qwen2, SmolLM2 and GPT-2
    conversions write): vocabulary + merges, split by the pre-tokenizer named in
    `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp regexes): `llama-bpe` (and its aliases
    `llama3`, `llama-v3`, `falcon3`, `pixtral`), `qwen2` (`deepseek-r1-qwen`; plus Qwen2's NFC
    normalizer), `smollm`, `gpt2` (`gpt-2`);
  - `tokenizer.ggml.model == "llama"` (a SentencePiece vocabulary: Llama-2, Mistral, TinyLlama):
    pieces + scores; the merges are the pairs whose concatenation is a piece, ranked by that
    piece's score (llama.cpp's SPM tokenizer merges by score the same way), byte fallback through
    the `<0xXX>` pieces, `▁` for spaces and a `▁` in front of each text run when
    `tokenizer.ggml.add_space_prefix` (default true) is set, as Llama-2's `tokenizer.json` does.
  Control tokens (and the unknown token) become special added tokens, user-defined tokens plain
  added tokens; a BOS is prepended by `add_special_tokens=True` encodes when
  `tokenizer.ggml.add_bos_token` says so.
- state: none.
- failure modes: `ValueError` naming the model or pre-tokenizer for any other vocabulary
  (`bert`, `rwkv`, `t5`, an unknown pre-tokenizer name): the router must not guess a split.
- proven by: tests/test_tokenizer_models.py (GGUF files written from tiny `tokenizers` models:
  ids equal transformers' on the HF directory of the same vocabulary, mixed corpus).
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 and _QWEN2 expressions (the models' own tokenizer.json
# write them with (?i:...) for the contractions; same matches).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_ALIASES = {
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "falcon3": "llama3",
    "pixtral": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "smollm": "smollm",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_ALIASES))


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_split(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """The split (and normalizer) a GGUF `tokenizer.ggml.pre` name stands for."""
    kind = _PRE_ALIASES.get(pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        # every digit its own piece, then GPT-2's regex: SmolLM2's own tokenizer.json says the same
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), None
    if kind == "gpt2":
        return byte_level, None
    if kind == "llama3":
        return _regex_then_bytes(_LLAMA3_SPLIT), None
    if kind == "qwen2":
        return _regex_then_bytes(_QWEN2_SPLIT), normalizers.NFC()
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})."
    )


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Pairs of pieces whose concatenation is a normal piece, best-scored piece first (the order
    llama.cpp's SPM tokenizer merges in; transformers' GGUF converter builds the same list)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece_id, piece in enumerate(tokens):
        if types[piece_id] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE, TOKEN_TYPE_UNKNOWN) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types)
            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )


def build_gguf_backend(metadata: dict[str, Any]) -> tokenizers.Tokenizer:
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    if model == "gpt2":
        merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        split, normalizer = _byte_level_split(metadata.get("tokenizer.ggml.pre", "gpt2"))
        backend.pre_tokenizer = split
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.decoder = decoders.ByteLevel()
    elif model == "llama":
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_spm_merges(tokens, scores, types),
                unk_token=tokens[unk_id] if unk_id is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        steps = [normalizers.Replace(" ", "▁")]
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if metadata.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("▁"))
            decode.append(decoders.Strip(" ", 1, 0))
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence(decode)
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' = byte-level BPE, "
            "'llama' = SentencePiece)."
        )
    _added_tokens(backend, tokens, types)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if bos_id is not None and metadata.get("tokenizer.ggml.add_bos_token", model == "llama"):
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return backend
