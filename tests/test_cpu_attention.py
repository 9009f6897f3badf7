"""The "cpu" attention backend (worker/kernels/cpu_attention.{cpp,py}) against the float32 oracle.

What it proves:
- Numbers: the op equals worker/kernels/reference.py on the shared random batches
  (tests/attention_batches.py: ragged lengths, prefixes ending mid-block, GQA 1/3/8, head_dim 64
  and 128 plus odd sizes that take the generic path, blocks scattered over a shuffled pool, q a
  strided view), decode rows and prefill chunks with and without a cached prefix, batches of 1 and
  130, fp32 (1e-5), bf16 and fp16 (1e-2); the SDPA path for long chunks and the split-KV path of
  small decode batches; rows past seq_len poisoned with NaN never reach the output.
- Contract: bad arguments raise ValueError; torch.compile(fullgraph=True) traces a function that
  calls the op (its fake implementation) and matches eager; the backend seam writes then attends;
  "auto" on CPU picks "cpu", and falls back to "torch" with one warning when the build fails.
- Build: one OpenMP runtime in the process (torch's), at::parallel_for really uses the pool's
  threads, an AVX2-only build (-march=x86-64-v3) compiles and is correct, two processes building at
  once into a fresh cache both succeed, and a stale torch lock file there does not hang them.
- Engine: LLMEngine with attention_backend="cpu" gives the torch backend's greedy tokens.
"""

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.attention_batches import BATCHES, GQA, TOLERANCE, make_batch, rel_error
from tests.procs import REPO
from worker.attention import AttentionMetadata, get_attention_backend
from worker.kernels import cpu_attention, cpu_ext, reference

SERVING = [(n, 1) for n in (1, 15, 16, 17, 63, 200, 511)] + [(48, 20), (0, 37)]
PREFILL = [(0, 1), (0, 16), (0, 33), (5, 2), (40, 9), (31, 64), (0, 130), (100, 45)]


@pytest.fixture(scope="module", autouse=True)
def op():
    cpu_ext.load()


