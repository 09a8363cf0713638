# fairq: `make run` starts the whole system locally; `make test` runs every check CI runs.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# The first interpreter >= 3.11 found, unless PYTHON is given.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: help run test lint typecheck pytest clean

help:
	@echo "make run    start PostgreSQL (embedded unless DATABASE_URL), migrations, API on :8000, worker (ports: README)"
	@echo "make test   ruff, ruff format --check, mypy, import contracts, pytest with coverage"
	@echo "make clean  remove the virtualenv and local data (.venv, .pgdata, .run)"

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "Python 3.11+ is required (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamp files: reinstall only when pyproject.toml changes.
$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[embedded]'
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/python -m scripts.run_local

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy
	$(BIN)/lint-imports

# Coverage of api, worker, common and db, counting the processes the tests start ([tool.coverage]).
# Two test processes (pytest-xdist) keep both cores busy while tests wait on processes,
# timers and the database; each has its own template and databases (tests/pg.py). Work
# stealing: a process that runs out of tests takes queued ones from the other.
PYTEST_WORKERS ?= 2
pytest: $(VENV)/.installed-dev
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal --cov --cov-report=term-missing:skip-covered

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pgdata .run .mypy_cache .ruff_cache .pytest_cache .coverage .coverage.*
