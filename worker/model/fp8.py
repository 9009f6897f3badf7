"""FP8 linear layers (`--quantization fp8`): float8_e4m3fn weights with float32 scales, in two forms.
Per group (the default, `--fp8-group-size 128`): one scale per output channel and group of K
columns, activations stay bf16 (W8A16) on every path: the Triton GEMV at decode (<= 16 rows,
where timing says it wins), on CUDA the Triton fp8 GEMM otherwise (prefill, batches > 16), on CPU
the weight dequantized + F.linear. Per channel
(`--fp8-group-size 0`, the old form): one scale per output channel, W8A8 through
`torch._scaled_mm` (activations quantized per token at run time), the GEMV (W8A16) at decode.
Why per group and W8A16 (benchmarks/fp8_accuracy.py, docs/quantization.md "FP8"): on SmolLM2-135M
the per-channel W8A8 form had first-step relative logit error 0.20 (median) vs bf16 and 93%
teacher-forced top-1 agreement; not quantizing the activations and per-128-column weight scales
halve the first-step error (0.10) and give 96.5% (fp32 vs bf16: 0.018, 98.4%). e4m3's 3-bit
mantissa is the rest of the error: smaller groups or bf16 down_proj do not remove it.

Contract:
- `quantize_fp8(w [N, K], dim=-1, group_size=0) -> (q float8_e4m3fn [N, K], scale float32)`:
  symmetric, `scale = max|slice| / 448` (448 = the largest e4m3 value), `q = round(w / scale)`
  saturated, an all-zero slice gets scale 1; slices: along `dim` (scale [N, 1]), or with
  group_size > 0 each row's groups of that many columns (scale [N, cdiv(K, group_size)], the
  last group may be shorter).
- `Fp8Linear(q, scale, bias=None, out_dtype=bfloat16, group_size=0)`: `forward(x [..., K]) ->
  [..., N]` in out_dtype; scale [N] (per channel) or [N, cdiv(K, group_size)] (per group,
  group_size a power of two >= 16). `dequantize(dtype=float32) -> [N, K]` (float32 products, one
  rounding). Paths:
  - W8A16 GEMV (worker/kernels/triton_gemv.py, both forms): for x of M rows, 1 <= M <=
    gemv_max_rows, whose row bucket (1, 2, 4, 8, 16) has a config in `gemv_configs`, x in
    out_dtype with a contiguous last dim: `x @ dequantize().T + bias`, float32 accumulation, one
    rounding to out_dtype (per channel the scale is applied once at the end, per group to each
    group's float32 partial). `gemv_calls` counts it.
  - otherwise, per group, on CUDA with x in out_dtype (16-bit) and a contiguous last dim:
    `forward_gemm`, the W8A16 Triton GEMM (worker/kernels/triton_fp8_gemm.py: fp8 tiles widened
    in registers, each group's float32 partial scaled, one rounding; no dequantized copy), the
    GEMV's numerics for any row count; `gemm_calls` counts it.
  - otherwise, per group (CPU, where the interpreter is far too slow; float32 x): `forward_dense` =
    `F.linear(x, dequantize(out_dtype), bias)` (the same W8A16 numerics up to the weight's bf16
    rounding, 2^-9 relative, far below e4m3's 2^-4); `dense_calls` counts it. On a GPU it would
    write and read a bf16 copy per call (~2.5x bf16's weight traffic): the reference the GEMM is
    benchmarked against. `torch._scaled_mm`'s blockwise (1x128) scaling runs only on sm_90 with
    K a multiple of 128 (SmolLM2's 576 is not) and quantizes the activations (error 0.12 instead
    of 0.10 here), so it is not used.
  - otherwise, per channel: W8A8 (`forward_w8a8`; `w8a8_calls` counts it): x is quantized per row
    the same way (`x_scale [M, 1]`; on CUDA by one Triton kernel, worker/kernels/triton_quant.py,
    unless `ACT_QUANT = "torch"`), then `_scaled_mm(xq, q.T, scale_a=x_scale,
    scale_b=scale[None, :], out_dtype)` computes `(xq * x_scale) @ (q * scale).T` with float32
    accumulation; shapes the op refuses (K or N not a multiple of 16) take the reference formula.
    Decode steps through the GEMV are then more accurate than the prefill (x not rounded to e4m3),
    and greedy tokens can differ from a pure W8A8 run.
  - `forward_reference(x)`: the module's formula in float32 over the dequantized operands (W8A8
    per channel, W8A16 per group): the slow reference the paths are tested against.
  (graph replays run no Python, so the counters count eager calls and captures.)
- `quantize_model_fp8(model, group_size=GROUP_SIZE) -> int`: swaps every `nn.Linear` inside the
  decoder layers (q|k|v, o_proj, gate|up, down_proj) for an Fp8Linear of that form, in place, and
  returns how many; the embedding, the lm_head and the norms stay in the model dtype. Layers
  already converted are left alone.
- `use_fp8_gemv(model, max_rows=16, force=False) -> int`: enables the GEMV in each Fp8Linear of
  the model, per row bucket up to max_rows's, where it was faster: on CUDA, per distinct (N, K,
  out dtype, group size) and bucket it takes the GEMV's best config (`gemv_tuning.best_config`
  with the fp8 weight dtype and group size, timed once per process) and times the path it
  replaces (`forward_no_gemv`: W8A8 per channel, the GEMM per group on CUDA) the same way
  (`fallback_time_us`: `gemv_tuning.time_us`, random weights cycled through more than the L2,
  CUDA-graph replay, median; cached per key in `FALLBACK_TIMES`); a bucket uses the GEMV when it
  was faster. Every enabled config is launched once here (compiles, split-K scratch), and per
  grouped shape on CUDA each of the GEMM's configs (compiles before the first prefill), so call it
  before CUDA-graph capture, and before the KV pool is sized (the timing's weight copies are
  freed, then `torch.cuda.empty_cache`). Returns how many modules use the GEMV in at least one
  bucket; the times go to one log line per shape and to `model.fp8_gemv_report` (n, k, dtype,
  group_size, rows, modules, config, gemv_us, w8a8_us / gemm_us (dense_us off CUDA), use). `force=True`: the
  default config in every bucket without timing (also on CPU, where the kernel is interpreted:
  how the tests run it); without force, modules off CUDA are left alone, and so are modules with
  float32 activations (the kernel takes them, but its fp32 tl.dot configs spill registers on
  sm_90). Modules an earlier call enabled are left alone (so a model the tests or benchmarks
  forced keeps the kernel through the runner's timed call); the others are decided again.
- Where it runs: torch._scaled_mm on CUDA needs compute capability >= 8.9 (Ada, Hopper); torch
  2.13's CPU build runs it too (that is how tests/test_fp8.py checks it without a GPU).
- Fails how: `quantize_model_fp8` raises RuntimeError on a CUDA device below 8.9; Fp8Linear
  raises ValueError for a group_size that is not 0 or a power of two >= 16, or a scale of the
  wrong size; `use_fp8_gemv` raises ValueError when max_rows is outside 1..16.
- Proven by tests/test_fp8.py (both forms: paths == reference formula, quantization error
  bounds per channel and per group, a model's greedy tokens vs bf16 through the engine, the
  grouped form no worse than W8A8; the GEMV path forced: logits vs its formula, fallbacks
  counted), tests/test_gemv.py and tests/test_gemv_groups.py (the fp8 GEMV kernel, per channel
  and per group); the accuracy on the real checkpoint by benchmarks/fp8_accuracy.py (CPU) and
  the GPU session (benchmarks/gpu_fp8.py), the GEMV vs W8A8 timing by benchmarks/gpu_gemv.py;
  the GEMM kernel by tests/test_fp8_gemm.py (`forward_gemm` == reference, interpreted on CPU).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Activation quantization on CUDA: "triton" = one kernel per call (worker/kernels/triton_quant.py),
# "torch" = quantize_fp8's ~6 kernels (the benchmark times both).
ACT_QUANT = "triton"
GROUP_SIZE = 128  # the default scale group along K (--fp8-group-size; 0 = per output channel)
GEMV_MAX_ROWS = 16  # worker/kernels/triton_gemv.py MAX_ROWS (not imported here: triton stays lazy)
# gemv_tuning.tuning_key(bucket, N, K, dtype, device, FP8, group_size) -> us per call of the path
# the GEMV replaces (W8A8 per channel; per group the fp8 GEMM on CUDA, the only device cached)
FALLBACK_TIMES: dict[tuple, float] = {}


def quantize_fp8(w: torch.Tensor, dim: int = -1, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 quantization with one float32 scale per slice along `dim` (kept as size 1);
    `group_size` > 0 (w 2-D, along its last dim): one scale per row and group of that many columns,
    scale [N, cdiv(K, group_size)] (the last group may be shorter)."""
    if group_size:
        n, k = w.shape
        groups = -(-k // group_size)
        padded = torch.nn.functional.pad(w.detach().float(), (0, groups * group_size - k))
        amax = padded.abs().view(n, groups, group_size).amax(dim=2)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        full = scale.repeat_interleave(group_size, dim=1)[:, :k]
        return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
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
        group_size: int = 0,
    ):
        super().__init__()
        if q.dtype != FP8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D {FP8} tensor, got {q.dtype} {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        n, k = q.shape
        if group_size and (group_size < 16 or group_size & (group_size - 1)):
            raise ValueError(f"group_size must be 0 (per channel) or a power of two >= 16, got {group_size}")
        want = (n, -(-k // group_size)) if group_size else (n,)
        if scale.numel() != math.prod(want):
            raise ValueError(
                f"scale must hold {list(want)} values for group_size {group_size}, got {tuple(scale.shape)}"
            )
        self.group_size = group_size
        # _scaled_mm takes the weight column-major: store q.T's storage as [K, N] with strides (1, K).
        self.register_buffer("weight_t", q.contiguous().t())
        # (1, N) per channel (_scaled_mm's scale_b); (N, groups) per group (the GEMV's layout).
        self.register_buffer("scale", scale.reshape(want if group_size else (1, n)).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))
        self.out_dtype = out_dtype
        self.use_op = not group_size and k % 16 == 0 and n % 16 == 0
        self.gemv_max_rows = 0  # use_fp8_gemv sets these: rows up to this, buckets in configs
        self.gemv_configs: dict = {}  # row bucket -> triton_gemv.GemvConfig
        self.gemv_calls = 0
        self.w8a8_calls = 0
        self.dense_calls = 0
        self.gemm_calls = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 0) -> Fp8Linear:
        q, scale = quantize_fp8(linear.weight, dim=1, group_size=group_size)
        return cls(q, scale if group_size else scale[:, 0], linear.bias, linear.weight.dtype, group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) in dtype, computed in float32 and rounded once."""
        if not self.group_size:
            return (self.weight_t.t().float() * self.scale.t()).to(dtype)
        n, k = self.out_features, self.in_features
        if k % self.group_size == 0:
            w = self.weight_t.t().float().view(n, -1, self.group_size) * self.scale[:, :, None]
            return w.view(n, k).to(dtype)
        full = self.scale.repeat_interleave(self.group_size, dim=1)[:, :k]
        return (self.weight_t.t().float() * full).to(dtype)

    def gemv_scale(self) -> torch.Tensor:
        """The scale as the GEMV takes it: [N] per channel, [N, groups] per group."""
        return self.scale.view(-1) if not self.group_size else self.scale

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
            out = gemv(
                x2,
                self.weight_t.t(),
                self.bias,
                config=config,
                scale=self.gemv_scale(),
                group_size=self.group_size,
            )
            return out.reshape(*x.shape[:-1], self.out_features)
        return self.forward_no_gemv(x)

    def forward_no_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The path for rows the GEMV does not take (counted): per group the Triton GEMM on CUDA
        (16-bit x in out_dtype, contiguous last dim), else dequantize + F.linear; per channel W8A8."""
        if not self.group_size:
            self.w8a8_calls += 1
            return self.forward_w8a8(x)
        if x.is_cuda and x.dtype == self.out_dtype != torch.float32 and x.stride(-1) == 1:
            self.gemm_calls += 1
            return self.forward_gemm(x)
        self.dense_calls += 1
        return self.forward_dense(x)

    def forward_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """W8A16 for any row count through the Triton fp8 GEMM (per-group or per-row scales applied
        in the kernel, float32 accumulation, one rounding; no dequantized weight)."""
        from worker.kernels.triton_fp8_gemm import fp8_gemm

        x2 = x.reshape(-1, self.in_features)
        out = fp8_gemm(x2, self.weight_t.t(), self.gemv_scale(), self.bias, self.group_size)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """W8A16 for any row count: the weight dequantized to out_dtype (float32 products, one
        rounding), then F.linear on x in out_dtype (the prefill path of per-group scales)."""
        return F.linear(x.to(self.out_dtype), self.dequantize(self.out_dtype), self.bias)

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
        """The module's formula in float32 over the dequantized operands (slow reference): W8A8 per
        channel (activations quantized per row), W8A16 per group (x as it is)."""
        if self.group_size:
            out = x.reshape(-1, self.in_features).float() @ self.dequantize().t()
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)
        xq, x_scale, lead = self._quantize_input(x)
        out = (xq.float() * x_scale) @ self.dequantize().t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 "
        text += (
            f"W8A16, scale per {self.group_size} columns" if self.group_size else "W8A8, scale per channel"
        )
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


