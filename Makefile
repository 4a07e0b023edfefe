# Two commands do all the set-up on a fresh machine:
#   make demo   installs what kvledger needs and runs the main job on a built-in model
#   make test   installs what the tests need and runs them (CI runs this)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TOOLS := .tools
# torch: the exact CPU build pip finds on this machine's disk; an unpinned torch
# pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install install-test demo test lint helm-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e '.[test]'

demo: install
	bash scripts/demo.sh

lint: install-test
	$(BIN)/ruff check .

test:
	bash .ci/run
