"""What the weight-only quantization tests share (tests/test_quant.py, tests/test_quant_gguf.py,
tests/test_quant_smollm.py): the bfloat16 tolerances, random Q4_K blocks (gguf has no Q4_K
quantizer), and a module-scoped autouse fixture that runs each module on one intra-op thread
(import `one_thread` into the module to use it). No tests here.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as tests/conftest.py's runner uses: on these shared 2-vCPU machines
    OpenMP fork/join under CPU steal made two threads several times slower (measured here too:
    the float32 reference's greedy setup took 126 s on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BF16_U = 2.0**-8  # bfloat16 unit roundoff (8-bit significand)


def bf16_out_tol(ref: torch.Tensor) -> float:
    """A kernel's bfloat16 output rounding plus fp32 accumulation-order noise."""
    return float(ref.abs().max()) * 2 * BF16_U + 1e-3


def q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K rows (gguf has no Q4_K quantizer): random 6-bit scales/mins and nibbles, small
    float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((rows, cols // 256, 1)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = (rng.random((rows, cols // 256, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)