def quantize_model_fp8(model: nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Swap the decoder layers' nn.Linear modules for Fp8Linear (in place, scales per `group_size`
    columns, 0 = per channel); returns the count."""
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
                        setattr(parent, name, Fp8Linear.from_linear(child, group_size))
                    count += 1
    return count


def fallback_time_us(
    rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group_size: int = 0
) -> float:
    """us per call of the path the GEMV replaces for `rows` rows of an [N, K] weight
    (`forward_no_gemv`: W8A8 per channel; per group the GEMM on CUDA, dequantize + F.linear on CPU); timed
    as the GEMV's candidates are (gemv_tuning.time_us over weight copies that exceed the L2
    cache); cached per key on CUDA."""
    from worker.kernels import gemv_tuning

    key = gemv_tuning.tuning_key(rows, n, k, dtype, device, FP8, group_size)
    if key in FALLBACK_TIMES:
        return FALLBACK_TIMES[key]
    copies = gemv_tuning.weight_copies(n, k, FP8, key[-1])
    scale = gemv_tuning.weight_scale(n, k, key[-1], group_size=group_size)
    layers = [Fp8Linear(q, scale, None, dtype, group_size) for q in copies]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device=key[-1], dtype=dtype)
    us = gemv_tuning.time_us([lambda f=f: f.forward_no_gemv(x) for f in layers], key[-1])
    del copies, layers
    if key[-1].type == "cuda":
        FALLBACK_TIMES[key] = us
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
            key = (
                module.out_features,
                module.in_features,
                module.out_dtype,
                module.group_size,
                module.weight_t.device,
            )
            groups.setdefault(key, []).append(module)
    report, enabled = [], 0
    for (n, k, dtype, group, device), members in groups.items():
        base = ("gemm" if device.type == "cuda" else "dense") if group else "w8a8"  # what the GEMV replaces
        base_us = lambda bucket: fallback_time_us(bucket, n, k, dtype, device, group)  # noqa: B023, E731 - called at once
        configs, rows, notes = choose_buckets(
            n, k, dtype, device, buckets, (base, base_us), force, FP8, group
        )
        shape = dict(
            n=n, k=k, dtype=str(dtype).removeprefix("torch."), group_size=group, modules=len(members)
        )
        report += [shape | row for row in rows]
        if notes:
            text = "; ".join(notes)
            log.info("fp8 gemv %dx%d, %d modules, W8A16 gemv vs %s: %s", n, k, len(members), base, text)
        for module in members:
            module.gemv_configs, module.gemv_max_rows = dict(configs), max_rows
            for bucket, config in configs.items():  # compile, allocate split-K scratch: before capture
                x = torch.zeros(bucket, k, dtype=dtype, device=device)
                gemv(
                    x,
                    module.weight_t.t(),
                    module.bias,
                    config=config,
                    scale=module.gemv_scale(),
                    group_size=group,
                )
        if group and device.type == "cuda":  # each GEMM config compiled now, not in the first prefill
            from worker.kernels.triton_fp8_gemm import CONFIGS

            for bound, _ in CONFIGS:
                members[0].forward_gemm(torch.zeros(bound or 256, k, dtype=dtype, device=device))
        enabled += len(members) if configs else 0
    if groups:
        model.fp8_gemv_report = report
    if any(key[-1].type == "cuda" for key in groups):
        torch.cuda.empty_cache()
    return enabled
