"""FP8 W8A8 linear layers (`--quantization fp8`): float8_e4m3fn weights with per-output-channel
scales, activations quantized per token at run time, one `torch._scaled_mm` per projection.

Contract:
- `quantize_fp8(w [N, K]) -> (q float8_e4m3fn [N, K], scale float32 [N])`: symmetric per output
  channel, `scale = max|w[n]| / 448` (448 = the largest e4m3 value), `q = round(w / scale)`
  saturated; an all-zero row gets scale 1.
- `Fp8Linear(q, scale, bias=None, out_dtype=bfloat16)`: `forward(x [..., K]) -> [..., N]` in
  out_dtype. x is quantized per row the same way (`x_scale [M, 1]`; on CUDA by one Triton kernel,
  worker/kernels/triton_quant.py, unless `ACT_QUANT = "torch"`), then
  `_scaled_mm(xq, q.T, scale_a=x_scale, scale_b=scale[None, :], out_dtype)` computes
  `(xq * x_scale) @ (q * scale).T` with float32 accumulation. `forward_reference(x)` is that same
  formula in float32 over the dequantized operands: the slow reference the op is tested against;
  `dequantize() -> float32 [N, K]`.
- `quantize_model_fp8(model) -> int`: swaps every `nn.Linear` inside the decoder layers (q|k|v,
  o_proj, gate|up, down_proj) for an Fp8Linear, in place, and returns how many; the embedding, the
  lm_head and the norms stay in the model dtype. Layers already converted are left alone.
- Where it runs: torch._scaled_mm on CUDA needs compute capability >= 8.9 (Ada, Hopper); torch
  2.13's CPU build runs it too (that is how tests/test_fp8.py checks it without a GPU). Shapes the
  op refuses (K or N not a multiple of 16) fall back to the reference formula.
- Fails how: `quantize_model_fp8` raises RuntimeError on a CUDA device below 8.9.
- Proven by tests/test_fp8.py (op == reference formula, quantization error bounds, a model's
  greedy tokens with fp8 weights vs bf16 on CPU); the accuracy on a real checkpoint (logit error,
  greedy agreement) by the GPU session (benchmarks/gpu_fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Activation quantization on CUDA: "triton" = one kernel per call (worker/kernels/triton_quant.py),
# "torch" = quantize_fp8's ~6 kernels (the benchmark times both).
ACT_QUANT = "triton"


def quantize_fp8(w: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 quantization with one float32 scale per slice along `dim` (kept as size 1)."""
    amax = w.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if q.dtype != FP8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D {FP8} tensor, got {q.dtype} {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        # _scaled_mm takes the weight column-major: store q.T's storage as [K, N] with strides (1, K).
        self.register_buffer("weight_t", q.contiguous().t())
        self.register_buffer("scale", scale.reshape(1, -1).float().contiguous())  # (1, N)
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))
        self.out_dtype = out_dtype
        self.use_op = self.in_features % 16 == 0 and self.out_features % 16 == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_fp8(linear.weight, dim=1)
        return cls(q, scale[:, 0], linear.bias, linear.weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight_t.t().float() * self.scale.t()  # (N, K)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and ACT_QUANT == "triton" and x2.stride(-1) == 1:
            from worker.kernels.triton_quant import quantize_rows_fp8

            xq, x_scale = quantize_rows_fp8(x2)  # one kernel, the same values as quantize_fp8
        else:
            xq, x_scale = quantize_fp8(x2, dim=1)  # (M, K), (M, 1)
        return xq, x_scale, lead

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_op:
            return self.forward_reference(x)
        xq, x_scale, lead = self._quantize_input(x)
        out = torch._scaled_mm(
            xq, self.weight_t, scale_a=x_scale, scale_b=self.scale, bias=self.bias, out_dtype=self.out_dtype
        )
        return out.reshape(*lead, self.out_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The op's formula in float32 over the dequantized operands (slow reference)."""
        xq, x_scale, lead = self._quantize_input(x)
        out = (xq.float() * x_scale) @ self.dequantize().t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 W8A8"


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(
            f"--quantization fp8 needs compute capability >= 8.9 (Ada/Hopper); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}"
        )


def quantize_model_fp8(model: nn.Module) -> int:
    """Swap the decoder layers' nn.Linear modules for Fp8Linear (in place); returns the count."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("quantize_model_fp8 expects a LlamaModel (with .layers)")
    count = 0
    for layer in layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    check_fp8_device(child.weight.device)
                    with torch.no_grad():
                        setattr(parent, name, Fp8Linear.from_linear(child))
                    count += 1
    return count
