# The two commands a newcomer needs: `make run` (the demo) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ENGINE ?= vllm
STAMP := $(VENV)/.installed
BUF_DIR := tools/buf
BUF := $(BUF_DIR)/node_modules/.bin/buf

# Every install (this venv, `make install-systemd`, the Dockerfile) takes its versions from this
# one file: exact pins for every dependency and extra of pyproject.toml, pip and the build backend.
LOCK := requirements.lock

.PHONY: setup run test lint typecheck protos protos-check buf install-systemd deploy-check lock bench bench-full bench-peer-setup soak mutation clean

$(STAMP): pyproject.toml testkit/pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c $(LOCK) --upgrade pip
	$(BIN)/python -m pip install --quiet -c $(LOCK) -e '.[test,dev]' -e ./testkit
	touch $(STAMP)

# The tests run a real etcd server and systemd-analyze: installed (Debian packages) when missing.
setup: $(STAMP)
	scripts/ensure_system_tools.sh

# The sidecar beside a testkit engine on loopback, streaming one real generation
# (ENGINE=vllm, sglang, or frontend: the HTTP frontend in front of the vLLM sidecar, one curl).
run: $(STAMP)
	$(BIN)/python -m testkit.demo --engine $(ENGINE)

# After changing a dependency in pyproject.toml or testkit/pyproject.toml: re-resolve $(LOCK),
# keeping every other pin as it is (commit both files; tests/deploy/test_lock.py fails while the
# lock misses or contradicts a requirement). `make lock UPGRADE=1` moves every pin to the newest
# allowed. Universal: one lock for every platform and every Python >= 3.11 (markers where they
# differ). The testkit's own requirement on llm-sidecars (this checkout, on no index) is
# overridden by one whose marker never holds, so the resolver leaves it out.
lock:
	@test -x $(BIN)/uv || { echo "no $(BIN)/uv: run make setup first (uv is a pinned dev dependency)" >&2; exit 1; }
	printf "llm-sidecars ; python_version < '0'\n" > $(VENV)/lock-overrides.txt
	echo pip | $(BIN)/uv pip compile pyproject.toml testkit/pyproject.toml - --all-extras --universal \
	    --python-version 3.11 --override $(VENV)/lock-overrides.txt \
	    --custom-compile-command "make lock" --quiet $(if $(UPGRADE),--upgrade) --output-file $(LOCK)

# The suite on TEST_WORKERS processes (pytest-xdist): most of its time is spent waiting on child
# processes, etcd and timers, which overlaps on two cores. --dist loadscope keeps each module on
# one worker, so its module-scoped fixtures start once. TEST_WORKERS=0 runs it in one process.
# The tests that load every core on purpose (marker `cpu_hog`, in tests/reliability and tests/process) run
# afterwards, alone, in one process (exit 5, none selected, is not a failure there); the tests
# that install from the package index (marker `install`) run in deploy-check instead.
# docs/testing.md: how the suite is split, how to run a part, where the time goes.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on
# some CI machines): each worker and each of the hundreds of daemons the tests start would otherwise
# compile the same sources again (and pytest rewrite every test module's asserts): 15 % of the
# suite's CPU on a fresh clone.
TEST_WORKERS ?= 4
test: setup $(BUF)
	export PYTHONDONTWRITEBYTECODE=; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not install and not cpu_hog" $(PYTEST_ARGS); \
	    rc=$$?; if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc
	export PYTHONDONTWRITEBYTECODE=; \
	$(BIN)/python -m pytest -q -m "cpu_hog and not install" tests/reliability tests/process $(PYTEST_ARGS); \
	    rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

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

# Lint the protos, and fail on any change to sidecar.v1 that breaks the 0.1.0 API (the contract
# as first published in this repository, kept in tests/data/released).
buf: $(BUF)
	$(BUF) lint
	$(BUF) breaking --against tests/data/released

# A venv in PREFIX with this checkout's wheel, and the systemd unit whose ExecStart runs it.
# Run as root for the defaults; enabling the unit is left to the operator (deploy/README.md).
PREFIX ?= /opt/llm-sidecars
UNIT_DIR ?= /etc/systemd/system
install-systemd:
	$(PY) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip install --quiet -c $(LOCK) --upgrade pip
	$(PREFIX)/bin/python -m pip install --quiet -c $(LOCK) .
	mkdir -p $(UNIT_DIR)
	sed 's|/opt/llm-sidecars|$(PREFIX)|g' deploy/sidecar-vllm.service > $(UNIT_DIR)/sidecar-vllm.service
	chmod 0644 $(UNIT_DIR)/sidecar-vllm.service
	@echo "installed $(PREFIX)/bin/sidecar and $(UNIT_DIR)/sidecar-vllm.service; next:"
	@echo "  settings in /etc/sidecar/vllm.env, then: systemctl daemon-reload && systemctl enable --now sidecar-vllm"

# The deployment files as their own tools judge them: hadolint on the Dockerfile, every
# manifest in deploy/kubernetes against the named Kubernetes version's schemas, and the
# systemd unit's hardening (exposure at most 3.0). `systemd-analyze verify` needs the
# installed ExecStart, so it runs on a unit `make install-systemd` produced: the tests marked
# `install` (tests/deploy/test_install.py), which fetch the dependencies from the package index.
# The oldest version the manifests claim (native sidecars are on by default from 1.29).
K8S_VERSION ?= 1.29.0
deploy-check: $(STAMP)
	$(BIN)/hadolint Dockerfile
	$(BIN)/kubernetes-validate --kubernetes-version $(K8S_VERSION) --strict deploy/kubernetes/*.yaml
	systemd-analyze security --offline=true --threshold=30 deploy/sidecar-vllm.service
	$(BIN)/python -m pytest -q -p no:cacheprovider -m install tests/deploy

# Quick results go to bench/results/quick/ so they never overwrite the committed --full run.
bench: $(STAMP)
	$(BIN)/python -m bench --quick --out bench/results/quick
	$(BIN)/python -m bench.frontend --quick --out bench/results/quick

bench-full: $(STAMP)
	$(BIN)/python -m bench --full
	$(BIN)/python -m bench.sglang_growth

# SMG (PyPI smg, pinned with hashes in bench/smg-requirements.txt) in .venv-smg/, for
# `python -m bench.full_path`, which also runs this when that venv is missing. Benchmark only:
# never a dependency of the product.
bench-peer-setup:
	scripts/smg_venv.sh

soak: $(STAMP)
	SIDECAR_SOAK_SCALE=10 $(BIN)/python -m pytest -q tests/reliability -k soak -s

# Mutation testing (not part of `make test`): mutmut over the converters, errors, pool,
# dispatch, coalesce and relay ([tool.mutmut] in pyproject.toml; each mutant runs only the
# tests that reach the mutated function). Works in mutants/; docs/mutation.md keeps the score.
MUTATION_CHILDREN ?= 2
mutation: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/mutmut run --max-children $(MUTATION_CHILDREN)
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants
