"""Text <-> token ids, and chat messages -> prompt, for the router. Never imports torch.

Contract:
- Built from a GGUF file (`Tokenizer.from_gguf`: byte-level BPE with the llama-bpe, qwen2, smollm
  or gpt2 split, or a SentencePiece `llama` vocabulary; common/gguf_tokenizer.py) or from a
  Hugging Face directory (`Tokenizer.from_pretrained_dir`: `tokenizer.json`,
  `tokenizer_config.json`, the chat template, and generation_config.json's eos ids);
  `Tokenizer.from_model(path)` picks by the path.
- `encode(text, add_special_tokens) -> list[int]`, `decode(ids) -> str`; control tokens such as
  `<|im_start|>` are matched whole in the text (a raw completion prompt: the client's own).
  `apply_chat_template(messages, tools) -> str` renders the model's own Jinja template in a
  sandbox; `encode_chat(messages, tools, max_chars, parse_special_in_messages=False)` tokenizes it.
- Control tokens of a chat come from the template only: text from the messages (contents, names,
  call ids and arguments), tool definitions and tool results is tokenized as plain text, so a
  user cannot write a turn; the prompt text is what the template renders, and a chat holding no
  control-token text gets the ids it always got (one render, one tokenization). One that does
  (common/control_tokens.py finds it) is rendered again with sentinels for that text; the control
  tokens of that rendering are the template's, and when putting the text back gives the same
  prompt, they become marker tokens of a tokenizer copy with special-token parsing off
  (`_Marked`), tokenized in one pass, so each boundary merges as in the whole prompt (pieces
  encoded one by one would not: a Metaspace `prepend_scheme="first"` vocabulary adds a `▁` to
  each). Why not escape the text instead (break `<|im_end|>` so it cannot match): the model would
  see other characters than the user wrote. Where the sentinels break (a template that rewrites
  the text: `| upper`, a hash, `tojson(ensure_ascii=True)`), the prompt's own ids are kept when
  their control tokens equal the template's, else (or when the template refuses the sentinels)
  ValueError. `parse_special_in_messages=True` (the router's `--parse-special-tokens-in-messages`):
  the rendered prompt tokenized whole.
  Non-special added tokens (`<tool_call>`, `<think>` in Qwen's vocabularies) still match in text,
  as in llama.cpp. Cost: the protected path renders twice and tokenizes twice.
- `fingerprint` -> `Fingerprint(vocab_size, eos_token_ids, vocab_sha256)`: router and worker each
  compute it from their own model files and must agree before ids cross between them.
- State: read-only after construction (the protected path's marker tokenizer and control-token
  matcher are built on first use), so one instance serves every request.
- Fails: `ValueError` for an unsupported GGUF vocabulary (naming the model / pre-tokenizer), a
  directory whose config names no eos token, or a chat request on a model without a template,
  or control-token text in the messages that the template rewrites into control tokens (the
  message says so); `jinja2.TemplateError` when the template rejects the messages.
- Proven by tests/test_tokenizer.py (the embedded GGUF: ids equal transformers' tokenizer loaded
  from the same GGUF on varied text, decode round-trips, the chat prompt equals transformers'
  rendering) and tests/test_tokenizer_models.py (Llama-3 BPE, Qwen2, SentencePiece vocabularies
  as GGUF and as directories against transformers on a mixed corpus; fingerprints),
  tests/test_control_tokens.py (forged turns in contents, names, tools, calls and results are
  text; normal chats equal transformers' ids; the opt-out; raw prompts still parse).
"""

import dataclasses
import functools
import hashlib
import json
import pathlib
import secrets
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.chat_tools import TemplateFeatures, template_inputs
from common.control_tokens import ControlTokenText, Protected
from common.gguf_tokenizer import build_gguf_backend
from common.model_files import read_gguf_metadata
from common.token_bytes import ByteTable, build_byte_table

