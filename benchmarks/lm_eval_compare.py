"""`python -m benchmarks.lm_eval_compare SAMPLES.jsonl`: lm-evaluation-harness loglikelihoods from
our server against transformers on the same GGUF.

Contract
- input: a `--log_samples` file of an lm-eval multiple-choice run through our OpenAI API (its
  `arguments` (context, continuation) pairs and `resps` loglikelihoods); the embedded SmolLM2 GGUF
  (or `--model`), dequantized to float32 by transformers: the reference no one here wrote.
- output: one line: documents, accuracy from our loglikelihoods and from transformers', how many
  documents pick the same choice, and the mean / max |our - transformers'| loglikelihood (nats).
- how: each (context, continuation) is tokenized as lm-eval does (context alone, then context +
  continuation; the continuation is what the second adds) with the GGUF's tokenizer, and scored in
  one float32 forward pass: the sum of the continuation tokens' log-softmax.
- failure modes: a file with no multiple-choice samples -> SystemExit naming it.
- proven by: used for docs/benchmarks.md, "lm-evaluation-harness through the OpenAI API"; the
  server side is tested in tests/test_openai_e2e.py (lm-eval's payload and parsing).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch


def continuation_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    ctx = tokenizer(context).input_ids
    whole = tokenizer(context + continuation).input_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", help="lm-eval's samples_<task>_<time>.jsonl")
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.model_files import default_model_path

    path = pathlib.Path(args.model) if args.model else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    with open(args.samples) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    if not docs or "arguments" not in docs[0]:
        raise SystemExit(f"{args.samples}: no lm-eval samples")
    diffs, ours_right, ref_right, same = [], 0, 0, 0
    for doc in docs:
        pairs = [
            doc["arguments"][k] for k in sorted(doc["arguments"], key=lambda k: int(k.rsplit("_", 1)[1]))
        ]
        ref = [continuation_loglikelihood(model, tokenizer, p["arg_0"], p["arg_1"]) for p in pairs]
        ours = [float(r[0][0]) for r in doc["resps"]]
        diffs += [abs(a - b) for a, b in zip(ours, ref)]
        pick_ours = max(range(len(ours)), key=ours.__getitem__)
        pick_ref = max(range(len(ref)), key=ref.__getitem__)
        answer = int(doc["target"])
        ours_right += pick_ours == answer
        ref_right += pick_ref == answer
        same += pick_ours == pick_ref
    n = len(docs)
    print(
        f"{n} documents: accuracy ours {ours_right / n:.2f}, transformers float32 {ref_right / n:.2f}; "
        f"same choice in {same}/{n}; |loglikelihood ours - transformers| mean {sum(diffs) / len(diffs):.2e} "
        f"max {max(diffs):.2e} nats"
    )


if __name__ == "__main__":
    main()
