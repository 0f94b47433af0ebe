# kiln — `make` lists the targets. Every target installs what it needs, idempotently.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup system-deps client-ts run test test-diffusers test-gpu lint fmt types check bench bench-pg bench-peers bench-sweep bench-http chaos docs clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml requirements/constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { $(PYTHON) -m pip install -q virtualenv && $(PYTHON) -m virtualenv -q $(VENV); }
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=25.1"
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e . --group dev
	@touch $(STAMP)

setup: $(STAMP) ## create .venv and install kiln with its dev tools (quick when done)

system-deps: ## install the system packages the tests drive (Chromium), when missing
	@scripts/system-deps.sh

client-ts: $(STAMP) system-deps ## regenerate the TypeScript client's types from the OpenAPI document, and type-check it
	cd clients/typescript && npm ci --no-audit --no-fund --prefer-offline
	$(PY) scripts/openapi_document.py > clients/typescript/openapi.json
	cd clients/typescript && npm run -s generate && npm run -s check

run: $(STAMP) ## start kiln (API, dashboard, workers, supervisor) on SQLite + ./kiln-data, with a first task
	@HOST=$(HOST) PORT=$(PORT) scripts/run.sh

test: $(STAMP) system-deps ## run the whole test suite (but the diffusers tests: test-diffusers)
	$(PY) -m pytest -q -p no:cacheprovider -m "not diffusers" $(PYTEST_ARGS)

# torch is pinned here, before the extra: the extra names no torch, so pip never picks a build.
$(VENV)/.installed-diffusers: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e '.[diffusers]'
	@touch $@

test-diffusers: $(VENV)/.installed-diffusers ## the diffusers backend on a tiny random pipeline (CPU torch)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -m "diffusers and not gpu" $(PYTEST_ARGS)

test-gpu: $(VENV)/.installed-diffusers ## the diffusers tests that need a CUDA device (on a GPU machine)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -m "diffusers and gpu" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP) ## format the code
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

types: $(STAMP) ## mypy --strict on src/kiln
	$(VENV)/bin/mypy src/kiln

check: lint types test ## lint, types and tests

bench: $(STAMP) ## the lifecycle benchmark (NORMAL and FULL durability)
	$(PY) benchmarks/lifecycle.py
	$(PY) benchmarks/lifecycle.py --synchronous FULL

bench-pg: $(STAMP) ## the lifecycle on a throwaway PostgreSQL (3 worker processes) beside pgbench -N
	$(PY) benchmarks/lifecycle.py --start-postgres

bench-peers: $(STAMP) system-deps ## kiln beside Dramatiq (Redis), Procrastinate and PgQueuer (PostgreSQL) at their defaults: rates, pickup latency
	$(PY) benchmarks/peers.py

bench-sweep: $(STAMP) ## the supervisor's sweep over 1,000,000 tasks, nothing due (SQLite and PostgreSQL), with plans
	$(PY) benchmarks/sweep.py

bench-http: $(STAMP) ## kiln serve's HTTP beside a bare FastAPI app (wrk), a burst, SSE fan-out
	@command -v wrk >/dev/null || (export DEBIAN_FRONTEND=noninteractive && apt-get update -qq && apt-get install -y -qq --no-install-recommends wrk >/dev/null)
	$(PY) benchmarks/http_bench.py

chaos: $(STAMP) ## the chaos run: 2,000 tasks, workers killed, writes failing, every invariant checked
	$(PY) benchmarks/chaos.py

docs: $(STAMP) ## regenerate the state diagram in docs/states.md from the state table
	$(PY) scripts/gen_docs.py

clean: ## remove the virtual environment and caches (keeps kiln-data)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