# Special tokens that end a generation besides the declared eos, as llama.cpp's end-of-generation
# set: SmolLM2 declares `<|im_end|>` but a model may still close a document with `<|endoftext|>`.
_END_OF_GENERATION_TOKENS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>"}
)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What router and worker must agree on for token ids to mean the same text."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    vocab_sha256: str

    def describe(self) -> str:
        return f"vocab {self.vocab_size}, eos {list(self.eos_token_ids)}, sha256 {self.vocab_sha256[:12]}"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids and chat template that go with it."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int,
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
        tool_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        end_ids = sorted(i for i in self._special_ids if added[i].content in _END_OF_GENERATION_TOKENS)
        declared = [eos_token_id, *(i for i in extra_eos_token_ids if i != eos_token_id)]
        self._eos_token_ids = (*declared, *(i for i in end_ids if i not in declared))
        # the model's template, and the one its files name "tool_use" for requests with tools (Hermes)
        self._templates = {
            name: (_compile_chat_template(source), TemplateFeatures.of(source))
            for name, source in (("default", chat_template), ("tool_use", tool_template))
            if source
        }

    @classmethod
    def from_model(cls, path: str | pathlib.Path) -> "Tokenizer":
        """The tokenizer of a model: a `.gguf` file or a Hugging Face directory."""
        path = pathlib.Path(path)
        return cls.from_pretrained_dir(path) if path.is_dir() else cls.from_gguf(path)

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> "Tokenizer":
        """The GGUF's vocabulary (`common.gguf_tokenizer`: byte-level BPE or SentencePiece)."""
        metadata = read_gguf_metadata(path)
        try:
            backend = build_gguf_backend(metadata)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata["tokenizer.ggml.eos_token_id"],
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_eos_token_ids=_listed(metadata.get("tokenizer.ggml.eot_token_id")),
            tool_template=metadata.get("tokenizer.chat_template.tool_use"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        """A Hugging Face model directory: `tokenizer.json`, `tokenizer_config.json`, and the chat
        template from `chat_template.jinja` when present (newer layout) or the config."""
        directory = pathlib.Path(path)
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"{directory} has no tokenizer.json: a model directory must ship its tokenizer")
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _named_template(config.get("chat_template"), "default")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            content = token.get("content") if isinstance(token, Mapping) else token
            return backend.token_to_id(content) if content else None

        eos_token_id = token_id("eos_token")
        if eos_token_id is None:
            raise ValueError(f"{directory}: tokenizer_config.json names no eos_token in the vocabulary.")
        generation_file = directory / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos_token_id,
            chat_template=chat_template,
            extra_eos_token_ids=_listed(generation.get("eos_token_id")),
            tool_template=_named_template(config.get("chat_template"), "tool_use"),
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

    @functools.cached_property
    def fingerprint(self) -> Fingerprint:
        """Vocabulary size, end ids and a SHA-256 over every (id, token, special) entry."""
        added = self._backend.get_added_tokens_decoder()
        vocab = self._backend.get_vocab(with_added_tokens=True)
        entries = sorted((i, t, i in added and added[i].special) for t, i in vocab.items())
        digest = hashlib.sha256(json.dumps(entries, ensure_ascii=False).encode()).hexdigest()
        return Fingerprint(self.vocab_size, self._eos_token_ids, digest)

    @functools.cached_property
    def byte_table(self) -> ByteTable | None:
        """Each id's bytes and how the decoder joins them (common/token_bytes.py), built on first
        use; None when the decoder is not one reproduced exactly (the caller decodes text then)."""
        return build_byte_table(self._backend)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON (what llguidance builds its token trie from)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a 600k-character prompt
        # tokenized on a helper thread then no longer stalls the router's event loop for seconds.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` (`{"role", "content"}` dicts, with tool calls and tool
        results as common/chat_tools.py describes) and `tools` in the model's format."""
        template = self._templates.get("tool_use" if tools and "tool_use" in self._templates else "default")
        if template is None:
            raise ValueError("This model has no chat template; send a plain prompt instead.")
        compiled, features = template
        messages = [dict(message) for message in messages]
        tools = [dict(tool) for tool in tools or ()]

        def render(system_role: bool) -> str:
            turns, shown = template_inputs(messages, tools, features, system_role)
            return compiled.render(
                messages=turns,
                tools=shown,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self._bos_token_id),
                eos_token=self._token_text(self._eos_token_id),
            )

        try:
            return render(system_role=True)
        except jinja2.TemplateError:
            if not tools or features.tools or (messages and messages[0]["role"] == "system"):
                raise
            return render(
                system_role=False
            )  # a template without a system role (Gemma): tools in the first turn

    def encode_chat(
        self,
        messages: Iterable[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_chars: int | None = None,
        parse_special_in_messages: bool = False,
    ) -> list[int]:
        """Prompt ids for `messages` (and `tools`), ending with the assistant's turn opener. The
        template writes every special token itself, so none are added (as transformers does).
        `max_chars`: a rendered prompt longer than this is a ValueError, not tokenized (a template
        may write far more than its input: tools pretty-printed with `tojson(indent=4)`).
        Control tokens come from the template only: control-token text in the messages and tools
        is tokenized as the plain text it is, unless `parse_special_in_messages` (the operator's
        opt-out: the rendered prompt is tokenized whole, as before)."""
        messages = [dict(message) for message in messages]
        tools = [dict(tool) for tool in tools or ()]
        text = self.apply_chat_template(messages, tools=tools)
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(f"the chat template renders {len(text)} characters, more than {max_chars}")
        protected = None if parse_special_in_messages else self._control_text.protect(messages, tools)
        if protected is None:  # nothing in the messages could make a control token
            return self.encode(text, add_special_tokens=False)
        return self._encode_protected(text, protected)

    def _encode_protected(self, text: str, protected: Protected) -> list[int]:
        """`text` (the rendered prompt) tokenized with the control tokens the template wrote, and
        the messages' control-token text as plain text. The template is rendered again with the
        risky fragments as sentinels; every control token found in that rendering is the
        template's. Where the sentinels came out unchanged (the rendering with the fragments put
        back is `text`), those control tokens become marker tokens and the rest is tokenized with
        special-token parsing off (`_Marked`): one pass, so merges at every boundary are the ones
        the whole prompt gets. Otherwise the template rewrote a fragment (`| upper`, a hash, a
        slice): `text`'s own ids are kept when their control tokens are exactly the template's,
        else the chat is refused."""
        try:
            rendered = self.apply_chat_template(protected.messages, tools=protected.tools)
        except jinja2.TemplateError:  # the template refused a sentinel (an id's length, say)
            rendered = None
        if rendered is not None:
            template_tokens = self._control_spans(rendered)
            marked = self._marked
            pieces, plain, at = [], [], 0
            for token_id, start, end in template_tokens:
                between = protected.restore(rendered[at:start])
                pieces += (between, marked.markers[token_id])
                plain += (between, rendered[start:end])
                at = end
            pieces.append(protected.restore(rendered[at:]))
            plain.append(pieces[-1])
            if "".join(plain) == text and marked.nonce not in text:
                ids = marked.backend.encode_batch(["".join(pieces)], add_special_tokens=False)[0].ids
                return [marked.ids.get(i, i) for i in ids]
            ours = [token_id for token_id, _, _ in template_tokens]
            if [token_id for token_id, _, _ in self._control_spans(text)] == ours:
                return self.encode(text, add_special_tokens=False)
        raise ValueError(
            "the messages hold control-token text (such as "
            f"{self._control_example()!r}) that this model's chat template rewrites, so it cannot "
            "be kept as plain text; remove it from the messages"
        )

    def _control_spans(self, text: str) -> list[tuple[int, int, int]]:
        """(id, start, end) of each control token the tokenizer matches in `text` (a special id
        whose characters hold the token's own text: not an unknown-token id a BPE gave text)."""
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        contents = self._special_contents
        return [
            (token_id, start, end)
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets)
            if token_id in contents and contents[token_id] in text[start:end]
        ]

    def _control_example(self) -> str:
        contents = self._special_contents
        return contents.get(self._eos_token_id) or next(iter(contents.values()), "")

    @functools.cached_property
    def _special_contents(self) -> dict[int, str]:
        added = self._backend.get_added_tokens_decoder()
        return {i: added[i].content for i in self._special_ids}

    def prepare_chat(self) -> None:
        """Builds now what `encode_chat` builds on the first message holding control-token text (a
        copy of the vocabulary: ~0.3 s holding the GIL, so every thread of the process waits; a
        server calls this at start-up, not in its first such request)."""
        self._control_text  # noqa: B018 - cached
        self._marked  # noqa: B018 - cached

    @functools.cached_property
    def _control_text(self) -> ControlTokenText:
        return ControlTokenText(self._special_contents.values())

    @functools.cached_property
    def _marked(self) -> "_Marked":
        return _Marked.of(self._backend, self._special_ids)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""


