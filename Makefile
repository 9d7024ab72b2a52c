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
SERVICE_TESTS ?= tests/controlplane tests/fleet tests/billing tests/routing_app tests/gateway

.PHONY: setup demo test test-embedded test-services lint format clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to 2.13.0: the CPU build on disk; any other spec downloads a CUDA build.
	$(PY) -m pip install --quiet -e '.[agents,planner,dev]'
	@touch $(STAMP)

setup: $(STAMP)

test: setup test-embedded test-services

# With real services configured, their tests run in test-services; here they are deselected.
test-embedded: setup
	@marks=""; if [ -n "$$DATABASE_URL$$REDIS_URL" ]; then marks="not postgres and not redis"; fi; \
	set -x; env -u DATABASE_URL -u REDIS_URL -u BATON_REQUIRE_SERVICES \
		BATON_VAR_DIR=$(CURDIR)/var/test $(PY) -m pytest $${marks:+-m "$$marks"} $(PYTEST_ARGS)

test-services: setup
	@if [ -n "$$DATABASE_URL$$REDIS_URL" ]; then \
		echo "== again against DATABASE_URL=$$DATABASE_URL REDIS_URL=$$REDIS_URL"; \
		$(PY) -m pytest $(SERVICE_TESTS) $(PYTEST_ARGS); \
	else \
		echo "== DATABASE_URL and REDIS_URL not set: real-server tests ran only as skips"; \
	fi

demo: setup
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_demo
	@token=$$($(PY) manage.py baton_user demo --role operator --password demo-operator 2>/dev/null); \
	echo; \
	echo "Baton control plane: http://$(HOST):$(PORT)/"; \
	echo "  API docs:  http://$(HOST):$(PORT)/api/docs/"; \
	echo "  admin:     http://$(HOST):$(PORT)/admin/  (user demo, password demo-operator)"; \
	echo "  API token: $$token"; \
	echo "  try:       curl -H 'Authorization: Token $$token' http://$(HOST):$(PORT)/api/v1/topology/"; \
	echo "Ctrl-C stops it."; \
	echo
	exec $(VENV)/bin/uvicorn controlplane.asgi:application --host $(HOST) --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) var staticfiles .pytest_cache .ruff_cache *.egg-info
