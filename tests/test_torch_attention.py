"""The CPU attention path (worker/kernels/torch_attention.py) against the float32 oracle.

Same random batches as the Triton tests (tests/attention_batches.py): ragged lengths, prefixes
that end mid-block, GQA 1/3/8, blocks scattered over a shuffled pool, q a strided view. Output
buffers are checked for NaN (every row must be written) and a plan built once must serve every
call of a step, as the layers share it.
"""

import subprocess
import sys

import pytest
import torch

from tests.attention_batches import BATCHES, GQA, TOLERANCE, make_batch, rel_error
from tests.procs import REPO
from worker.attention import AttentionMetadata, get_attention_backend
from worker.kernels import reference, torch_attention

# A serving-like decode batch: many sequences, long and short, plus one prefill chunk after a
# cached prefix and one fresh prompt.
SERVING = [(n, 1) for n in (1, 15, 16, 17, 63, 200, 511)] + [(48, 20), (0, 37)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize("kind", list(BATCHES) + ["serving"])
def test_matches_reference(kind, num_kv_heads, group, head_dim):
    seqs = SERVING if kind == "serving" else BATCHES[kind]
    batch = make_batch(seqs, num_kv_heads, group, head_dim, torch.float32, seed=0)
    out = torch_attention.paged_attention(**batch)
    assert not out.isnan().any()
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    batch = make_batch(SERVING, 2, 3, 64, dtype, seed=1)
    out = torch_attention.paged_attention(**batch)
    assert out.dtype == dtype
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[dtype]


def test_plan_is_reused_across_calls():
    batch = make_batch(SERVING, 3, 3, 64, torch.float32, seed=2)
    plan = torch_attention.plan_attention(
        batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], batch["k_cache"].shape[1]
    )
    assert [p.q_len for p in plan] == [new for _, new in SERVING]
    assert [p.mask is not None for p in plan] == [new > 1 and ctx > 0 for ctx, new in SERVING]
    first = torch_attention.paged_attention(**batch, plan=plan)
    # A second layer: new caches and queries, same metadata and plan.
    other = make_batch(SERVING, 3, 3, 64, torch.float32, seed=3)
    other = dict(batch, q=other["q"], k_cache=other["k_cache"], v_cache=other["v_cache"])
    second = torch_attention.paged_attention(**other, plan=plan)
    assert rel_error(first, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]
    assert rel_error(second, reference.paged_attention(**other)) < TOLERANCE[torch.float32]


def test_reads_nothing_past_seq_len():
    """Poisoning every cache row beyond each sequence's length (NaN) must not reach the output."""
    batch = make_batch(SERVING, 2, 3, 64, torch.float32, seed=4)
    expected = torch_attention.paged_attention(**batch)
    block_size = batch["k_cache"].shape[1]
    live = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool)
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len):
            live[batch["block_tables"][i, pos // block_size], pos % block_size] = True
    for cache in (batch["k_cache"], batch["v_cache"]):
        cache[~live] = float("nan")
    assert torch.equal(torch_attention.paged_attention(**batch), expected)


def test_backend_forward_writes_then_attends():
    """Through the backend seam: new K/V land in the cache and the step's plan is built once."""
    backend = get_attention_backend("torch", torch.device("cpu"))
    batch = make_batch([(5, 1), (0, 4)], 1, 2, 64, torch.float32, seed=5)
    seq_lens = batch["seq_lens"].tolist()
    block_size = batch["k_cache"].shape[1]
    slots = [
        int(batch["block_tables"][i, p // block_size]) * block_size + p % block_size
        for i, n in enumerate(seq_lens)
        for p in range(n - (1 if i == 0 else 4), n)
    ]
    meta = AttentionMetadata(
        torch.tensor(slots),
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        max_query_len=4,
        max_seq_len=max(seq_lens),
    )
    k = torch.randn(5, 1, 64)
    v = torch.randn(5, 1, 64)
    out = backend.forward(batch["q"], k, v, batch["k_cache"], batch["v_cache"], meta, batch["scale"])
    plan = meta.prepared
    assert plan is not None
    flat_k = batch["k_cache"].view(-1, 1, 64)
    assert torch.equal(flat_k[torch.tensor(slots)], k)
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]
    backend.forward(batch["q"], k, v, batch["k_cache"], batch["v_cache"], meta, batch["scale"])
    assert meta.prepared is plan


def test_rejects_bad_arguments():
    batch = make_batch(BATCHES["mixed"], 2, 3, 64, torch.float32, seed=6)
    with pytest.raises(ValueError, match="dtype mismatch"):
        torch_attention.paged_attention(**dict(batch, q=batch["q"].half()))
    with pytest.raises(ValueError, match="batch mismatch"):
        torch_attention.paged_attention(**dict(batch, seq_lens=batch["seq_lens"][:-1]))
    too_long = batch["seq_lens"].clone()
    too_long[0] = batch["block_tables"].shape[1] * batch["k_cache"].shape[1] + 1
    with pytest.raises(ValueError, match="needs more than the"):
        torch_attention.paged_attention(**dict(batch, seq_lens=too_long))


def test_benchmark_command_runs():
    """`make bench-attention` at a tiny size: it checks both paths agree before timing them."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_attention", "--batch-sizes", "1", "3", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(row[3]) > 0 and row[4].endswith("x") for row in rows)
