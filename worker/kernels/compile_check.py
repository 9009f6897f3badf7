"""Compile the Triton kernels for a named NVIDIA GPU on a machine without one (`make check-triton`).

The interpreter (`TRITON_INTERPRET=1`, what tests/test_kernels.py runs on CPU) checks what the
kernels compute but never lowers them: an op the GPU compiler rejects, a tile that spills
registers, a `tl.dot` that misses the tensor cores or an fp32 dot that silently drops to tf32 all
pass it. This module runs each launcher (`paged_attention`, `store_kv`, `rms_norm`, `silu_and_mul`,
`rotary_embedding`, `rope_store_kv`, the two-pass greedy `argmax`; for sm_89 and newer the W8A16
`fp8_gemm`; without `--quick` also `fused_sample`) on small CPU tensors with
`JITFunction.run` replaced: instead of launching, it specializes the call exactly as Triton's JIT
does on a GPU (argument types, constexprs, 16-byte divisibility of pointers and ints) and compiles
it with the Triton wheel's own LLVM and `ptxas` for the requested target (default sm_80 and sm_90:
A100, H100/H200). Nothing runs on a device.

Contract:
- Input: targets (`sm_80`, `sm_90`, ...), the cases (`MODELS` head layouts x `DTYPES` x `MODES`:
  decode / split-KV decode / prefill; `--quick` keeps SmolLM2 in bf16 and head_dim-128 MHA in
  fp32).
- Output: one `CompiledLaunch` per distinct specialization: registers per thread, spilled bytes
  (ptxas -v: spill stores + loads), stack frame, dynamic shared memory, warps, the tensor-core
  instruction the PTX uses (`wgmma`, `mma`, or none), whether an fp32 dot used tf32, compile
  seconds. `main` prints a
  table and can write JSON.
- State: inside `capture_launches` only: `triton.runtime.jit.JITFunction.run` is patched and
  Triton's cache is a fresh temporary directory (a cached kernel would come back without the
  ptxas log that reports spills).
- Fails how: RuntimeError if the kernels were imported under TRITON_INTERPRET=1 (they are then
  interpreter objects that cannot be compiled); a kernel the compiler rejects raises its error.
- Proven by: tests/test_triton_compile.py (runs `--quick` in a subprocess without the interpreter
  and asserts: every kernel compiles, none spills, 16-bit attention uses tensor cores, fp32
  attention does not use tf32).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime import jit as triton_jit

from worker.kernels import (
    triton_argmax,
    triton_attention,
    triton_attention_kernels,
    triton_norm,
    triton_rope_kv,
    triton_store_kv,
)

# name: (num_heads, num_kv_heads, head_dim, hidden_size); GQA ratios 3, 4, 4 and 1.
MODELS = {
    "smollm2-135m": (9, 3, 64, 576),
    "llama-3.2-1b": (32, 8, 64, 2048),
    "llama-3-8b": (32, 8, 128, 4096),
    "mha-d128": (16, 16, 128, 2048),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("decode", "split", "prefill")
BLOCK_SIZE = 16
# Largest dynamic shared memory one block may use (bytes), per compute capability.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64}


@dataclasses.dataclass
class CompiledLaunch:
    target: str
    kernel: str
    case: str
    constexprs: dict
    registers: int
    spill_bytes: int  # ptxas -v: spill stores + spill loads
    stack_bytes: int  # per-thread stack frame (spills, or locals ptxas keeps there)
    shared_bytes: int
    num_warps: int
    tensor_cores: str  # "wgmma", "mma" or "none"
    tf32: bool  # an mma on tf32 operands appears in the PTX
    compile_s: float

    def resident_warps(self, capability: int) -> int:
        """Warps one SM can hold, limited by registers, shared memory and the hardware cap."""
        regs = -(-max(self.registers, 1) // 8) * 8  # allocated per warp in units of 256
        blocks = REGISTERS_PER_SM // (regs * 32 * self.num_warps)
        if self.shared_bytes:
            blocks = min(blocks, SHARED_LIMIT.get(capability, 99 * 1024) // self.shared_bytes)
        return min(blocks * self.num_warps, MAX_WARPS_PER_SM.get(capability, 48))


def parse_target(name: str) -> GPUTarget:
    match = re.fullmatch(r"sm_?(\d+)", name)
    if not match:
        raise ValueError(f"target must look like sm_90, got {name!r}")
    return GPUTarget("cuda", int(match.group(1)), 32)


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's one kernel, read by the wheel's cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _spill_bytes(ptxas_log: str) -> int:
    """Spill stores + loads from ptxas -v ("N bytes spill stores, M bytes spill loads")."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))


