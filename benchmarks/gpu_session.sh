#!/bin/sh
# One GPU lease, one command (`make gpu-session`, run from the repo root on the GPU machine):
# the Triton kernel, CUDA-graph and FP8 tests on CUDA, then the `make bench-gpu` script
# (benchmarks/gpu_bench.py) in what time is left.
# Uses only what that machine has (python3 with torch, triton, transformers, pytest, pytest-xdist).
# Also `make bench-host` (benchmarks/host_overhead.py) on that machine's CPU, the host of a GPU engine.
# Writes to $OUT (else results/): gpu_info.txt, gpu_tests.log, host_overhead.{json,log},
# gpu_bench.{json,md}, gpu_profile.{json,md} (benchmarks/gpu_profile.py: kernel time per decode
# step) (8 files: a device call brings back at most 8).
# GPU_SESSION_S (default 480) bounds the whole script: the tests get at most 180 s (they took ~30 s
# on an H200 before the fp8, mixed-step, GEMV and sampling tests were added), bench-host at most 90 s, the
# benchmark skips cases that would start past the budget and is killed 20 s after it (its files
# are rewritten after every case and every section runs in its own try, so what it measured
# stays): at most ~8.5 min in all.
# Benchmark sections on an H200, in this order (estimates; the first run of the new ones will
# tell), the ones no GPU has measured yet first, so the deadline cuts the others: bandwidth ~10 s;
# decode-step kernels ~100-165 s (Triton GEMV vs cuBLAS, fused vs torch sampling, the engine with
# and without --triton-gemv, each also with async scheduling, sampled torch vs fused;
# benchmarks/gpu_decode.py, with Triton compiles); steady serving with Poisson arrivals ~50 s (its highest load twice: synchronous and
# async scheduling) and FP8 speed + checkpoint accuracy ~50 s (benchmarks/gpu_steady.py,
# benchmarks/gpu_fp8.py), LoRA rows vs base rows ~20 s (benchmarks/gpu_lora.py); then, measured in earlier sessions: fused kernels ~5 s, attention
# ~25 s, real checkpoint ~30 s (+ ~15 s with staggered arrivals: benchmarks/gpu_mixed.py), engine
# + transformers eager ~90 s, roofline 0 s (from the engine's timings). The transformers static
# cache + torch.compile baseline (~150 s, measured in docs/data/gpu) is skipped here
# (--skip-hf-compiled); `make bench-gpu` runs everything.
#
# The real-checkpoint check (graphs vs eager on SmolLM2) needs the embedded GGUF (94 MiB) and the
# `gguf` package, which the GPU machine lacks, and one device call carries at most 64 MiB. So:
#   here, once:   sh benchmarks/gpu_session.sh prepare
#                 (splits the GGUF into results/gpu_payload/a and results/gpu_payload/b, ~48 MiB
#                 each; b also holds the gguf package and the file's sha256)
#   device call 1: carry ["results/gpu_payload/a"], command `ls -l results/gpu_payload/a` (returns
#                 at once; the part stays on the warm machine, results/ being git-ignored)
#   device call 2: at once (the machine stays warm ~30 s), carry ["results/gpu_payload/b"],
#                 command `make gpu-session`
# This script then joins the parts in /tmp, checks the sha256, and gives the benchmark
# SMOLLM2_GGUF and the gguf package on PYTHONPATH. Without both parts the check is skipped and the
# benchmark's tables say why; everything else runs the same.
set -u
payload=results/gpu_payload

if [ "${1:-}" = prepare ]; then
    py=${PY:-.venv/bin/python}
    src=$($py -c "from common.model_files import default_model_path; print(default_model_path())") || exit 1
    pkg=$($py -c "import gguf, os; print(os.path.dirname(gguf.__file__))") || exit 1
    rm -rf "$payload"
    mkdir -p "$payload/a" "$payload/b/site"
    split -b 48M "$src" "$payload/part." || exit 1
    mv "$payload/part.aa" "$payload/a/" && mv "$payload/part.ab" "$payload/b/" || exit 1
    [ ! -e "$payload/part.ac" ] || { echo "unexpected third part: the GGUF is over 96 MiB"; exit 1; }
    cp -r "$pkg" "$payload/b/site/gguf" && rm -rf "$payload/b/site/gguf/__pycache__"
    basename "$src" > "$payload/b/NAME"
    $py -c "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())" \
        "$src" > "$payload/b/SHA256"
    du -sh "$payload/a" "$payload/b"
    exit 0
fi

OUT=${OUT:-results}
mkdir -p "$OUT"
start=$(date +%s)
budget=${GPU_SESSION_S:-480}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    > "$OUT/gpu_info.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      'cuda', torch.cuda.is_available())" >> "$OUT/gpu_info.txt" 2>&1
cat "$OUT/gpu_info.txt"

# The checkpoint payload, if both device calls brought their part (see the top of this file).
bench_path=""
if [ -f "$payload/a/part.aa" ] && [ -f "$payload/b/part.ab" ] && [ -f "$payload/b/NAME" ]; then
    mkdir -p /tmp/gpu_payload
    gguf_file=/tmp/gpu_payload/$(cat "$payload/b/NAME")
    cat "$payload/a/part.aa" "$payload/b/part.ab" > "$gguf_file"
    if python3 -c "import hashlib, sys; sys.exit(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest()
                   != open(sys.argv[2]).read().strip())" "$gguf_file" "$payload/b/SHA256"; then
        echo "checkpoint payload: $gguf_file (sha256 ok)"
        bench_path="$PWD/$payload/b/site"
    else
        echo "checkpoint payload: sha256 mismatch, real-checkpoint check skipped"
    fi
else
    echo "checkpoint payload: not here (part a: $(ls "$payload/a" 2>/dev/null || echo none), part b:" \
         "$(ls "$payload/b" 2>/dev/null | tr '\n' ' ' || echo none)); real-checkpoint check skipped"
fi

# Triton compiles dominate the tests: spread them over 4 processes when pytest-xdist is there.
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 4"
# The async-scheduling / sampler modules run their tiny engines on CUDA here (device "auto"): the
# device hand-off of sampled tokens, pinned copies and the fused sampling kernel for real (not the
# SmolLM2 one: the GGUF is not on that machine).
test_s=$((budget / 2)); [ "$test_s" -gt 180 ] && test_s=180
timeout "$test_s" python3 -m pytest -q -p no:cacheprovider $parallel \
    tests/test_kernels.py tests/test_cuda_graphs.py tests/test_fp8.py tests/test_gemv.py tests/test_gemv_groups.py \
    tests/test_fp8_gemm.py \
    tests/test_triton_sampling.py tests/test_request_sampler.py tests/test_async_handoff.py \
    tests/test_async_scheduling.py tests/test_triton_rope_kv.py tests/test_triton_argmax.py \
    -k "not smollm2" \
    > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
echo "GPU tests: exit $tests_rc after $(( $(date +%s) - start )) s"
tail -n 15 "$OUT/gpu_tests.log"

# Host time per engine step on this machine's CPU, the host a GPU engine runs on (~30 s: greedy,
# sampled through the torch sampler and through the fused path).
OMP_WAIT_POLICY=PASSIVE timeout 90 python3 -m benchmarks.host_overhead --out "$OUT/host_overhead.json" \
    > "$OUT/host_overhead.log" 2>&1
echo "bench-host: exit $?; $(tail -n 1 "$OUT/host_overhead.log")"

left=$(( budget - ($(date +%s) - start) ))
if [ -n "$bench_path" ]; then
    SMOLLM2_GGUF=$gguf_file PYTHONPATH="$bench_path${PYTHONPATH:+:$PYTHONPATH}" \
        PYTHONUNBUFFERED=1 timeout -k 10 $((left + 20)) python3 -m benchmarks.gpu_bench \
        --out-dir "$OUT" --time-budget-s "$left" --skip-hf-compiled
else
    PYTHONUNBUFFERED=1 timeout -k 10 $((left + 20)) python3 -m benchmarks.gpu_bench \
        --out-dir "$OUT" --time-budget-s "$left" --skip-hf-compiled
fi
bench_rc=$?

# Where a decode step's time goes (kernel time per step by kernel vs wall time; ~25 s), if time is left.
left=$(( budget + 20 - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
    timeout -k 5 "$left" python3 -m benchmarks.gpu_profile --out-dir "$OUT" --time-budget-s $((left - 10)) \
        > "$OUT/gpu_profile.log" 2>&1
    echo "profile: exit $? ($(grep -c '^## ' "$OUT/gpu_profile.md" 2>/dev/null || echo 0) cases)"
    tail -n 3 "$OUT/gpu_profile.log" && rm -f "$OUT/gpu_profile.log"  # the 9th file would not come back
else
    echo "profile: skipped, ${left} s left"
fi
echo "gpu session: tests exit $tests_rc, benchmark exit $bench_rc, $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
