"""llama.cpp as `make bench-serve` and `make eval` drive it, without building it: llama-perplexity's
output parsed (benchmarks/llamacpp.py parse_perplexity / parse_num_chunks / parse_chunk_ppls on a
captured 0.3.36 output), llama-server's command line and the build cache lookup
(benchmarks/llamacpp_build.py).
"""

from __future__ import annotations

import pytest

from benchmarks import llamacpp as lc
from benchmarks import llamacpp_build as lb

# ------------------------------------------------------------------ llama.cpp output

# llama-perplexity 0.3.36 (stdout and stderr merged, as eval_ppl runs it), 3 chunks of 512
PERPLEXITY_OUTPUT = """0.00.176.819 I cmn          init: llama threadpool init, n_threads = 1
0.00.190.205 I system_info: n_threads = 1 (n_threads_batch = 1) / 2 | CPU : SSE3 = 1 | AVX512 = 1 |
0.00.190.217 I perplexity: tokenizing the input ..
0.00.203.953 I perplexity: tokenization took 13.73 ms
0.00.203.971 I perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.06.751.789 I perplexity: 6.55 seconds per pass - ETA 0.07 minutes
[1]25.1888,[2]25.1419,[3]22.7112,
0.06.883.307 I Final estimate: PPL = 22.7112 +/- 2.38435
"""


def test_llama_perplexity_output_is_parsed():
    assert lc.parse_perplexity(PERPLEXITY_OUTPUT) == (22.7112, 2.38435)
    assert lc.parse_num_chunks(PERPLEXITY_OUTPUT) == 3
    assert lc.parse_chunk_ppls(PERPLEXITY_OUTPUT) == [25.1888, 25.1419, 22.7112]
    with pytest.raises(ValueError):
        lc.parse_perplexity("perplexity: you need at least 1024 tokens")
    with pytest.raises(ValueError):
        lc.parse_num_chunks("perplexity: tokenizing the input ..")


def test_llama_server_command_and_build_cache(tmp_path, monkeypatch):
    server = lc.LlamaServer("/x/llama-server", "/m.gguf", 2, 32, 12800)
    cmd = server.command(port=1234)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "32"
    assert cmd[cmd.index("-c") + 1] == "12800" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setenv(lb.CACHE_ENV, str(tmp_path / "cache"))
    assert lb.cache_dir() == tmp_path / "cache"
    assert lb.find_built(tmp_path / "cache") is None  # nothing built there
    assert "-DGGML_NATIVE=ON" in lb.CMAKE_FLAGS and "-DGGML_AMX_INT8=OFF" in lb.CMAKE_FLAGS
