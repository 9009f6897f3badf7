"""FP8 linear layers (`--quantization fp8`): float8_e4m3fn weights with per-output-channel scales;
W8A8 through `torch._scaled_mm` (activations quantized per token at run time), and at decode
(<= 16 rows, where timing says it wins) W8A16 through the Triton GEMV: bf16 activations against
the fp8 weight widened in registers, no activation quantization.

Contract:
- `quantize_fp8(w [N, K]) -> (q float8_e4m3fn [N, K], scale float32 [N])`: symmetric per output
  channel, `scale = max|w[n]| / 448` (448 = the largest e4m3 value), `q = round(w / scale)`
  saturated; an all-zero row gets scale 1.
- `Fp8Linear(q, scale, bias=None, out_dtype=bfloat16)`: `forward(x [..., K]) -> [..., N]` in
  out_dtype, by one of two paths:
  - W8A8 (`forward_w8a8`; every input unless the GEMV is enabled for its row count): x is
    quantized per row the same way (`x_scale [M, 1]`; on CUDA by one Triton kernel,
    worker/kernels/triton_quant.py, unless `ACT_QUANT = "torch"`), then
    `_scaled_mm(xq, q.T, scale_a=x_scale, scale_b=scale[None, :], out_dtype)` computes
    `(xq * x_scale) @ (q * scale).T` with float32 accumulation. `forward_reference(x)` is that
    same formula in float32 over the dequantized operands (the slow reference it is tested
    against); `dequantize() -> float32 [N, K]`.
  - W8A16 (the GEMV, worker/kernels/triton_gemv.py): for x of M rows, 1 <= M <= gemv_max_rows,
    whose row bucket (1, 2, 4, 8, 16) has a config in `gemv_configs`, x in out_dtype with a
    contiguous last dim: `(x @ q.float().T) * scale + bias`, float32 accumulation, one rounding to
    out_dtype. The numerics differ from W8A8: x is not rounded to fp8 (3 mantissa bits), so decode
    steps are more accurate than the prefill of the same tokens; greedy tokens can differ from
    a pure W8A8 run. `gemv_calls` / `w8a8_calls` count the Python calls per path (graph replays
    run no Python).
- `quantize_model_fp8(model) -> int`: swaps every `nn.Linear` inside the decoder layers (q|k|v,
  o_proj, gate|up, down_proj) for an Fp8Linear (W8A8 everywhere), in place, and returns how many;
  the embedding, the lm_head and the norms stay in the model dtype. Layers already converted are
  left alone.
- `use_fp8_gemv(model, max_rows=16, force=False) -> int`: enables the GEMV in each Fp8Linear of
  the model, per row bucket up to max_rows's, where it was faster: on CUDA, per distinct (N, K,
  out dtype) and bucket it takes the GEMV's best config (`gemv_tuning.best_config` with the fp8
  weight dtype, timed once per process) and times the W8A8 path (quantizer + `_scaled_mm`) the
  same way (`gemv_tuning.time_us`: random weights cycled through more than the L2, CUDA-graph
  replay, median; cached per key in `W8A8_TIMES`); a bucket uses the GEMV when it was faster. Every
  enabled config is launched once here (compiles, split-K scratch), so call it before CUDA-graph
  capture, and before the KV pool is sized (the timing's weight copies are freed, then
  `torch.cuda.empty_cache`). Returns how many modules use the GEMV in at least one bucket; the
  times go to one log line per shape and to `model.fp8_gemv_report` (n, k, dtype, rows, modules,
  config, gemv_us, w8a8_us, use). `force=True`: the default config in every bucket without timing
  (also on CPU, where the kernel is interpreted: how the tests run it); without force, modules off
  CUDA are left alone, and so are modules with float32 activations (the kernel takes them, but its
  fp32 tl.dot configs spill registers on sm_90). Modules an earlier call enabled are left alone
  (so a model the tests or benchmarks forced keeps the kernel through the runner's timed call);
  the others are decided again (timings cached).
- Where it runs: torch._scaled_mm on CUDA needs compute capability >= 8.9 (Ada, Hopper); torch
  2.13's CPU build runs it too (that is how tests/test_fp8.py checks it without a GPU). Shapes the
  op refuses (K or N not a multiple of 16) fall back to the reference formula (or the GEMV).
- Fails how: `quantize_model_fp8` raises RuntimeError on a CUDA device below 8.9; `use_fp8_gemv`
  raises ValueError when max_rows is outside 1..16.
- Proven by tests/test_fp8.py (op == reference formula, quantization error bounds, a model's
  greedy tokens with fp8 weights vs bf16 on CPU; the GEMV path forced: logits vs bf16 and no worse
  than W8A8's, fallbacks counted) and tests/test_gemv.py (the fp8 GEMV kernel); the accuracy on a
  real checkpoint (logit error, greedy agreement) by the GPU session (benchmarks/gpu_fp8.py), the
  GEMV vs W8A8 timing by benchmarks/gpu_gemv.py.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Activation quantization on CUDA: "triton" = one kernel per call (worker/kernels/triton_quant.py),
# "torch" = quantize_fp8's ~6 kernels (the benchmark times both).
ACT_QUANT = "triton"
GEMV_MAX_ROWS = 16  # worker/kernels/triton_gemv.py MAX_ROWS (not imported here: triton stays lazy)
# gemv_tuning.tuning_key(bucket, N, K, dtype, device, FP8) -> us per call of the W8A8 path
W8A8_TIMES: dict[tuple, float] = {}


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
        self.gemv_max_rows = 0  # use_fp8_gemv sets these: rows up to this, buckets in configs
        self.gemv_configs: dict = {}  # row bucket -> triton_gemv.GemvConfig
        self.gemv_calls = 0
        self.w8a8_calls = 0

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
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        config = self.gemv_configs.get(1 << (m - 1).bit_length()) if 1 <= m <= self.gemv_max_rows else None
        if config is not None and x2.dtype == self.out_dtype and x2.stride(-1) == 1:
            from worker.kernels.triton_gemv import gemv

            self.gemv_calls += 1
            out = gemv(x2, self.weight_t.t(), self.bias, config=config, scale=self.scale.view(-1))
            return out.reshape(*x.shape[:-1], self.out_features)
        self.w8a8_calls += 1
        return self.forward_w8a8(x)

    def forward_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Activations quantized per row, then `_scaled_mm` (the reference formula for shapes it
        refuses)."""
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
        text = f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 W8A8"
        if self.gemv_configs:
            buckets = ", ".join(f"{b}: {c}" for b, c in sorted(self.gemv_configs.items()))
            text += f", W8A16 triton gemv up to {self.gemv_max_rows} rows {{{buckets}}}"
        return text


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


