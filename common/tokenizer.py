"""Text <-> token ids, and chat messages -> prompt, for the router. Never imports torch.

Contract:
- Built from a GGUF file (`Tokenizer.from_gguf`: byte-level BPE from the file's vocabulary and
  merges) or from a Hugging Face directory (`Tokenizer.from_pretrained_dir`: `tokenizer.json` +
  `tokenizer_config.json`).
- `encode(text) -> list[int]`, `decode(ids) -> str`; control tokens such as `<|im_start|>` are
  matched whole in the text. `apply_chat_template(messages) -> str` renders the model's own Jinja
  template in a sandbox; `encode_chat(messages) -> list[int]` tokenizes that prompt.
- State: read-only after construction, so one instance serves every request.
- Fails: `ValueError` for a GGUF tokenizer other than byte-level BPE (`gpt2` model, `smollm` or
  `gpt2` pre-tokenizer), a directory whose config names no eos token, or a chat request on a
  model without a template; `jinja2.TemplateError` when the template rejects the messages (its
  `raise_exception`).
- Proven by tests/test_tokenizer.py: ids equal transformers' tokenizer loaded from the same GGUF
  on varied text, decode round-trips, and the chat prompt equals transformers' rendering.
"""

import functools
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from common.model_files import read_gguf_metadata

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Special tokens that end a generation besides the declared eos, as llama.cpp's end-of-generation
# set: SmolLM2 declares `<|im_end|>` but a model may still close a document with `<|endoftext|>`.
_END_OF_GENERATION_TOKENS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>"}
)


def _pre_tokenizer_for(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a GGUF `tokenizer.ggml.pre` name stands for (llama.cpp's llama-vocab.cpp)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # every digit its own piece, then GPT-2's regex: SmolLM2's own tokenizer.json says the same
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt2":
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2).")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids and chat template that go with it."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        end_ids = sorted(i for i in self._special_ids if added[i].content in _END_OF_GENERATION_TOKENS)
        self._eos_token_ids = (eos_token_id, *(i for i in end_ids if i != eos_token_id))
        self._chat_template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> "Tokenizer":
        """Byte-level BPE from `tokenizer.ggml.*`; control tokens become special added tokens."""
        metadata = read_gguf_metadata(path)
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported (only 'gpt2').")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        token_types: list[int] = metadata["tokenizer.ggml.token_type"]
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]

        backend = tokenizers.Tokenizer(
            models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
        )
        backend.pre_tokenizer = _pre_tokenizer_for(metadata.get("tokenizer.ggml.pre", ""))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, token_types)
                if kind == _TOKEN_TYPE_CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, special=False, normalized=False)
                for token, kind in zip(tokens, token_types)
                if kind == _TOKEN_TYPE_USER_DEFINED
            ]
        )
        bos_token_id = metadata.get("tokenizer.ggml.bos_token_id")
        if bos_token_id is not None and metadata.get("tokenizer.ggml.add_bos_token", False):
            bos = tokens[bos_token_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
            )
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=metadata["tokenizer.ggml.eos_token_id"],
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """A Hugging Face model directory: `tokenizer.json`, `tokenizer_config.json`, and the chat
        template from `chat_template.jinja` when present (newer layout) or the config."""
        directory = pathlib.Path(path)
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _default_template(config.get("chat_template"))

        def token_id(name: str) -> int | None:
            token = config.get(name)
            content = token.get("content") if isinstance(token, Mapping) else token
            return backend.token_to_id(content) if content else None

        eos_token_id = token_id("eos_token")
        if eos_token_id is None:
            raise ValueError(f"{directory}: tokenizer_config.json names no eos_token in the vocabulary.")
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos_token_id,
            chat_template=chat_template,
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the declared eos first, then other end tokens."""
        return self._eos_token_ids

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """An upper bound on the input characters one token can cover (the longest vocabulary
        entry; byte-level entries hold one character per byte), so a text of n characters has at
        least n / this many tokens. None when a normalizer could shrink the text first."""
        if self._backend.normalizer is not None:
            return None
        return max(len(t) for t in self._backend.get_vocab(with_added_tokens=True))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` (`{"role", "content"}` dicts) in the model's format."""
        if self._chat_template is None:
            raise ValueError("This model has no chat template; send a plain prompt instead.")
        return self._chat_template.render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self._bos_token_id),
            eos_token=self._token_text(self._eos_token_id),
        )

    def encode_chat(self, messages: Iterable[Mapping[str, str]]) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant's turn opener. The template writes
        every special token itself, so none are added (as transformers does)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""


def _default_template(chat_template: Any) -> str | None:
    """`chat_template` in tokenizer_config.json is a string, or a list of named templates."""
    if isinstance(chat_template, list):
        named = {entry["name"]: entry["template"] for entry in chat_template}
        return named.get("default")
    return chat_template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in: sandboxed (templates come from
    model files, i.e. untrusted), trim_blocks/lstrip_blocks, and the same helper functions."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