@dataclasses.dataclass(frozen=True)
class _Marked:
    """A copy of the tokenizer that matches no control token's text (special-token parsing off:
    `encode_special_tokens`) but matches, for each control token, a marker string (a per-process
    random nonce between noncharacters, never shown to a client) with the token's strip rules;
    `ids` maps each marker's id back to its token's."""

    backend: tokenizers.Tokenizer
    markers: dict[int, str]
    ids: dict[int, int]
    nonce: str

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer, special_ids: Iterable[int]) -> "_Marked":
        copy = tokenizers.Tokenizer.from_str(backend.to_str())
        copy.encode_special_tokens = True
        added = backend.get_added_tokens_decoder()
        nonce = "\ufdef" + secrets.token_hex(8)
        markers = {i: f"{nonce}{i}\ufdef" for i in sorted(special_ids)}
        kept = {i: {"lstrip": added[i].lstrip, "rstrip": added[i].rstrip, "special": False} for i in markers}
        copy.add_tokens([tokenizers.AddedToken(m, normalized=False, **kept[i]) for i, m in markers.items()])
        return cls(copy, markers, {copy.token_to_id(m): i for i, m in markers.items()}, nonce)


def _listed(value: Any) -> tuple[int, ...]:
    """An id or list of ids from a config (None -> none)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _named_template(chat_template: Any, name: str) -> str | None:
    """`chat_template` in tokenizer_config.json is a string, or a list of named templates
    ("default", and "tool_use" in Hermes' models)."""
    if isinstance(chat_template, list):
        named = {entry["name"]: entry["template"] for entry in chat_template}
        return named.get(name)
    return chat_template if name == "default" else None


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
