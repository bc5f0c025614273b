# specdec: every command a person runs twice.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
TORCH_VER ?= 2.13.0
PROTOS    := $(wildcard protos/specdec/v1/*.proto)

.PHONY: install demo up proto proto-check lint lint-proto format test test-unit test-integration clean

# Create .venv/ with the project and its dev tools. torch goes first so that
# transformers does not pull a multi-GB CUDA build.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==$(TORCH_VER)
	$(VPY) -m pip install -q -e '.[dev]'
	touch $@

# The local stack (Redis, drafter, verifier, gateway) on tiny random models: streams a few
# prompts and compares speculation with k=0. The real-models work replaces the tiny pair.
demo: install
	$(VENV)/bin/specdec demo --tiny .cache/tiny-models

# Regenerate the Python stubs in specdec/v1/ from protos/ (never edit them by hand).
proto: install
	$(VPY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# Fails when the committed stubs differ from what protoc generates now.
proto-check: install
	$(VPY) -m pytest -q tests/unit/test_protos.py

lint-proto: install
	$(VENV)/bin/buf lint

lint: install lint-proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: install
	$(VPY) -m pytest -q

test-unit: install
	$(VPY) -m pytest -q tests/unit

test-integration: install
	$(VPY) -m pytest -q tests/integration

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
