"""What each request asks for: prompts and output lengths, drawn from a seed per tenant.

Contract
- input: a `TenantSpec`, the run seed, a `SyntheticText` (needed for synthetic prompts and shared
  prefixes) and the tenant's prompt set (bundled or from a file) when it uses one.
- output: `Workload.next() -> RequestSpec`, the i-th request of the tenant. A prompt is
  `shared prefix (prefix_len tokens) + unique part`; the unique part is `input_len` synthetic
  tokens, or a prompt from the set. Synthetic prompts are words that are one token each in the
  client's tokenizer, so `prompt_ids == tokenizer.encode(prompt)` and the length is exact for a
  server using the same tokenizer (others report their own count in usage).
- state: one `random.Random` per tenant seeded by (seed, tenant name): the same seed gives the
  same stream whatever the arrival timing or the other tenants do.
- failure modes: ValueError for an empty prompt file or a tokenizer without single-token words.
- proven by: tests/test_loadtest_workload.py.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
from dataclasses import dataclass

from loadtest.config import TenantSpec

BUNDLED_PROMPTS = pathlib.Path(__file__).with_name("prompts.jsonl")
_WORD = re.compile(r" [a-z]{2,10}")
MAX_WORDS = 4096


@dataclass(frozen=True)
class RequestSpec:
    tenant: str
    index: int  # position in the tenant's stream
    prompt: str
    prompt_ids: tuple[int, ...] | None  # exact ids (synthetic prompts); None = unknown
    max_tokens: int
    seed: int  # sampling seed (matters when temperature > 0)


class SyntheticText:
    """Words that are exactly one token each, with their leading space, in a tokenizer."""

    def __init__(self, tokenizer):
        words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text) and tokenizer.encode(text) == [token_id]:
                words.append((text, token_id))
                if len(words) == MAX_WORDS:
                    break
        if len(words) < 100:
            raise ValueError("this tokenizer has too few single-token words for synthetic prompts")
        self.words = tuple(words)

    def make(self, rng: random.Random, num_tokens: int) -> tuple[str, tuple[int, ...]]:
        picked = [self.words[rng.randrange(len(self.words))] for _ in range(num_tokens)]
        return "".join(w for w, _ in picked), tuple(i for _, i in picked)


def load_prompts(source: str) -> tuple[str, ...]:
    """`bundled`, a `.jsonl` file with a "prompt" field per line, or a text file, one per line."""
    path = BUNDLED_PROMPTS if source == "bundled" else pathlib.Path(source)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = tuple(json.loads(line)["prompt"] for line in lines) if path.suffix == ".jsonl" else tuple(lines)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


class Workload:
    def __init__(
        self,
        tenant: TenantSpec,
        seed: int | str,
        synthetic: SyntheticText | None,
        prompt_set: tuple[str, ...] | None = None,
    ):
        if (tenant.prompts == "synthetic" or tenant.shared_prefix_len) and synthetic is None:
            raise ValueError(f"tenant {tenant.name}: synthetic prompts need a tokenizer")
        if tenant.prompts != "synthetic" and not prompt_set:
            raise ValueError(f"tenant {tenant.name}: prompts {tenant.prompts!r} need a prompt set")
        self.tenant = tenant
        self._synthetic = synthetic
        self._prompt_set = prompt_set
        self._rng = random.Random(f"{seed}:{tenant.name}:workload")
        self._prefix, self._prefix_ids = "", ()
        if tenant.shared_prefix_len:
            prefix_rng = random.Random(f"{seed}:{tenant.name}:prefix")
            self._prefix, self._prefix_ids = synthetic.make(prefix_rng, tenant.shared_prefix_len)
        self._index = 0

    def next(self) -> RequestSpec:
        rng = self._rng
        if self.tenant.prompts == "synthetic":
            text, ids = self._synthetic.make(rng, self.tenant.input_len.sample(rng))
            prompt, prompt_ids = self._prefix + text, self._prefix_ids + ids
        else:
            text = self._prompt_set[rng.randrange(len(self._prompt_set))]
            prompt, prompt_ids = (self._prefix + "\n" + text if self._prefix else text), None
        spec = RequestSpec(
            self.tenant.name,
            self._index,
            prompt,
            prompt_ids,
            self.tenant.output_len.sample(rng),
            rng.randrange(2**31),
        )
        self._index += 1
        return spec
