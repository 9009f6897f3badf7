"""The Triton kernels compile for real GPUs (sm_80, sm_90) on this CPU-only machine.

tests/test_kernels.py checks what the kernels compute under the interpreter; this checks what the
interpreter cannot: that each launcher's specializations lower through Triton's GPU compiler and
ptxas, without register spills, with tensor cores for 16-bit attention and without tf32 for fp32.
The compile runs in a subprocess because this pytest process has TRITON_INTERPRET=1 (conftest.py),
and kernels imported under it are interpreter objects that cannot be compiled.
"""

import json
import os
import subprocess
import sys

import pytest

from worker.kernels import compile_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = {
    "paged_attention_kernel",
    "merge_splits_kernel",
    "store_kv_kernel",
    "rms_norm_kernel",
    "silu_mul_kernel",
    "rope_kernel",
    "rope_kv_kernel",
    "argmax_chunk_kernel",
    "argmax_reduce_kernel",
}
FP8_KERNELS = {"fp8_gemm_kernel"}  # compiled for sm_89 and newer only (fp8 needs Ada / Hopper)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker.kernels.compile_check",
            "--quick",
            "--targets",
            "sm_80",
            "sm_90",
            "--json",
            str(tmp / "out.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "register spills: 0" in proc.stdout
    with open(tmp / "out.json") as f:
        return json.load(f)["results"]


def attention(results, target, case):
    [r] = [
        r
        for r in results
        if r["target"] == target and r["case"] == case and r["kernel"] == "paged_attention_kernel"
    ]
    return r


def test_every_kernel_compiles_for_each_target(compiled):
    for target in ("sm_80", "sm_90"):
        want = KERNELS | (FP8_KERNELS if target == "sm_90" else set())
        assert {r["kernel"] for r in compiled if r["target"] == target} == want
        splits = {
            r["constexprs"]["SPLIT_KV"]
            for r in compiled
            if r["target"] == target and r["kernel"] == "paged_attention_kernel"
        }
        assert splits == {True, False}
    # CPU tensors, compiled (not interpreted): the launcher must pick the GPU variant.
    attention_rows = [r for r in compiled if r["kernel"] == "paged_attention_kernel"]
    assert attention_rows and all(r["constexprs"]["UPCAST"] is False for r in attention_rows)


def test_no_register_spills_and_shared_memory_fits(compiled):
    # Pinned to the venv's triton (requirements-dev.txt); triton 3.6 spills 4 B in two sm_80 fp32
    # decode kernels (docs/kernels.md).
    for r in compiled:
        assert r["spill_bytes"] == 0, r
        cap = int(r["target"].removeprefix("sm_"))
        assert r["shared_bytes"] <= compile_check.SHARED_LIMIT[cap], r


def test_half_precision_attention_uses_tensor_cores_and_fp32_does_not_use_tf32(compiled):
    for target in ("sm_80", "sm_90"):
        for mode in ("decode", "split", "prefill"):
            bf16 = attention(compiled, target, f"smollm2-135m bf16 {mode}")
            assert bf16["tensor_cores"] in ("mma", "wgmma"), bf16
            fp32 = attention(compiled, target, f"mha-d128 fp32 {mode}")
            assert not fp32["tf32"], fp32
    assert not any(r["tf32"] for r in compiled)


def test_fp8_gemm_uses_tensor_cores_on_sm_90(compiled):
    # --quick: a 64-row decode batch and a 512-row prefill (bf16 x, groups of 128), two configs.
    rows = [r for r in compiled if r["kernel"] == "fp8_gemm_kernel"]
    assert {r["constexprs"]["BLOCK_M"] for r in rows} == {64, 128}
    assert all(r["target"] == "sm_90" and r["tensor_cores"] in ("wgmma", "mma") for r in rows), rows


def test_fp32_head_dim_128_prefill_takes_the_spill_free_tile(compiled):
    # 64-row fp32 tiles at head_dim 128 spilled (up to 8.5 KB per thread): the launcher caps them.
    for target in ("sm_80", "sm_90"):
        r = attention(compiled, target, "mha-d128 fp32 prefill")
        assert r["constexprs"]["BLOCK_M"] == 32 and r["num_warps"] == 8, r
        assert attention(compiled, target, "smollm2-135m bf16 prefill")["constexprs"]["BLOCK_M"] == 64


def test_ptxas_log_parsing():
    log = (
        "ptxas info    : Function properties for k\n    8 bytes stack frame, 24 bytes spill "
        "stores, 16 bytes spill loads\nptxas info    : Used 255 registers"
    )
    assert compile_check._spill_bytes(log) == 40
    assert compile_check._spill_bytes(log.replace("24", "0").replace("16", "0")) == 0


def test_tensor_core_detection():
    assert compile_check._tensor_core_use("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == (
        "wgmma",
        False,
    )
    assert compile_check._tensor_core_use("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == (
        "mma",
        True,
    )
    assert compile_check._tensor_core_use("fma.rn.f32 %f1, %f2, %f3, %f4;") == ("none", False)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="this process compiles its kernels (CUDA present): nothing to refuse",
)
def test_refuses_interpreted_kernels_and_bad_targets():
    # This process imported the kernels under TRITON_INTERPRET=1 (tests/conftest.py).
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_check.capture_launches(compile_check.parse_target("sm_90"), [""], [], set()).__enter__()
    with pytest.raises(SystemExit):
        compile_check.main(["--quick"])
    with pytest.raises(ValueError, match="sm_90"):
        compile_check.parse_target("hopper")