def _tensor_core_use(ptx: str) -> tuple[str, bool]:
    kind = "wgmma" if "wgmma.mma_async" in ptx else "mma" if re.search(r"\bmma\.sync", ptx) else "none"
    tf32 = bool(re.search(r"mma[.\w]*\.tf32", ptx))
    return kind, tf32


@contextlib.contextmanager
def capture_launches(target: GPUTarget, case: list[str], out: list[CompiledLaunch], seen: set):
    """Within the block, `kernel[grid](...)` compiles for `target` instead of launching.

    `case[0]` labels the launches; a specialization already in `seen` is not compiled again.
    """
    kernels = (triton_attention_kernels._paged_attention_kernel, triton_store_kv._store_kv_kernel)
    if not all(isinstance(k, triton_jit.JITFunction) for k in kernels):
        raise RuntimeError(
            "the Triton kernels were imported under TRITON_INTERPRET=1; run this in a process without it"
        )
    backend = make_backend(target)
    original = triton_jit.JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        # The binder and _pack_args are what JITFunction.run uses to specialize a launch.
        kwargs["debug"] = kwargs.get("debug", self.debug) or triton.knobs.runtime.debug
        binder = triton_jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound_args, specialization, options
        )
        key = (target.arch, self.__name__, repr(signature), repr(constexprs), repr(attrs), repr(options))
        if key in seen:
            return None
        seen.add(key)
        start = time.perf_counter()
        log = io.StringIO()
        # Triton runs ptxas -v and prints its log (registers, stack, spills) only with this knob.
        with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True
            compiled = triton_compile(
                ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__
            )
        elapsed = time.perf_counter() - start
        if "bytes spill" not in log.getvalue():
            raise RuntimeError(f"no ptxas -v log for {self.__name__}: {log.getvalue()[:200]!r}")
        usage = _resource_usage(compiled.asm["cubin"])
        cores, tf32 = _tensor_core_use(compiled.asm["ptx"])
        names = [p.name for p in self.params]
        named = {names[path[0]]: value for path, value in constexprs.items() if names[path[0]].isupper()}
        pointer_types = sorted({t for t in signature.values() if t.startswith("*")})
        named["dtypes"] = ",".join(pointer_types)
        out.append(
            CompiledLaunch(
                target=f"sm_{target.arch}",
                kernel=self.__name__.lstrip("_"),
                case=case[0],
                constexprs=named,
                registers=usage.get("REG", 0),
                spill_bytes=_spill_bytes(log.getvalue()),
                stack_bytes=usage.get("STACK", 0),
                shared_bytes=compiled.metadata.shared,
                num_warps=compiled.metadata.num_warps,
                tensor_cores=cores,
                tf32=tf32,
                compile_s=elapsed,
            )
        )
        return None

    # A fresh cache: a cached kernel comes back without the ptxas log that reports spills.
    with tempfile.TemporaryDirectory(prefix="triton-compile-check-") as cache_dir, triton.knobs.cache.scope():
        triton.knobs.cache.dir = cache_dir
        triton_jit.JITFunction.run = compile_instead
        try:
            yield
        finally:
            triton_jit.JITFunction.run = original


