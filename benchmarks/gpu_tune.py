"""Decode paged attention under several split-KV / tile settings (GPU only; part of `make gpu-session`).

The split-KV heuristic (worker/kernels/triton_attention.py: PROGRAMS_PER_SM, MIN_SPLIT_LEN) and
the decode key tile (DECODE_TILE_N) were first chosen without a GPU; this sweep picked the
current ones (2026-11-30, H200: PROGRAMS_PER_SM 16, MIN_SPLIT_LEN 128, DECODE_TILE_N 64). This
times the decode kernel of the `make bench-gpu` model (Llama-3.2-1B shape, bf16) at small batches
and long contexts, where the split count decides how full the GPU is, for each setting, with
`gpu_attention.attention_case` (CUDA graph replay, median, output checked against SDPA). Prints one
markdown table: K/V GB/s per case.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch

from benchmarks.gpu_attention import attention_case
from benchmarks.gpu_bench import LLAMA_1B
from worker.kernels import triton_attention as ta

BATCHES = [1, 4, 16, 64]
CONTEXTS = [8192, 32768]
SETTINGS = [
    dict(PROGRAMS_PER_SM=p, MIN_SPLIT_LEN=m, DECODE_TILE_N=t)
    for p, m, t in [
        (2, 256, 32),
        (8, 256, 32),
        (8, 128, 32),
        (16, 128, 32),
        (8, 128, 64),
        (2, 256, 64),
        (4, 128, 64),
        (16, 128, 64),
    ]
]


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("gpu_tune needs a CUDA device")
    device, cfg = torch.device("cuda"), LLAMA_1B
    defaults = {k: getattr(ta, k) for k in SETTINGS[0]}
    header = ["setting"] + [f"B{b} L{c // 1024}k" for b, c in itertools.product(BATCHES, CONTEXTS)]
    print(
        f"defaults: {defaults}; K/V GB/s of the paged decode kernel (max rel err vs SDPA in the "
        "last column)\n"
    )
    print("| " + " | ".join(header + ["max rel err", "s"]) + " |")
    print("|" + "---|" * (len(header) + 2))
    start = time.perf_counter()
    for setting in SETTINGS:
        for k, v in setting.items():
            setattr(ta, k, v)
        t0, cells, err = time.perf_counter(), [], 0.0
        for b, c in itertools.product(BATCHES, CONTEXTS):
            try:
                row = attention_case(b, c, cfg, torch.bfloat16, device)
                cells.append(f"{row['paged_gbps']:.0f}")
                err = max(err, row.get("max_rel_err_vs_sdpa", 0.0))
            except Exception as exc:  # noqa: BLE001 - keep the other settings' numbers
                cells.append(type(exc).__name__)
            torch.cuda.empty_cache()
        name = " ".join(f"{k}={v}" for k, v in setting.items())
        print(
            f"| {name} | " + " | ".join(cells) + f" | {err:.1e} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )
    for k, v in defaults.items():
        setattr(ta, k, v)
    print(f"\n{len(SETTINGS)} settings in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
