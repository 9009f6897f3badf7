"""Random paged-attention batches shared by the kernel tests (Triton and the torch CPU path).

A batch is a list of (cached prefix length, new tokens) per sequence; `make_batch` builds q (a
strided view into a fused qkv projection, as the model produces it), K/V caches whose blocks are
scattered over a shuffled physical pool, and the metadata of worker/attention.py.
Relative error is max|a - b| / max|b|. Bounds: fp32 1e-5, fp16/bf16 1e-2.
"""

import torch

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# Prefixes often end mid-block.
BATCHES = {
    "decode": [(5, 1), (33, 1), (80, 1)],
    "prefill": [(0, 70), (9, 7)],
    "mixed": [(17, 1), (0, 13), (40, 9), (31, 1), (16, 16)],
}
GQA = [(2, 1), (2, 3), (1, 8)]  # (num_kv_heads, query heads per kv head)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def make_batch(
    seqs, num_kv_heads, group, head_dim, dtype, seed, block_size=BLOCK_SIZE, extra_blocks=3, device="cpu"
):
    """Random q and caches; each sequence's blocks scattered over a shuffled physical pool."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    seq_lens = [ctx + new for ctx, new in seqs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at real (random) blocks: reading past seq_len would be seen.
    block_tables = torch.randint(0, num_blocks, (len(seqs), max(blocks_per_seq)), generator=gen)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[first : first + n]
        first += n
    num_tokens = sum(new for _, new in seqs)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # q is a view into a fused qkv projection, as the model produces it (row stride > H * D).
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)

    def dev(t, dt=None):
        return t.to(device=device, dtype=dt or t.dtype)

    return dict(
        q=dev(qkv, dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim),
        k_cache=dev(torch.randn(cache_shape, generator=gen), dtype),
        v_cache=dev(torch.randn(cache_shape, generator=gen), dtype),
        block_tables=dev(block_tables, torch.int32),
        seq_lens=dev(torch.tensor(seq_lens), torch.int32),
        query_start_loc=dev(torch.tensor(starts), torch.int32),
        scale=head_dim**-0.5,
    )
