# appliance — every command a person runs twice.
#   make train   install into .venv and run the built-in demo fine-tune on embedded Ray
#   make test    install and run the whole test suite (what CI runs), the 30 slowest listed:
#                its unit tests and its integration tests at once (test-units, test-integration)
#   make test-fast  the edit loop: no integration, slow or gpu test (tests/conftest.py marks them)
#   make dashboards  Prometheus + Grafana (docker) for an `appliance train` running on this box
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q

.PHONY: install train test test-units test-integration test-fast lint format tools clean dashboards dashboards-down

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, by pip: an unpinned torch pulls several GB of CUDA wheels on a CPU
# machine, and pip is what finds the CPU build on this disk. The rest by uv, which fetches and
# installs in parallel what pip does one package at a time (the same versions: 113 s -> 29 s
# on a 2-core machine with no cache, docs/architecture.md "Tests").
$(VENV)/.installed: pyproject.toml setup.py appliance/quant/_quantize.c constraints.txt | $(BIN)/python
	$(PIP) install torch==2.13.0 'uv>=0.5'
	$(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: install
	$(BIN)/appliance train

# external tools the checks use: helm, checkov, hadolint, kubernetes-validate, prometheus
tools:
	bash scripts/install-tools.sh
	bash scripts/install-prometheus.sh

# install and tools at once: pip, npm and apt wait on disk and network more than on the CPUs.
# Then the suite as two pytest processes at once, together every test: the unit tests (no Ray,
# server or child process: tests/conftest.py's tiers) take the core the integration tests leave
# idle while their runs start and wait. Whole lines of each (-Oline); each lists its slowest.
test:
	$(MAKE) --no-print-directory -j2 install tools
	$(MAKE) --no-print-directory -j2 -Oline test-units test-integration

test-units: install
	$(BIN)/python -m pytest -q --durations=10 -m "not integration"

test-integration: install
	$(BIN)/python -m pytest -q --durations=30 -m integration

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration and not slow and not gpu"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Grafana at http://localhost:3000 (user admin, GRAFANA_ADMIN_PASSWORD), Prometheus at :9090,
# scraping 127.0.0.1:8080, where `appliance train` serves its metrics (deploy/compose/dashboards.yml)
DASHBOARDS := docker compose -f deploy/compose/dashboards.yml

dashboards:
	$(DASHBOARDS) up -d
	@echo "Grafana http://localhost:3000 (admin), Prometheus http://localhost:9090; metrics from 127.0.0.1:8080"

dashboards-down:
	$(DASHBOARDS) down

clean:
	rm -rf $(VENV) .venv-tools .tools build appliance/quant/*.so

include deploy.mk
