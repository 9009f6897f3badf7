#!/bin/sh
# One GPU lease, one command (`make gpu-session`, run from the repo root on the GPU machine):
# the Triton kernel and CUDA-graph tests on CUDA, then the `make bench-gpu` script
# (benchmarks/gpu_bench.py) in what time is left.
# Uses only what that machine has (python3 with torch, triton, transformers, pytest, pytest-xdist).
# Writes to $OUT (else results/): gpu_info.txt, gpu_tests.log, gpu_tests.xml, gpu_bench.{json,md}.
# GPU_SESSION_S (default 540) bounds the whole script: the tests get at most half, the benchmark
# skips cases that would start past it and is killed 30 s after it (its files are rewritten after
# every case, so what it measured stays), which keeps a 600 s command limit.
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
start=$(date +%s)
budget=${GPU_SESSION_S:-540}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    > "$OUT/gpu_info.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      'cuda', torch.cuda.is_available())" >> "$OUT/gpu_info.txt" 2>&1
cat "$OUT/gpu_info.txt"

# Triton compiles dominate the tests: spread them over 4 processes when pytest-xdist is there.
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 4"
timeout $((budget / 2)) python3 -m pytest -q -p no:cacheprovider $parallel \
    --junitxml="$OUT/gpu_tests.xml" \
    tests/test_kernels.py tests/test_cuda_graphs.py \
    > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
echo "GPU tests: exit $tests_rc after $(( $(date +%s) - start )) s"
tail -n 15 "$OUT/gpu_tests.log"

left=$(( budget - ($(date +%s) - start) ))
timeout -k 10 $((left + 30)) python3 -m benchmarks.gpu_bench --out-dir "$OUT" \
    --time-budget-s "$left"
bench_rc=$?
echo "gpu session: tests exit $tests_rc, benchmark exit $bench_rc, $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
