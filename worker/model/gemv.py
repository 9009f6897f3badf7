"""The Triton GEMV (worker/kernels/triton_gemv.py) in the decoder's linear layers (`--triton-gemv`).

Contract:
- `use_triton_gemv(model, max_rows=16, force=False) -> int`: swaps, in place, each `nn.Linear`
  (exactly that type) inside `model.layers` (q|k|v, o_proj, gate|up, down_proj) whose weight is
  bfloat16 or float16 for a `GemvLinear` holding the same weight and bias Parameters, and returns
  how many it swapped. On CUDA, per distinct (N, K, dtype) and per row bucket (1, 2, 4, 8, 16, up
  to the bucket of max_rows) it takes the kernel's best config (`best_config`, timed once per
  process on random weights cycled through more than the L2 cache, CUDA-graph replay, median) and
  compares it with F.linear timed the same way (`tuning_times`); a module is swapped when the
  kernel won in at least one bucket, and uses it only in the buckets where it won. The measured
  times go to one log line per shape and to `model.triton_gemv_report` (a list of dicts: n, k,
  dtype, rows, modules, config, gemv_us, linear_us, use). Every config a swapped module may run is
  launched once here, so compilation and split-K scratch allocation happen before CUDA-graph
  capture. `force=True` skips the timing: the default config in every bucket (also on CPU, where
  the kernel runs in the Triton interpreter: that is how the tests run the model through it).
  Without force, weights off CUDA are left alone (on CPU the call returns 0).
- Left alone: int4/int8/fp8 modules (worker/model/quant.py, worker/model/fp8.py: not nn.Linear),
  float32 linears, modules already swapped (a second call returns 0), and the lm_head / tied
  embedding: cuBLAS already reads the 128k-row head at ~93% of bandwidth (the H200 profile in
  docs/gpu/hot-path.md) and the candidates are sized for the decoder's projections.
- `GemvLinear.forward(x [..., K]) -> [..., N]`: x as [M, K] rows; `gemv` when 1 <= M <= max_rows,
  the bucket of M uses the kernel, x has the weight's dtype and a contiguous last dim; otherwise
  `F.linear`. `gemv_calls` / `linear_calls` count the Python calls that took each path (a graph
  replay runs no Python, so it counts nothing).
- Fails how: ValueError when max_rows is outside 1..16.
- Proven by tests/test_gemv.py (forced on CPU: model logits with and without the pass, both
  paths taken, quantized modules untouched); the timing decision only on a GPU.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from worker.kernels import gemv_tuning, triton_gemv
from worker.kernels.triton_gemv import GemvConfig, gemv, row_bucket

log = logging.getLogger(__name__)
HALF_DTYPES = (torch.bfloat16, torch.float16)


class GemvLinear(nn.Module):
    """A dense linear layer that runs the Triton GEMV for the row buckets in `configs`."""

    def __init__(self, linear: nn.Linear, max_rows: int, configs: dict[int, GemvConfig]):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape
        self.max_rows = max_rows
        self.configs = dict(configs)  # row bucket -> config; a bucket missing here uses F.linear
        self.gemv_calls = 0
        self.linear_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        config = self.configs.get(row_bucket(m)) if 1 <= m <= self.max_rows else None
        if config is None or x2.dtype != self.weight.dtype or x2.stride(-1) != 1:
            self.linear_calls += 1
            return F.linear(x, self.weight, self.bias)
        self.gemv_calls += 1
        return gemv(x2, self.weight, self.bias, config=config).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        buckets = ", ".join(f"{b}: {c}" for b, c in sorted(self.configs.items()))
        return f"in_features={self.in_features}, out_features={self.out_features}, triton gemv {{{buckets}}}"


def _targets(model: nn.Module, force: bool) -> list[tuple[nn.Module, str, nn.Linear]]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("use_triton_gemv expects a LlamaModel (with .layers)")
    found = []
    for layer in layers:
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is not nn.Linear or child.weight.dtype not in HALF_DTYPES:
                    continue
                if force or child.weight.device.type == "cuda":
                    found.append((parent, name, child))
    return found


def _warm(linear: nn.Linear, configs: dict[int, GemvConfig]) -> None:
    """One launch of every config (compiles it, allocates its split-K scratch) before capture."""
    w = linear.weight
    for bucket, config in configs.items():
        x = torch.zeros(bucket, w.shape[1], dtype=w.dtype, device=w.device)
        gemv(x, w, linear.bias, config=config)


@torch.no_grad()
def use_triton_gemv(model: nn.Module, max_rows: int = triton_gemv.MAX_ROWS, force: bool = False) -> int:
    if not 1 <= max_rows <= triton_gemv.MAX_ROWS:
        raise ValueError(f"max_rows must be in 1..{triton_gemv.MAX_ROWS}, got {max_rows}")
    buckets = sorted({row_bucket(m) for m in range(1, max_rows + 1)})
    groups: dict[tuple, list[tuple[nn.Module, str, nn.Linear]]] = {}
    for target in _targets(model, force):
        w = target[2].weight
        groups.setdefault((w.shape[0], w.shape[1], w.dtype, w.device), []).append(target)
    report = []
    swapped = 0
    for (n, k, dtype, device), members in groups.items():
        # F.linear is timed with the GEMV's candidates (tuning_times), called at once: no late binding.
        linear_us = lambda bucket: gemv_tuning.tuning_times(bucket, n, k, dtype, device)["F.linear"]  # noqa: B023, E731
        configs, rows, notes = gemv_tuning.choose_buckets(
            n, k, dtype, device, buckets, ("linear", linear_us), force
        )
        shape = dict(n=n, k=k, dtype=str(dtype).removeprefix("torch."), modules=len(members))
        report += [shape | row for row in rows]
        if notes:
            log.info(
                "triton gemv %dx%d %s, %d modules, gemv vs F.linear: %s",
                n,
                k,
                dtype,
                len(members),
                "; ".join(notes),
            )
        if not configs:
            continue
        for parent, name, linear in members:
            _warm(linear, configs)
            setattr(parent, name, GemvLinear(linear, max_rows, configs))
            swapped += 1
    if groups:
        model.triton_gemv_report = report
    if any(device.type == "cuda" for _, _, _, device in groups):
        torch.cuda.empty_cache()  # the timing's temporary weights: keep them out of the KV budget
    return swapped
