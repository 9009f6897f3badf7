"""`python -m benchmarks.quant_accuracy --kernels ROWS`: the weight forms' speed on SmolLM2's layer
shapes (random weights): torch's dense, int4 and int8 kernels against our dequantize-then-GEMM and
int8-activation (VNNI) ops, ms for all 120 linears once per row count, plus the lm_head. Results:
docs/quantization.md ("Decisions" and "Faster CPU paths")."""

from __future__ import annotations

import json
import time

import torch

KERNEL_FORMS = ("f32", "bf16", "int4", "int4x2", "int8", "deq8", "int4 deq", "w4a8")


def kernel_sweep(rows: list[int], reps: int, forms=KERNEL_FORMS) -> list[dict]:
    """ms for every SmolLM2 linear layer once (30 x q|k|v, o, gate|up, down; random weights), per
    form and row count, best of `reps` interleaved rounds; plus the 49,152 x 576 lm_head.
    f32/bf16: F.linear; int4: Int4Linear (group 32); int4x2: the Q8_0 form (two int4 halves);
    int8: Int8Linear; deq8: int8 weights dequantized to bfloat16 on every call, then F.linear;
    int4 deq: Int4Linear through our dequantize-then-GEMM op at every row count; w4a8: Int4Linear
    with int8 activations (VNNI). The lm_head: bf16, int8 (torch's kernel), int8 tiled (our
    dequantized-tile GEMMs), w8a8 (VNNI). Forms whose op this CPU or build lacks are left out."""
    import torch.nn.functional as F

    from worker.kernels import cpu_quant
    from worker.model.quant import Int4Linear, Int8Embedding, Int8Linear

    has_op, has_vnni = cpu_quant.available(), cpu_quant.vnni_available()
    forms = [f for f in forms if (f != "int4 deq" or has_op) and (f != "w4a8" or has_vnni)]
    head_forms = ["head bf16", "head int8"] + ["head int8 tiled"] * has_op + ["head w8a8"] * has_vnni

    def variant(m, how: str):
        if how == "deq":
            m.dequant_min_rows = 1
        elif how == "vnni" and not (m.to_w4a8 if isinstance(m, Int4Linear) else m.to_w8a8)():
            raise RuntimeError(f"the VNNI op does not take {m}")
        return m

    gen = torch.Generator().manual_seed(0)
    shapes = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
    layers = []
    for _ in range(30):
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.02
            q = torch.randint(0, 16, (n, 2 * k), generator=gen, dtype=torch.uint8)
            layers.append(
                {
                    "f32": w,
                    "bf16": w.to(torch.bfloat16),
                    "int4": Int4Linear.from_float(w),
                    "int4x2": Int4Linear(
                        q,
                        torch.rand(n, k // 16, generator=gen) * 1e-3,
                        torch.zeros(n, k // 16),
                        input_repeats=2,
                    ),
                    "int8": Int8Linear.from_float(w),
                    "int4 deq": variant(Int4Linear.from_float(w), "deq") if "int4 deq" in forms else None,
                    "w4a8": variant(Int4Linear.from_float(w), "vnni") if "w4a8" in forms else None,
                    "k": k,
                }
            )
    head_w = torch.randn(49152, 576, generator=gen) * 0.02
    head = {"head bf16": head_w.to(torch.bfloat16), "head int8": Int8Embedding.from_float(head_w)}
    if has_op:
        head["head int8 tiled"] = variant(Int8Embedding.from_float(head_w), "deq")
    if has_vnni:
        head["head w8a8"] = variant(Int8Embedding.from_float(head_w), "vnni")
    del head_w

    def run(form, xs):
        for layer in layers:
            x = xs[(form == "f32", layer["k"])]
            if form in ("f32", "bf16"):
                F.linear(x, layer[form])
            elif form == "deq8":
                m = layer["int8"]
                F.linear(x, m.weight.to(torch.bfloat16) * m.scales[:, None])
            else:
                layer[form](x)

    def run_head(form, xs):
        x = xs[(False, 576)]
        F.linear(x, head[form]) if form == "head bf16" else head[form].linear(x)

    out = []
    with torch.inference_mode():
        for m in rows:
            xs = {
                (f32, k): torch.randn(m, k, generator=gen).to(torch.float32 if f32 else torch.bfloat16)
                for f32 in (True, False)
                for k in (576, 1536)
            }
            best: dict[str, float] = {}
            for _ in range(reps):
                for form in list(forms) + head_forms:
                    fn = run_head if form.startswith("head") else run
                    start = time.perf_counter()
                    fn(form, xs)
                    best[form] = min(best.get(form, 1e9), (time.perf_counter() - start) * 1e3)
            out.append({"rows": m, **{k: round(v, 2) for k, v in best.items()}})
            print(json.dumps(out[-1]), flush=True)
    return out