def _attention_batch(model: str, dtype: torch.dtype, mode: str) -> tuple[dict, dict]:
    """Small CPU tensors shaped like `model`'s layer, and the launcher's keyword arguments."""
    num_heads, num_kv_heads, head_dim, _ = MODELS[model]
    # Decode: 8 sequences of one new token; prefill: a 512-token chunk after 100 cached tokens
    # next to two decodes (a mixed batch, as the scheduler builds).
    query_lens = [1] * 8 if mode != "prefill" else [512, 1, 1]
    seq_lens = [300 + 7 * i for i in range(len(query_lens))] if mode != "prefill" else [612, 40, 900]
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_seqs = len(query_lens)
    num_tokens = sum(query_lens)
    # q as the model produces it: a view of the fused qkv projection (row stride > H * D).
    qkv = torch.zeros(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    cache = torch.zeros(num_seqs * blocks_per_seq, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    batch = dict(
        q=q,
        k_cache=cache,
        v_cache=cache.clone(),
        block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        scale=head_dim**-0.5,
    )
    extra = dict(
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_splits=8 if mode == "split" else 1
    )
    return batch, extra


def _launch_all(model: str, dtype_name: str, modes, case: list[str]) -> None:
    """Call every launcher the worker uses for `model` in `dtype_name` (compiled, not run)."""
    dtype = DTYPES[dtype_name]
    num_heads, num_kv_heads, head_dim, hidden = MODELS[model]
    for mode in modes:
        case[0] = f"{model} {dtype_name} {mode}"
        batch, extra = _attention_batch(model, dtype, mode)
        triton_attention.paged_attention(**batch, **extra)
    case[0] = f"{model} {dtype_name} store_kv"
    tokens = 4
    kv = torch.zeros(tokens, 2, num_kv_heads, head_dim, dtype=dtype)  # k and v from one tensor
    cache = torch.zeros(8, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    triton_store_kv.store_kv(
        kv[:, 0], kv[:, 1], cache, cache.clone(), torch.arange(tokens, dtype=torch.int64)
    )
    case[0] = f"{model} {dtype_name} rms_norm"
    x = torch.zeros(tokens, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    triton_norm.rms_norm(x, weight, 1e-5)
    triton_norm.rms_norm(x, weight, 1e-5, residual=x.clone())
    case[0] = f"{model} {dtype_name} silu_and_mul"
    triton_norm.silu_and_mul(torch.zeros(tokens, 8 * hidden, dtype=dtype))
    case[0] = f"{model} {dtype_name} rope"
    cos = torch.zeros(64, head_dim // 2, dtype=torch.float32)
    triton_norm.rotary_embedding(
        torch.arange(tokens),
        torch.zeros(tokens, num_heads, head_dim, dtype=dtype),
        torch.zeros(tokens, num_kv_heads, head_dim, dtype=dtype),
        cos,
        cos.clone(),
    )
    case[0] = f"{model} {dtype_name} rope_store_kv"
    qkv = torch.zeros(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)  # as the model
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    triton_rope_kv.rope_store_kv(
        torch.arange(tokens),
        q.view(tokens, num_heads, head_dim),
        k.view(tokens, num_kv_heads, head_dim),
        v.view(tokens, num_kv_heads, head_dim),
        cos,
        cos.clone(),
        cache,
        cache.clone(),
        torch.arange(tokens, dtype=torch.int64),
    )
    case[0] = f"{dtype_name} argmax"
    triton_argmax.argmax(torch.zeros(2, 128256, dtype=dtype))  # a Llama-3 vocabulary


def compile_all(targets: list[str], quick: bool = False, progress=None) -> list[CompiledLaunch]:
    """Compile every distinct specialization of the case list for each target."""
    plan = (
        [("smollm2-135m", "bf16"), ("mha-d128", "fp32")]
        if quick
        else [(m, d) for m in MODELS for d in DTYPES]
    )
    results: list[CompiledLaunch] = []
    seen: set = set()
    steps = [(t, m, d) for t in targets for m, d in plan]
    for i, (target_name, model, dtype_name) in enumerate(steps):
        if progress:
            progress(f"[{i + 1}/{len(steps)}] {target_name} {model} {dtype_name}")
        case = [""]
        with capture_launches(parse_target(target_name), case, results, seen):
            _launch_all(model, dtype_name, MODES, case)
            arch = parse_target(target_name).arch
            if arch >= 89:  # fp8 (e4m3) needs Ada / Hopper; `seen` skips the repeats
                _launch_fp8_gemm(case, quick)
            if not quick:
                _launch_sampling(dtype_name, case, 8 if arch >= 90 else 4)
    return results


def _launch_fp8_gemm(case: list[str], quick: bool) -> None:
    """worker/kernels/triton_fp8_gemm.py at SmolLM2's q|k|v (N 960, K 576) compiled: --quick 64 and 512
    rows in bf16 with groups of 128; else every row config, bf16 / fp16, per group and per row."""
    from worker.kernels import triton_fp8_gemm as g

    rows = (64, 512) if quick else [bound or 512 for bound, _ in g.CONFIGS]
    for dtype_name, group in [("bf16", 128)] if quick else [("bf16", 128), ("fp16", 128), ("bf16", 0)]:
        dtype, scale = DTYPES[dtype_name], torch.ones((960, 5) if group else (960,))
        for m in rows:
            case[0] = f"{dtype_name} fp8_gemm {m} rows group {group}"
            x, q = torch.zeros(m, 576, dtype=dtype), torch.zeros(960, 576, dtype=g.FP8)
            g.fp8_gemm(x, q, scale, torch.zeros(960, dtype=dtype), group)


def _launch_sampling(dtype_name: str, case: list[str], num_warps: int) -> None:
    """worker/kernels/triton_sampling.py over Llama-3-sized rows, with the engine's Philox noise and
    the target's warp count (`default_warps`), compiled (the model does not change it)."""
    from worker.kernels import triton_sampling

    case[0] = f"{dtype_name} fused_sample"
    f32, i64 = torch.ones(2, dtype=torch.float32), torch.zeros(2, dtype=torch.int64)  # two rows
    logits = torch.zeros(2, 128256, dtype=DTYPES[dtype_name])
    triton_sampling.fused_sample(logits, f32, i64, f32, f32 * 0, i64, i64, num_warps=num_warps)


def format_table(results: list[CompiledLaunch]) -> str:
    lines = [
        "| target | kernel | case | specialization | regs | spill B | stack B | shared KiB "
        "| warps | resident warps/SM | tensor cores | compile s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        spec = " ".join(
            f"{k}={v}"
            for k, v in r.constexprs.items()
            if k in ("GROUP", "BLOCK_M", "HEAD_DIM", "SPLIT_KV", "BLOCK_C", "HAS_RESIDUAL", "dtypes")
        )
        cores = r.tensor_cores + (" (tf32!)" if r.tf32 else "")
        cap = int(r.target.removeprefix("sm_"))
        lines.append(
            f"| {r.target} | {r.kernel} | {r.case} | {spec} | {r.registers} | "
            f"{r.spill_bytes} | {r.stack_bytes} | {r.shared_bytes / 1024:.1f} | {r.num_warps} | "
            f"{r.resident_warps(cap)} | {cores} | {r.compile_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["sm_80", "sm_90"])
    parser.add_argument(
        "--quick", action="store_true", help="two head layouts: SmolLM2 in bf16, head_dim 128 MHA in fp32"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--markdown", help="also write the table and summary to this file")
    args = parser.parse_args(argv)
    for name in args.targets:
        parse_target(name)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: unset it, the kernels must be compiled, not interpreted")
    start = time.perf_counter()
    results = compile_all(
        args.targets, args.quick, progress=lambda msg: print(msg, file=sys.stderr, flush=True)
    )
    spills = [r for r in results if r.spill_bytes]
    # Case labels are "model dtype mode"; 16-bit split-KV kernels also take fp32 scratch pointers.
    no_cores = [
        r
        for r in results
        if r.kernel == "paged_attention_kernel" and r.case.split()[1] != "fp32" and r.tensor_cores == "none"
    ]
    tf32 = [r for r in results if r.tf32]
    report = (
        f"{format_table(results)}\n\n{len(results)} specializations compiled for "
        f"{', '.join(args.targets)} in {time.perf_counter() - start:.1f} s (triton "
        f"{triton.__version__}); register spills: {len(spills)}; 16-bit attention without "
        f"tensor cores: {len(no_cores)}; fp32 dots on tf32: {len(tf32)}"
    )
    print(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report + "\n")
    if args.json:
        payload = dict(triton=triton.__version__, targets=args.targets, results=results)
        payload["results"] = [dataclasses.asdict(r) for r in results]
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if spills or no_cores or tf32 else 0


if __name__ == "__main__":
    sys.exit(main())
