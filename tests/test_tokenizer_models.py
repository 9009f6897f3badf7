"""Tokenizers of Llama-family models other than the embedded one, against transformers.

Tiny vocabularies trained here (tests/tiny_models.py: Llama-3 byte-level BPE, Qwen2 byte-level BPE
with NFC, a SentencePiece vocabulary) are saved as Hugging Face directories and as tokenizer-only
GGUF files; our tokenizer from either must give transformers' ids (from the directory) on a mixed
corpus of code, CJK, emoji and digits, with and without special tokens, and the same fingerprint.
"""

import json
import pathlib

import pytest

from common.model_files import (
    default_model_path,
    generation_defaults,
    model_id,
    read_gguf_metadata,
    resolve_model_source,
)
from common.tokenizer import Tokenizer
from tests.tiny_models import MIXED, SPECS, hub_cache, write_gguf_vocab, write_tokenizer_dir

transformers = pytest.importorskip("transformers")
KINDS = ("llama3", "qwen2", "spm")
MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    root = tmp_path_factory.mktemp("vocabs")
    out = {}
    for kind in KINDS:
        tok = write_tokenizer_dir(kind, root / kind)
        out[kind] = (root / kind, write_gguf_vocab(kind, root / f"{kind}.gguf", tok))
    return out


@pytest.mark.parametrize("source", ["dir", "gguf"])
@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_transformers_on_mixed_corpus(files, kind: str, source: str) -> None:
    directory, gguf_file = files[kind]
    ours = Tokenizer.from_model(directory if source == "dir" else gguf_file)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in MIXED:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            ), (kind, source, text, special)
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids), (kind, source, text)
    prompt = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == prompt
    assert ours.encode_chat(MESSAGES) == theirs.encode(prompt, add_special_tokens=False)


def test_bos_and_specials_where_the_vocabulary_says(files) -> None:
    llama3 = Tokenizer.from_gguf(files["llama3"][1])
    assert llama3.encode("hi", add_special_tokens=True)[0] == llama3.bos_token_id == 0
    assert llama3.encode("<|eot_id|>") == [llama3.eos_token_id]
    qwen2 = Tokenizer.from_gguf(files["qwen2"][1])
    assert qwen2.bos_token_id is None and qwen2.encode("hi", True) == qwen2.encode("hi", False)
    spm = Tokenizer.from_gguf(files["spm"][1])
    assert spm.encode("hi", True)[0] == 1 and spm.is_special(0) and spm.is_special(2)
    assert spm.decode(spm.encode("🦙 x")) == "🦙 x"  # not in the vocabulary: byte pieces


def test_fingerprint_same_from_gguf_and_directory_and_differs_between_models(files) -> None:
    prints = {}
    for kind in KINDS:
        directory, gguf_file = files[kind]
        from_dir, from_gguf = Tokenizer.from_model(directory), Tokenizer.from_model(gguf_file)
        assert from_dir.fingerprint == from_gguf.fingerprint, kind
        prints[kind] = from_dir.fingerprint
    assert len({p.vocab_sha256 for p in prints.values()}) == len(KINDS)
    assert prints["llama3"].eos_token_ids == (4, 1)  # <|eot_id|> declared, then <|end_of_text|>


def test_generation_config_eos_ids_and_defaults(files, tmp_path: pathlib.Path) -> None:
    directory, _ = files["llama3"]
    copy = tmp_path / "llama3"
    copy.mkdir()
    for f in directory.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [1, 4]  # Llama-3-Instruct lists <|end_of_text|> and <|eot_id|>
    (copy / "generation_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained_dir(copy).eos_token_ids == (4, 1)
    assert generation_defaults(copy) == {"temperature": 0.6, "top_p": 0.9}
    assert generation_defaults(default_model_path()) == {"temperature": 0.0}  # documented: greedy
    beside = tmp_path / "gguf"
    beside.mkdir()
    (beside / "m.gguf").write_bytes(files["qwen2"][1].read_bytes())
    (beside / "generation_config.json").write_text(json.dumps({"top_k": 20, "temperature": None}))
    assert generation_defaults(beside / "m.gguf") == {"top_k": 20}  # a file beside the GGUF wins


def test_unsupported_vocabularies_are_named(tmp_path: pathlib.Path) -> None:
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["a", "b"])
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    with pytest.raises(ValueError, match="pre-tokenizer 'default' is not supported"):
        Tokenizer.from_gguf(path)
    assert read_gguf_metadata(path)["tokenizer.ggml.pre"] == "default"


def test_hub_id_resolves_from_the_local_cache_only(files, tmp_path: pathlib.Path) -> None:
    """The layout huggingface_hub keeps: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}."""
    snapshot = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama3", files["llama3"][0])
    found = resolve_model_source("tiny-org/tiny-llama3", cache_dir=str(tmp_path / "hub"))
    assert found == snapshot
    assert Tokenizer.from_model(found).fingerprint == Tokenizer.from_model(files["llama3"][0]).fingerprint
    assert model_id("tiny-org/tiny-llama3") == "tiny-org/tiny-llama3"
    with pytest.raises(FileNotFoundError, match="--allow-download"):
        resolve_model_source("tiny-org/not-cached", cache_dir=str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_model_source(str(tmp_path / "missing.gguf"))


def test_model_ids(files) -> None:
    """What a worker without --served-model-name reports and a router --model entry without ID= uses."""
    assert model_id(None) == read_gguf_metadata(default_model_path())["general.name"]
    assert model_id(str(files["qwen2"][0])) == "qwen2"  # a directory: its name
    assert model_id(str(files["spm"][1])) == "tiny-spm"  # a GGUF: general.name
    assert SPECS["llama3"]["pre"] == "llama-bpe"
