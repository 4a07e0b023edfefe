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
# `make install EDITABLE=` installs a copy instead of linking the checkout (CI's
# runtime-only check does that in its own VENV).
EDITABLE ?= -e

.PHONY: install install-test demo test lint image crd docs

# The image (Dockerfile): IMAGE names it; BASE, TORCH_PIN and TORCH_INDEX_URL choose the
# base and the torch build; IMAGE_BUILD_FLAGS adds engine flags (--volume, --build-arg).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/kvledger/kvledger:$(VERSION)
CONTAINER_ENGINE ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
IMAGE_BUILD_FLAGS ?=

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet $(EDITABLE) .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e '.[test]'

demo: install
	bash scripts/demo.sh

lint: install-test
	$(BIN)/ruff check .
	bash scripts/import_contracts.sh

test:
	bash .ci/run

# The CRD's two copies (crds/ and the chart's crds/), generated from operator/; a test and
# scripts/helm_check.sh fail while either is stale.
crd:
	$(BIN)/python -m kvledger.operator.api.crd --write

# docs/serving.md's table of serve's own flags, generated from engine/settings/serve_config.py; a
# test fails while it is stale.
docs:
	$(BIN)/python scripts/serve_flags_table.py --write

image:
	$(CONTAINER_ENGINE) build -t $(IMAGE) \
	  $(if $(BASE),--build-arg BASE=$(BASE)) \
	  $(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) \
	  --build-arg TORCH_PIN=$(TORCH_PIN) \
	  --build-arg VERSION=$(VERSION) \
	  $(IMAGE_BUILD_FLAGS) .
