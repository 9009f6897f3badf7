"""`python -m tests.avx2_build_check`: run by tests/test_cpu_attention.py in processes that build
an AVX2-only copy of the llm_cpu extension (LLM_CPU_EXT_MARCH=x86-64-v3): checks that copy's SIMD
paths against their references (attention, the fused ops, argmax, the int8-activation ops' AVX2
dot products) and prints its build info and library path."""

import torch
import torch.nn.functional as F

from tests.attention_batches import make_batch, rel_error
from worker.kernels import cpu_attention, cpu_ext, cpu_fused, cpu_quant, reference
from worker.model.quant import Int4Linear, Int8Linear


def main() -> None:
    cpu_ext.load()
    batch = make_batch([(0, 1), (40, 1), (300, 1), (17, 9), (0, 33)], 2, 3, 64, torch.float32, seed=0)
    err = rel_error(cpu_attention.paged_attention(**batch), reference.paged_attention(**batch))
    assert err < 1e-5, err
    # The fused ops' SIMD paths too (the AVX2 exp of silu_and_mul): vs torch, ends of exp included.
    g = torch.cat([torch.randn(1000) * 8, torch.tensor([-200.0, -100.0, -89.0, 89.0, 100.0])])
    x = torch.cat([g, torch.randn(g.shape[0])])[None].bfloat16()
    ref = F.silu(x[:, : g.shape[0]]) * x[:, g.shape[0] :]
    diff = (cpu_fused.silu_and_mul(x).view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert int(diff.max()) == 0, int(diff.max())
    # argmax_rows' scalar path (the AVX-512 blocks are not in this build): ties, infinities, NaN.
    rows = torch.randn(6, 37).bfloat16()
    rows[1, [3, 20]] = 9.0
    rows[2] = float("-inf")
    rows[3, [8, 30]] = float("nan")
    rows[4, 36] = float("inf")
    assert torch.equal(cpu_fused.argmax_rows(rows), rows.float().argmax(-1))
    # The int8-activation ops' AVX2 path (vpmaddubsw + vpmaddwd): the activations rounded exactly as
    # the reference rounds them, both products against float32 (rows 1 + 2 + 4 blocks, an int8
    # weight of -128, a NaN row).
    assert torch.ops.llm_cpu.int8_dots_isa() == "AVX2" and cpu_quant.vnni_available()
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 128, generator=gen) * torch.rand(7, 1, generator=gen) * 4).bfloat16()
    x[0, :32] = 0
    q, d, sums = torch.ops.llm_cpu.quantize_activations(x)
    want_q, want_d, want_sums = cpu_quant.quantize_reference(x)
    assert torch.equal(q.view(7, 4, 32).float(), want_q) and torch.equal(d, want_d)
    assert torch.equal(sums, want_sums)
    rounded = cpu_quant.round_activations(x)
    i4 = Int4Linear.from_float(torch.randn(64, 128, generator=gen) * 0.05)
    lin = Int8Linear.from_float(torch.randn(32, 128, generator=gen))
    lin.weight[3, 5] = -128
    for module, convert in ((i4, i4.to_w4a8), (lin, lin.to_w8a8)):
        ref = rounded @ module.dequantize().T
        assert convert()
        err = float((module(x).float() - ref).abs().max())
        assert err <= 0.01 * float(ref.abs().max()), err
    y = x.clone()
    y[2, 7] = float("nan")
    assert i4(y)[2].isnan().all() and not i4(y)[3].isnan().any()
    print(cpu_ext.build_info(), cpu_ext.library_path())


if __name__ == "__main__":
    main()
