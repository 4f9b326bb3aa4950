# The two commands a newcomer needs: `make run` (the demo) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ENGINE ?= vllm
STAMP := $(VENV)/.installed
BUF_DIR := tools/buf
BUF := $(BUF_DIR)/node_modules/.bin/buf

.PHONY: setup run test lint typecheck protos protos-check buf bench bench-full soak clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

# The fleet tests run a real etcd server: installed (Debian's etcd-server) when missing.
setup: $(STAMP)
	scripts/ensure_etcd.sh

# The sidecar beside a testkit engine on loopback, streaming one real generation.
run: $(STAMP)
	$(BIN)/python -m testkit.demo --engine $(ENGINE)

test: $(STAMP) $(BUF)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

protos-check: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check

# buf from npm into tools/buf/node_modules (pinned by its package-lock.json; never global).
$(BUF): $(BUF_DIR)/package.json $(BUF_DIR)/package-lock.json
	cd $(BUF_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $(BUF)

# Lint the protos, and fail on any change to sidecar.v1 that breaks the released 0.1.0 API.
buf: $(BUF)
	$(BUF) lint
	$(BUF) breaking --against tests/data/released

# Quick results go to bench/results/quick/ so they never overwrite the committed --full run.
bench: $(STAMP)
	$(BIN)/python -m bench --quick --out bench/results/quick

bench-full: $(STAMP)
	$(BIN)/python -m bench --full

soak: $(STAMP)
	SIDECAR_SOAK_SCALE=10 $(BIN)/python -m pytest -q tests/reliability -k soak -s

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