def w8a8_time_us(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> float:
    """us per call of Fp8Linear's W8A8 path (quantizer + _scaled_mm) for `rows` rows of an [N, K]
    weight, timed as the GEMV's candidates are (gemv_tuning.time_us over weight copies that exceed
    the L2 cache); cached per key on CUDA."""
    from worker.kernels import gemv_tuning

    key = gemv_tuning.tuning_key(rows, n, k, dtype, device, FP8)
    if key in W8A8_TIMES:
        return W8A8_TIMES[key]
    copies = gemv_tuning.weight_copies(n, k, FP8, key[-1])
    scale = gemv_tuning.weight_scale(n, k, key[-1])
    layers = [Fp8Linear(q, scale, None, dtype) for q in copies]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device=key[-1], dtype=dtype)
    us = gemv_tuning.time_us([lambda f=f: f.forward_w8a8(x) for f in layers], key[-1])
    del copies, layers
    if key[-1].type == "cuda":
        W8A8_TIMES[key] = us
        torch.cuda.empty_cache()
    return us


@torch.no_grad()
def use_fp8_gemv(model: nn.Module, max_rows: int = GEMV_MAX_ROWS, force: bool = False) -> int:
    """Enable the W8A16 GEMV in the model's Fp8Linear modules where it is faster (see the module
    docstring); returns how many modules use it in at least one row bucket."""
    if not 1 <= max_rows <= GEMV_MAX_ROWS:
        raise ValueError(f"max_rows must be in 1..{GEMV_MAX_ROWS}, got {max_rows}")
    from worker.kernels.gemv_tuning import choose_buckets
    from worker.kernels.triton_gemv import gemv, row_bucket

    buckets = sorted({row_bucket(m) for m in range(1, max_rows + 1)})
    groups: dict[tuple, list[Fp8Linear]] = {}
    for module in model.modules():
        if not isinstance(module, Fp8Linear) or module.out_dtype not in (torch.bfloat16, torch.float16):
            continue  # float32 activations: the kernel's fp32 tl.dot spills registers (sm_90)
        if module.gemv_configs:
            continue  # enabled by an earlier call (forced or timed): kept, as use_triton_gemv keeps its swaps
        if force or module.weight_t.device.type == "cuda":
            key = (module.out_features, module.in_features, module.out_dtype, module.weight_t.device)
            groups.setdefault(key, []).append(module)
    report, enabled = [], 0
    for (n, k, dtype, device), members in groups.items():
        w8a8_us = lambda bucket: w8a8_time_us(bucket, n, k, dtype, device)  # noqa: B023, E731 - called at once
        configs, rows, notes = choose_buckets(n, k, dtype, device, buckets, ("w8a8", w8a8_us), force, FP8)
        shape = dict(n=n, k=k, dtype=str(dtype).removeprefix("torch."), modules=len(members))
        report += [shape | row for row in rows]
        if notes:
            text = "; ".join(notes)
            log.info("fp8 gemv %dx%d, %d modules, W8A16 gemv vs W8A8: %s", n, k, len(members), text)
        for module in members:
            module.gemv_configs, module.gemv_max_rows = dict(configs), max_rows
            for bucket, config in configs.items():  # compile, allocate split-K scratch: before capture
                x = torch.zeros(bucket, k, dtype=dtype, device=device)
                gemv(x, module.weight_t.t(), module.bias, config=config, scale=module.scale.view(-1))
        enabled += len(members) if configs else 0
    if groups:
        model.fp8_gemv_report = report
    if any(device.type == "cuda" for _, _, _, device in groups):
        torch.cuda.empty_cache()
    return enabled
