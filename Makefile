# Baton: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# Django-backed tests that run a second time against real PostgreSQL and Redis when
# DATABASE_URL / REDIS_URL are set (the first run always uses the embedded defaults).
SERVICE_TESTS ?= tests/base tests/controlplane tests/fleet tests/plans tests/billing tests/routing \
	tests/frontend tests/e2e
# Browser tests need no database server; they run once, in the embedded pass.
SERVICE_MARKS ?= not browser

.PHONY: setup browser demo bench bench-paper bench-autopilot test test-embedded test-services lint format clean vendor

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to 2.13.0: the CPU build on disk; any other spec downloads a CUDA build.
	$(PY) -m pip install --quiet -e '.[agents,planner,dev]'
	@touch $(STAMP)

# The simulator compiled with mypyc (planner/native.py): same results, ~1.5x faster. Rebuilt
# when a source changes; a failed build leaves the planner on pure Python (it says so). Then
# (every setup, a no-op when current) the engine's C++ kernels (agents/engine/skinny.py;
# AVX-512 with AVX512-BF16 or AVX2 with FMA, skipped on CPUs with neither; a failed build
# leaves the default path).
NATIVE_STAMP := build/native/stamp.json
$(NATIVE_STAMP): $(STAMP) $(wildcard planner/*.py pdd/*.py)
	-BATON_PLANNER_NATIVE=0 $(PY) -m planner native build

setup: $(STAMP) $(NATIVE_STAMP)
	@-$(PY) -m agents.engine.kernels build

# Debian's chromium for the browser tests (root installs it; never a downloaded browser).
browser:
	@test -x /usr/bin/chromium || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
		else echo "browser tests need Debian's chromium: sudo apt-get install chromium"; fi; }

test: setup browser test-embedded test-services

# With real services configured, their tests run in test-services; here they are deselected.
test-embedded: setup
	@marks=""; if [ -n "$$DATABASE_URL$$REDIS_URL" ]; then marks="not postgres and not redis"; fi; \
	set -x; env -u DATABASE_URL -u REDIS_URL -u BATON_REQUIRE_SERVICES \
		BATON_VAR_DIR=$(CURDIR)/var/test $(PY) -m pytest $${marks:+-m "$$marks"} $(PYTEST_ARGS)

test-services: setup
	@if [ -n "$$DATABASE_URL$$REDIS_URL" ]; then \
		echo "== again against DATABASE_URL=$$DATABASE_URL REDIS_URL=$$REDIS_URL"; \
		$(PY) -m pytest $(SERVICE_TESTS) -m "$(SERVICE_MARKS)" $(PYTEST_ARGS); \
	else \
		echo "== DATABASE_URL and REDIS_URL not set: real-server tests ran only as skips"; \
	fi

# The control plane, the demo fleet's agents and gentle agentic traffic; Ctrl-C stops all.
demo: setup
	$(PY) -m bench.demo --host $(HOST) --port $(PORT) $(DEMO_ARGS)

# The live PDD benchmark: IDC-PD, CDC-PD and PDD on local agents at three rates (<= 20 min);
# writes bench/pdd/REPORT.md, summary.json and the plots, raw results under var/bench-pdd/.
bench: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.pdd $(BENCH_ARGS)

# The paper's experiment on the live system: IDC-PD, CDC-PD and PDD as emulated fleets of the
# paper model, scaled 1/8 and run in slow motion (<= 30 min); writes bench/paper/REPORT.md and
# summary.json, raw results under var/bench-paper/.
bench-paper: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.paper $(BENCH_ARGS)

# The autopilot on an emulated fleet whose rate doubles, automatic mode on (<= 15 min); writes
# bench/autopilot/REPORT.md and summary.json, raw results under var/bench-autopilot/.
bench-autopilot: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.autopilot $(BENCH_ARGS)

# Faults against a real local fleet (agent SIGKILL/SIGSTOP, web SIGTERM/SIGKILL; <= 15 min);
# writes bench/chaos/REPORT.md and summary.json, raw per-trial JSON under var/chaos/.
chaos: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.chaos $(CHAOS_ARGS)

# Refresh the vendored uPlot from package.json (pinned) into frontend/static.
vendor: setup
	npm ci --no-audit --no-fund
	$(PY) manage.py frontend_vendor

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) var build staticfiles .pytest_cache .ruff_cache *.egg-info
