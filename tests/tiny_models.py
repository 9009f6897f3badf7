"""Tiny Llama-family models made in the tests: tokenizers trained with the `tokenizers` library on a
fixed corpus, random checkpoints saved by transformers, and GGUF vocabularies written with `gguf`.

- `llama3`: byte-level BPE with Llama-3's split regex, `<|begin_of_text|>` BOS, Llama-3 chat
  template; a LlamaForCausalLM with llama3 RoPE scaling.
- `qwen2`: byte-level BPE with Qwen2's split and NFC normalizer, ChatML; a Qwen2ForCausalLM (q/k/v
  bias).
- `spm`: a SentencePiece-style vocabulary (`▁` spaces, byte fallback `<0xXX>`, merges ranked by
  piece score, Llama-2's legacy normalizer), Mistral's `[INST]` template; a MistralForCausalLM.
Everything is deterministic (fixed corpus, seeded weights). `write_gguf_vocab` writes the same
vocabulary as a tokenizer-only GGUF the way llama.cpp's converter lays it out.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from common.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT, _spm_merges

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo, and Berlin is in Germany.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2 * i))\n",
    "She said: I'm sure we'll win, they've tried, it's done! Numbers 12345 3.14159 2024-11-30.",
    "中文分词测试：你好，世界！今天天气很好。日本語のテキストと한국어 텍스트",
    "Emoji 😀🤗👍🏽 and family 👨‍👩‍👧 and ünïcödé àccents, Ελληνικά, русский текст.",
    'JSON {"key": [1, 2, 3], "nested": {"x": null}} and URL https://example.com/a?b=1#c',
    "   leading spaces, tabs\tand\nnew lines\r\n and trailing   ",
] * 3

# Varied text the tests encode (not all of it seen in training: unknown characters, long digits).
MIXED = [
    "Hello, world! What is the capital of France?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "1234567890 and 3.14159, 1e-5, 42nd, 2024-11-30, 007",
    "Emoji: 😀🤗👍🏽 and family 👨‍👩‍👧 🦙🧪",
    "中文分词测试：你好，世界！北京是首都。",
    "日本語のテキストと한국어 텍스트",
    "Ünïcödé àccents (decomposed: e\u0301), ß, Ελληνικά, русский",
    "I'm sure THEY'LL say we've done it, isn't it?",
    "  two leading spaces\n\n\nthree newlines\r\nCRLF\ttab   ",
    "",
    " ",
    "a",
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# Qwen2.5-Instruct's template, which writes tools, tool calls and tool results itself
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are \
provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SPECS = {
    "llama3": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        template=LLAMA3_TEMPLATE,
        pre="llama-bpe",
    ),
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        template=CHATML_TEMPLATE,
        pre="qwen2",
    ),
    "spm": dict(
        specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", template=MISTRAL_TEMPLATE, pre=None
    ),
}


def _byte_level(kind: str, vocab_size: int) -> Tokenizer:
    split = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
    tok = Tokenizer(models.BPE())
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECS[kind]["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # specials first in the vocabulary (trainer order), so they are control tokens at low ids
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECS[kind]["specials"]])
    if kind == "llama3":
        bos = SPECS[kind]["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def _spm(vocab_size: int) -> Tokenizer:
    """Train pieces on `▁`-joined words, then lay the vocabulary out as SentencePiece does:
    <unk> <s> </s>, the 256 byte pieces, then pieces; a merged piece's score is minus its rank."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    merges = [m if isinstance(m, list) else m.split(" ", 1) for m in trained["merges"]]
    merged_rank = {"".join(m): rank for rank, m in enumerate(merges)}
    pieces = sorted(trained["vocab"], key=trained["vocab"].get)
    tokens = SPECS["spm"]["specials"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    unmerged = len(merged_rank)  # single characters rank after every merge
    scores = [0.0] * (3 + 256) + [-float(merged_rank.get(p, unmerged + i)) for i, p in enumerate(pieces)]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_spm_merges(tokens, scores, types),
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECS["spm"]["specials"]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok._tiny_scores = scores  # for write_gguf_vocab
    return tok


def build_tokenizer(kind: str, vocab_size: int = 640) -> Tokenizer:
    return _spm(vocab_size) if kind == "spm" else _byte_level(kind, vocab_size)


def thinking_tokenizer(kind: str) -> Tokenizer:
    """`kind`'s tokenizer with <think> and </think> added as single, not special tokens (as
    DeepSeek-R1's distills have them): a reasoning model's vocabulary (router/openai/reasoning.py)."""
    from tokenizers import AddedToken

    tok = build_tokenizer(kind)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


def write_tokenizer_dir(
    kind: str,
    directory: pathlib.Path,
    eos_ids: list[int] | None = None,
    tok: Tokenizer | None = None,
    template: str | None = None,
) -> Tokenizer:
    """tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, chat template) and a
    generation_config.json with the eos ids and sampling defaults (`tok` and `template`: other
    than `kind`'s)."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = SPECS[kind]
    tok = tok or build_tokenizer(kind)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "chat_template": template or spec["template"],
        "model_max_length": 256,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos = eos_ids or [tok.token_to_id(spec["eos"])]
    generation = {"eos_token_id": eos, "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    if spec["bos"]:
        generation["bos_token_id"] = tok.token_to_id(spec["bos"])
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return tok


def write_gguf_vocab(kind: str, path: pathlib.Path, tok: Tokenizer | None = None) -> pathlib.Path:
    """A tokenizer-only GGUF holding `kind`'s vocabulary as llama.cpp's converter writes it."""
    import gguf

    tok = tok or build_tokenizer(kind)
    spec = SPECS[kind]
    size = tok.get_vocab_size(with_added_tokens=True)
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(size)]
    special = set(spec["specials"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-{kind}")
    if kind == "spm":
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(tok._tiny_scores)
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (size - 259))
        writer.add_add_space_prefix(True)
        writer.add_unk_token_id(0)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(spec["pre"])
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 1 for t in tokens])
        merges = json.loads(tok.to_str())["model"]["merges"]
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    if spec["bos"]:
        writer.add_bos_token_id(tok.token_to_id(spec["bos"]))
        writer.add_add_bos_token(True)
    else:
        writer.add_add_bos_token(False)
    writer.add_eos_token_id(tok.token_to_id(spec["eos"]))
    writer.add_chat_template(spec["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_checkpoint(
    kind: str, directory: pathlib.Path, seed: int = 0, template: str | None = None, think: bool = False
) -> pathlib.Path:
    """A random tiny checkpoint of `kind`'s architecture with its tokenizer files (`think`: a
    reasoning model's vocabulary, `thinking_tokenizer`; `template`: another chat template)."""
    import torch
    import transformers

    tok = thinking_tokenizer(kind) if think else build_tokenizer(kind)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=tok.token_to_id(SPECS[kind]["eos"]),
    )
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # larger than the default init, so logits are far from ties
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    write_tokenizer_dir(kind, directory, tok=tok, template=template)  # after: save_pretrained writes its own
    return directory


def hub_cache(cache: pathlib.Path, repo_id: str, source: pathlib.Path) -> pathlib.Path:
    """`source`'s files as huggingface_hub caches a download of `repo_id` (HF_HUB_CACHE layout:
    models--ORG--NAME/{refs/main, snapshots/COMMIT/...}); returns the snapshot directory."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in source.iterdir():
        snapshot.joinpath(f.name).write_bytes(f.read_bytes())
    return snapshot
