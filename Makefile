# tierserve: `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where `make run` serves: `make run PORT=8080 HOST=0.0.0.0`.
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test lint bench bench-quick clean

$(STAMP): pyproject.toml
	@echo "tierserve: installing into $(VENV) (torch, then tierserve and its dev tools)."
	@echo "tierserve: the first install downloads torch and takes a few minutes; pip's progress follows."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)
	@echo "tierserve: $(VENV) is ready; later runs skip this step until pyproject.toml changes."

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tierserve serve --host $(HOST) --port $(PORT)

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
