"""The detokenizer's byte path (common/token_bytes.py) on every vocabulary kind the router reads:
a literal U+FFFD is text like any other (emitted at once, never swallowing the character after
it), and the deltas equal `tokenizer.decode`, the slow reference, on random ids streamed in
groups, with as little held back as the decoder allows."""

import random

import pytest
import tokenizers

from common.detokenizer import IncrementalDetokenizer
from common.gguf_tokenizer import build_gguf_backend
from common.token_bytes import bytes_to_unicode
from common.tokenizer import Tokenizer
from tests.test_tokenizer import stream_in_groups
from tests.tiny_models import write_gguf_vocab, write_tokenizer_dir

FFFD = "\ufffd"
TEXT = "héllo wörld, 你好 🎉 naïve — ok. "


def _spm_with_literal() -> Tokenizer:
    """A SentencePiece vocabulary with a U+FFFD piece (the tiny trained one has none)."""
    words = ["▁", "o", "k", "▁o", "▁ok", FFFD, "▁" + FFFD, "a", "▁a"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * len(words)],
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(words))],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
    }
    return Tokenizer(build_gguf_backend(metadata), bos_token_id=1, eos_token_id=2, chat_template=None)


@pytest.fixture(scope="module")
def vocabularies(tokenizer, tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("vocabs")
    out = {"smollm2": tokenizer, "spm-literal": _spm_with_literal()}
    for kind in ("llama3", "qwen2", "spm"):
        tok = write_tokenizer_dir(kind, root / kind)
        out[f"{kind}-dir"] = Tokenizer.from_model(root / kind)
        out[f"{kind}-gguf"] = Tokenizer.from_model(write_gguf_vocab(kind, root / f"{kind}.gguf", tok))
    return out


def byte_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """One byte token per byte (byte-level: GPT-2's characters; SentencePiece: `<0xXX>`)."""
    backend = tokenizer._backend
    if tokenizer.byte_table.kind == "byte_level":
        chars = bytes_to_unicode()
        return [backend.token_to_id(chars[b]) for b in data]
    return [backend.token_to_id(f"<0x{b:02X}>") for b in data]


def literal_ids(tokenizer: Tokenizer) -> list[int]:
    """A literal U+FFFD: the vocabulary's own token when it has one, else its three UTF-8 bytes.
    (Decoding alone cannot tell it from a never-valid byte such as 0xFF: the text is U+FFFD
    wherever either stands, so the token is looked up by its text.)"""
    lead, single_bytes = byte_ids(tokenizer, "你".encode()[:1]), set(byte_ids(tokenizer, bytes(range(256))))
    for i in [*tokenizer.encode(FFFD), tokenizer._backend.token_to_id(FFFD)]:
        if (
            i not in single_bytes | {None}
            and tokenizer.decode([i]) == FFFD
            and tokenizer.decode([*lead, i]) == FFFD * 2
        ):
            return [i]
    return byte_ids(tokenizer, FFFD.encode())


def test_every_vocabulary_kind_decodes_through_bytes(vocabularies) -> None:
    kinds = {name: tok.byte_table.kind for name, tok in vocabularies.items()}
    assert kinds["smollm2"] == kinds["llama3-gguf"] == kinds["qwen2-dir"] == "byte_level"
    assert kinds["spm-gguf"] == kinds["spm-dir"] == kinds["spm-literal"] == "byte_fallback"
    assert literal_ids(vocabularies["smollm2"]) == [24211]  # SmolLM2 has a U+FFFD token
    assert len(literal_ids(vocabularies["spm-literal"])) == 1


@pytest.mark.parametrize("name", ["smollm2", "spm-literal"])
def test_text_ending_in_a_literal_replacement_token_is_emitted_at_once(vocabularies, name) -> None:
    """The text scheme held it (the text ends in U+FFFD: maybe half a character) for up to 8
    tokens, so a stop string ending in U+FFFD matched that late."""
    tok = vocabularies[name]
    (literal,) = literal_ids(tok)
    detok = IncrementalDetokenizer(tok)
    ok = tok.encode("ok")
    assert detok.push(ok) + detok.push([literal]) == tok.decode([*ok, literal])
    assert detok.push([literal, literal]) == FFFD * 2
    assert detok.flush() == ""


@pytest.mark.parametrize("run", [6, 7, 9])
@pytest.mark.parametrize("name", ["smollm2", "spm-literal", "llama3-gguf", "spm-gguf"])
def test_a_character_after_replacement_tokens_is_not_lost(vocabularies, name, run) -> None:
    """Six or more U+FFFD tokens (literal, or invalid bytes) then a character split over byte
    tokens: the text scheme emitted the pile as invalid and lost the character."""
    tok = vocabularies[name]
    split_char = byte_ids(tok, "你".encode())
    for filler in (literal_ids(tok), byte_ids(tok, b"\x80")):  # (SmolLM2 has no 0xFF token)
        ids = filler * run + split_char + tok.encode(" ok")
        expected = tok.decode(ids)
        # (ByteFallback makes a run of byte pieces with a bad byte all U+FFFD: the character too)
        joined = tok.byte_table.kind == "byte_fallback" and len(filler) == 1 and filler != literal_ids(tok)
        assert joined or "你" in expected, expected
        for most in (1, 2, 5):
            detok = IncrementalDetokenizer(tok)
            deltas = stream_in_groups(detok, ids, random.Random(run * most), most)
            assert "".join(deltas) == expected, (name, filler, most, deltas)


def _random_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    specials = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    in_vocab = [b for b in range(256) if None not in byte_ids(tok, bytes((b,)))]
    text_ids = tok.encode(TEXT)
    ids: list[int] = []
    for _ in range(rng.randint(0, 40)):
        kind = rng.random()
        if kind < 0.15:
            ids.append(rng.choice(specials))
        elif kind < 0.25:
            ids.extend(literal_ids(tok))
        elif kind < 0.55:
            ids.extend(byte_ids(tok, bytes(rng.choice(in_vocab) for _ in range(rng.randint(1, 4)))))
        elif kind < 0.7:
            ids.extend(byte_ids(tok, rng.choice("é你🎉ж").encode()))
        elif kind < 0.85:
            ids.append(rng.choice(text_ids))
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids


def _ends_in_byte_run(tok: Tokenizer, ids: list[int], skip: bool) -> bool:
    """SentencePiece holds a run of `<0xXX>` pieces until it ends (a bad byte in it would turn
    the whole run into U+FFFDs); skipped specials do not end it."""
    kept = [i for i in ids if not (skip and tok.is_special(i)) and tok.byte_table.pieces[i] is not None]
    return bool(kept) and isinstance(tok.byte_table.pieces[kept[-1]], bytes)


@pytest.mark.parametrize("skip", [False, True])
def test_deltas_equal_decode_on_random_ids_for_every_vocabulary(vocabularies, skip) -> None:
    """The slow reference on random mixtures of specials, literal U+FFFD, random and valid byte
    runs and vocabulary pieces, pushed 1-5 at a time; after each push everything is out that no
    later id can change (byte-level: all but one trailing incomplete character)."""
    rng = random.Random(29)
    for name, tok in vocabularies.items():
        for trial in range(60):
            ids = _random_ids(tok, rng)
            detok, emitted, i = IncrementalDetokenizer(tok, skip_special_tokens=skip), "", 0
            while i < len(ids):
                n = rng.randint(1, 5)
                emitted += detok.push(ids[i : i + n])
                i += n
                so_far = tok.decode(ids[:i], skip_special_tokens=skip)
                assert so_far.startswith(emitted), (name, trial, ids[:i])
                if tok.byte_table.kind == "byte_level":
                    # at most one incomplete character's bytes (up to 3 U+FFFD: Python's
                    # decoder waits for the third byte of ED A5 ..., an invalid surrogate)
                    held = so_far[len(emitted) :]
                    assert held == FFFD * len(held) and len(held) <= 3, (name, trial, ids[:i], emitted)
                elif not _ends_in_byte_run(tok, ids[:i], skip):
                    assert emitted == so_far, (name, trial, ids[:i], emitted)
            emitted += detok.flush()
            assert emitted == tok.decode(ids, skip_special_tokens=skip), (name, trial, ids)


def test_spm_strips_one_leading_space_of_the_whole_text(vocabularies) -> None:
    tok = vocabularies["spm-gguf"]
    space = byte_ids(tok, b" ")
    for ids in ([*space, *space, *tok.encode("a")], [1, *tok.encode(" a")], tok.encode("  a b")):
        for skip in (False, True):
            out = stream_in_groups(IncrementalDetokenizer(tok, skip), ids, random.Random(1), 2)
            assert "".join(out) == tok.decode(ids, skip_special_tokens=skip), (ids, skip, out)


def test_other_decoders_fall_back_to_the_text_scheme(vocabularies) -> None:
    backend = tokenizers.Tokenizer.from_str(vocabularies["spm-dir"]._backend.to_str())
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(backend, bos_token_id=1, eos_token_id=2, chat_template=None)
    assert tok.byte_table is None
    ids = tok.encode(TEXT)
    assert "".join(stream_in_groups(IncrementalDetokenizer(tok), ids, random.Random(3), 3)) == tok.decode(ids)
