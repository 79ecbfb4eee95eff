# tierserve: `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tierserve serve --host 127.0.0.1 --port 8000

lint: $(STAMP)
	$(VENV)/bin/ruff check tierserve tests
	$(VENV)/bin/mypy

test: $(STAMP) lint
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/tierserve bench reproduce --seed 0 1 2 --workers 2 --out bench-out/reproduce
	$(VENV)/bin/tierserve bench overhead --json > bench-out/overhead.json

bench-quick: $(STAMP)
	$(VENV)/bin/tierserve bench reproduce --quick --out bench-out/reproduce-quick

clean:
	rm -rf $(VENV) bench-out .pytest_cache .mypy_cache .ruff_cache