def check(batch, dtype=torch.float32, **kwargs):
    out = cpu_attention.paged_attention(**batch, **kwargs)
    assert out.dtype == batch["q"].dtype and out.shape == batch["q"].shape
    assert not out.isnan().any()
    err = rel_error(out, reference.paged_attention(**batch))
    assert err < TOLERANCE[dtype], err
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize("kind", list(BATCHES) + ["serving", "prefill_chunks"])
def test_matches_reference(kind, num_kv_heads, group, head_dim):
    seqs = {"serving": SERVING, "prefill_chunks": PREFILL}.get(kind) or BATCHES[kind]
    check(make_batch(seqs, num_kv_heads, group, head_dim, torch.float32, seed=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dtypes(dtype, head_dim):
    check(make_batch(SERVING + PREFILL, 2, 3, head_dim, dtype, seed=1), dtype)


@pytest.mark.parametrize("head_dim", [8, 72, 80, 96])
def test_other_head_dims(head_dim):
    """Sizes with no specialised kernel (or a tail past the last full vector): the generic path."""
    for dtype in (torch.float32, torch.bfloat16):
        check(make_batch(SERVING, 1, 5, head_dim, dtype, seed=2), dtype)


def test_block_size_not_16():
    for block_size in (1, 5, 32):
        check(make_batch(SERVING, 2, 3, 64, torch.float32, seed=3, block_size=block_size))


def test_batch_of_one():
    for seqs in ([(0, 1)], [(700, 1)], [(0, 50)], [(33, 17)]):
        for dtype in (torch.float32, torch.bfloat16):
            check(make_batch(seqs, 3, 3, 64, dtype, seed=4), dtype)


def test_batch_of_130():
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 800, (130,), generator=gen).tolist()
    seqs = [(n, 1) for n in lens[:120]] + [(n, 1 + n % 23) for n in lens[120:]]
    for dtype in (torch.float32, torch.bfloat16):
        check(make_batch(seqs, 3, 3, 64, dtype, seed=5), dtype)


def test_sdpa_path_for_long_chunks():
    """Chunks of >= sdpa_min_query_len rows go through SDPA inside the op: same numbers."""
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch(SERVING + PREFILL, 2, 3, 64, dtype, seed=6)
        via_sdpa = check(batch, dtype, sdpa_min_query_len=16)
        kernel = check(batch, dtype, sdpa_min_query_len=0)
        assert rel_error(via_sdpa, kernel) < TOLERANCE[dtype]


def test_split_decode_with_threads():
    """A small decode batch with long contexts and 2 threads: rows are split over key ranges and
    the partial softmaxes merged."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seqs in ([(3000, 1)], [(700, 1), (5, 1)], [(1000, 1), (0, 40)]):
            for dtype in (torch.float32, torch.float16):
                check(make_batch(seqs, 3, 3, 64, dtype, seed=7), dtype)
    finally:
        torch.set_num_threads(old)


def test_reads_nothing_past_seq_len():
    """Poisoning every cache row beyond each sequence's length (NaN) must not reach the output."""
    batch = make_batch(SERVING + PREFILL, 2, 3, 64, torch.float32, seed=8)
    expected = cpu_attention.paged_attention(**batch)
    expected_sdpa = cpu_attention.paged_attention(**batch, sdpa_min_query_len=16)
    block_size = batch["k_cache"].shape[1]
    live = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool)
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        for pos in range(seq_len):
            live[batch["block_tables"][i, pos // block_size], pos % block_size] = True
    for cache in (batch["k_cache"], batch["v_cache"]):
        cache[~live] = float("nan")
    assert torch.equal(cpu_attention.paged_attention(**batch), expected)
    assert torch.equal(cpu_attention.paged_attention(**batch, sdpa_min_query_len=16), expected_sdpa)


def test_rows_past_query_start_loc_are_zero():
    batch = make_batch([(5, 1), (9, 3)], 1, 2, 64, torch.float32, seed=9)
    q = torch.cat([batch["q"], torch.randn(2, *batch["q"].shape[1:])])
    out = cpu_attention.paged_attention(**dict(batch, q=q))
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    assert rel_error(out[:4], reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


def test_rejects_bad_arguments():
    batch = make_batch(BATCHES["mixed"], 2, 3, 64, torch.float32, seed=10)
    bad = {
        "dtype mismatch": dict(q=batch["q"].half()),
        "batch mismatch": dict(seq_lens=batch["seq_lens"][:-1]),
        "bad shapes": dict(q=batch["q"][0]),
        "head layout mismatch": dict(q=batch["q"][:, :5]),
    }
    too_long = batch["seq_lens"].clone()
    too_long[0] = batch["block_tables"].shape[1] * batch["k_cache"].shape[1] + 1
    bad["needs more than the"] = dict(seq_lens=too_long)
    outside = batch["block_tables"].clone()
    outside[0, 0] = batch["k_cache"].shape[0]
    bad["outside the pool"] = dict(block_tables=outside)
    short = batch["seq_lens"].clone()
    short[1] = 3  # its chunk has 13 new tokens
    bad["new tokens but seq_len"] = dict(seq_lens=short)
    starts = batch["query_start_loc"].clone()
    starts[1] = starts[2] + 1
    bad["decreases"] = dict(query_start_loc=starts)
    bad["unit stride"] = dict(q=batch["q"].transpose(1, 2).contiguous().transpose(1, 2))
    bad["unsupported dtype"] = {k: batch[k].double() for k in ("q", "k_cache", "v_cache")}
    for match, override in bad.items():
        with pytest.raises(ValueError, match=match):
            cpu_attention.paged_attention(**dict(batch, **override))


def test_int64_metadata_is_accepted():
    batch = make_batch(SERVING, 2, 3, 64, torch.float32, seed=11)
    wide = {k: batch[k].long() for k in ("block_tables", "seq_lens", "query_start_loc")}
    assert torch.equal(
        cpu_attention.paged_attention(**dict(batch, **wide)), cpu_attention.paged_attention(**batch)
    )


def test_torch_compile_fullgraph_matches_eager():
    """Inductor traces the op through its fake implementation: no graph break, same numbers."""
    batch = make_batch(SERVING, 2, 3, 64, torch.float32, seed=12)

    def step(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
        out = cpu_attention.paged_attention(
            q * 2.0, k_cache, v_cache, block_tables, seq_lens, query_start_loc, batch["scale"]
        )
        return torch.nn.functional.silu(out).sum(-1) + 1.0

    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        got = compiled(*args)
        expected = step(*args)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    fake = torch.library.opcheck(
        torch.ops.llm_cpu.paged_attention.default,
        (*args[:6], batch["scale"], 0),
        test_utils=("test_schema", "test_faketensor"),
    )
    assert all(v == "SUCCESS" for v in fake.values()), fake


def test_backend_forward_writes_then_attends():
    backend = get_attention_backend("cpu", torch.device("cpu"))
    assert backend.name == "cpu"
    batch = make_batch([(5, 1), (0, 4)], 1, 2, 64, torch.float32, seed=13)
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
    k, v = torch.randn(5, 1, 64), torch.randn(5, 1, 64)
    out = backend.forward(batch["q"], k, v, batch["k_cache"], batch["v_cache"], meta, batch["scale"])
    assert torch.equal(batch["k_cache"].view(-1, 1, 64)[torch.tensor(slots)], k)
    assert rel_error(out, reference.paged_attention(**batch)) < TOLERANCE[torch.float32]


def test_auto_is_cpu_on_cpu():
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"


def test_one_openmp_runtime_and_the_pool_is_used():
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if line.split()[-1].startswith("/")}
    runtimes = {p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) <= 1, runtimes
    assert "openmp" in cpu_ext.build_info() or not runtimes
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.llm_cpu.parallel_threads(8) == 2
    finally:
        torch.set_num_threads(old)


def test_cached_build_and_entry_point():
    """`python -m worker.kernels.cpu_build` finds the cached library this process loaded."""
    out = subprocess.run(
        [sys.executable, "-m", "worker.kernels.cpu_build"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    path = cpu_ext.library_path()
    assert path in out.stdout and cpu_ext.build_name() in path
    assert path.startswith(str(cpu_ext.cache_root()))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 target")
def test_avx2_build_concurrent_builders_and_stale_lock(tmp_path, monkeypatch):
    """Two processes build an AVX2-only copy (-march=x86-64-v3: AVX2, FMA, F16C, no AVX-512) into an
    empty cache at the same time, where a torch lock file was left as by a builder killed mid-build:
    the stale lock must not block them (it is removed, not waited on), and both load the same
    library, which is correct (attention, the fused ops' SIMD paths, the int8-activation ops' AVX2
    dot products) and has no zmm instruction. (One round: a second build round just for
    the stale lock cost a third process and ~2 s.)"""
    env = dict(os.environ, LLM_CPU_EXT_DIR=str(tmp_path), LLM_CPU_EXT_MARCH="x86-64-v3")
    monkeypatch.setenv("LLM_CPU_EXT_MARCH", "x86-64-v3")
    build_dir = tmp_path / cpu_ext.build_name()  # the directory the children build into
    build_dir.mkdir()
    (build_dir / "lock").touch()  # torch's file baton, as a killed builder leaves it
    cmd = ["nice", sys.executable, "-m", "tests.avx2_build_check"]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:  # a builder hung on the stale lock: do not leave it behind
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    lines = [out.split() for out, _ in outs]
    assert lines[0] == lines[1] and lines[0][0] == "avx2", lines
    lib = lines[0][-1]
    assert os.path.dirname(lib) == str(build_dir), (lib, build_dir)  # built where the lock was
    assert not (build_dir / "lock").exists()  # and torch's baton was released after the build
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True, timeout=120).stdout
        assert "zmm" not in asm and "ymm" in asm


def test_auto_falls_back_to_torch_when_the_build_fails(tmp_path):
    code = textwrap.dedent("""
        import logging, torch
        from worker.attention import get_attention_backend
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
        print("backend", get_attention_backend("auto", torch.device("cpu")).name)
        try:
            get_attention_backend("cpu", torch.device("cpu"))
        except RuntimeError as exc:
            print("explicit cpu raises:", str(exc).splitlines()[0])
    """)
    env = dict(os.environ, LLM_CPU_EXT_DIR=str(tmp_path), LLM_CPU_EXT_MARCH="no-such-cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "backend torch" in out.stdout
    assert "explicit cpu raises: the llm_cpu attention extension did not build" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING worker.attention")]
    assert len(warnings) == 1 and "no-such-cpu" in warnings[0], out.stderr[-2000:]


def test_engine_greedy_tokens_match_torch_backend(runner, make_engine, tokenizer):
    from worker.engine import LLMEngine
    from worker.model_runner import ModelRunner
    from worker.types import SamplingParams

    questions = [
        "What is the capital of France?",
        "Why is the sky blue? Answer in one sentence.",
        "Give me a short motivational quote about learning new things every day.",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 8)]
    # A 64-token budget mixes prompt chunks (with and without cached prefix) with decode rows.
    expected = make_engine(max_num_batched_tokens=64).generate(prompts, params)
    config = dataclasses.replace(
        runner.config, attention_backend="cpu", enforce_eager=True, max_num_batched_tokens=64
    )
    cpu_runner = ModelRunner.from_model(config, runner.model, runner.eos_token_ids, runner.model_name)
    assert cpu_runner.backend.name == "cpu"
    engine = LLMEngine(config, runner=cpu_runner)
    assert engine.generate(prompts, params) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_benchmark_command_runs():
    """`make bench-attention` at a tiny size: it checks every path against the reference first."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_attention", "--batch-sizes", "1", "3", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(len(row) == 12 and row[4].endswith("x") and row[9].endswith("x") for row in rows)
    assert "DRAM read" in out.stderr
