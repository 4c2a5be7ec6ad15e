# Two commands: `make up` starts the three services on localhost, `make test` runs the suite.
# Both create .venv and install ardit into it first.

PYTHON ?= python3
VENV ?= .venv
# The PyTorch requirement installed before everything else; TORCH_SPEC (and TORCH_PIP_ARGS) override the choice.
# A machine with an NVIDIA driver (nvidia-smi on PATH, or /proc/driver/nvidia) gets PyPI's CUDA build of the newest
# torch; any other machine gets the CPU build of the release CI tests, torch 2.13.0+cpu (a few hundred MB instead of
# several GB of CUDA libraries it cannot use). That build is not on PyPI: pip finds it in PyTorch's CPU index,
# TORCH_CPU_INDEX (tried second, with TORCH_PIP_ARGS, so that an offline machine never waits on it), or in a wheel
# directory of pip's own configuration (find-links; tried first). Where neither is reachable pip
# stops with "No matching distribution found for torch==2.13.0+cpu"; then point TORCH_CPU_INDEX at a mirror, or
# take PyPI's CUDA build with TORCH_SPEC='torch>=2.4' TORCH_PIP_ARGS=.
HAS_NVIDIA := $(shell if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; then echo yes; fi)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(HAS_NVIDIA),yes)
TORCH_SPEC ?= torch>=2.4
TORCH_PIP_ARGS ?=
else
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_PIP_ARGS ?= --extra-index-url $(TORCH_CPU_INDEX)
endif
# `make up` serves the trained Dev shapes model, which draws and edits (train/README.md); the Preview-layout shapes
# model is `make up MODEL_DIR=train/checkpoints/shapes`, and the random tiny model, which the tests build,
# `make up MODEL_DIR=models/tiny`.
MODEL_DIR ?= train/checkpoints/shapes-dev
TINY_DIR := models/tiny
PYTEST_ARGS ?=
# The suite runs in this many pytest-xdist workers, one test file per worker at a time (most of its time is spent
# starting and waiting on service processes); 0 runs it in this process.
PYTEST_WORKERS ?= 2
# checkov scans the Kubernetes manifests (tests/test_k8s_manifests.py); it lives in an environment of its own
# because its pinned dependencies would downgrade torch's.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_SPEC ?= checkov==3.3.30

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-newest-torch lint install model protos checkov clean wheelhouse compose-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" 2>/dev/null || \
	  $(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" || { \
	  echo "make: could not install PyTorch '$(TORCH_SPEC)' (pip options: '$(TORCH_PIP_ARGS)')." >&2; \
	  echo "make: the CPU build comes from $(TORCH_CPU_INDEX) or a local wheel directory; set TORCH_CPU_INDEX," >&2; \
	  echo "make: or TORCH_SPEC='torch>=2.4' TORCH_PIP_ARGS= for PyPI's (CUDA) build." >&2; exit 1; }
	$(BIN)/python -c "import torch; print('make: installed torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU build)')"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(TINY_DIR)/config.json: | $(STAMP)
	$(BIN)/python -m tools.make_tiny $(TINY_DIR)

model: $(TINY_DIR)/config.json

$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet "$(CHECKOV_SPEC)"

checkov: $(CHECKOV_VENV)/bin/checkov

up: install model
	$(BIN)/python -m tools.run_all --model-dir $(MODEL_DIR)

test: install model checkov
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The kernel and model tests again, in an environment of their own with the newest torch (and the triton it brings
# or pyproject.toml allows) that the indexes offer: CI's check that a newer release than the pin keeps them passing.
NEWEST_VENV ?= .venv-newest
NEWEST_TORCH_SPEC ?= torch>=2.4
NEWEST_TESTS ?= tests/ar_service/test_fp8_ar.py tests/ar_service/test_decode_kernels.py \
	tests/ar_service/test_static_decode.py tests/ar_service/test_ar_model.py tests/servicekit/test_fp8.py \
	tests/servicekit/test_fp8_kernels.py tests/dit_service/test_fp8_dit.py tests/dit_service/test_qk_rope_kernel.py \
	tests/dit_service/test_transformer.py

test-newest-torch: model
	$(MAKE) install VENV=$(NEWEST_VENV) TORCH_SPEC="$(NEWEST_TORCH_SPEC)"
	$(NEWEST_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS) $(NEWEST_TESTS)

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) over the tree, mypy over the five packages;
# both configured in pyproject.toml.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

protos: install
	$(BIN)/python -m protos.generate

# The air-gapped image build (README, "Air-gapped build"): every wheel the image installs, for CPython 3.11 on
# manylinux x86_64 (glibc up to 2.36, Debian 12's), downloaded on this host into wheelhouse/, which
# `docker build --build-arg WHEELHOUSE=1` installs with no index. WHEELHOUSE_TORCH_SPEC picks the torch build: the
# CPU one by default, e.g. torch==2.13.0 for PyPI's CUDA build (and the nvidia-* wheels it brings) for the GPU image.
WHEELHOUSE_TORCH_SPEC ?= torch==2.13.0+cpu
WHEELHOUSE_PLATFORMS := $(foreach minor,$(shell seq 36 -1 17),manylinux_2_$(minor)_x86_64) \
	manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64
WHEELHOUSE_PIP := $(BIN)/python -m pip download --quiet --dest wheelhouse --only-binary=:all: \
	$(addprefix --platform ,$(WHEELHOUSE_PLATFORMS)) --python-version 3.11 --implementation cp --abi cp311

wheelhouse: install
	@echo "make: downloading $(WHEELHOUSE_TORCH_SPEC) and ardit's runtime dependencies into wheelhouse/ (cp311, manylinux x86_64)"
	@$(WHEELHOUSE_PIP) "$(WHEELHOUSE_TORCH_SPEC)" "setuptools>=77" . 2>/dev/null || \
	  $(WHEELHOUSE_PIP) --extra-index-url $(TORCH_CPU_INDEX) "$(WHEELHOUSE_TORCH_SPEC)" "setuptools>=77" .
	@echo "make: wheelhouse/ holds $$(ls wheelhouse/*.whl | wc -l) wheels, $$(du -sh wheelhouse | cut -f1)"

# compose.yaml for real (tests/compose/run.sh): a debootstrapped Debian base image, the wheelhouse, the image built
# with no network, then the scenario of tests/compose/run_scenario.py. Needs a Docker engine and debootstrap
# (`.ci/run` installs both and starts dockerd); `make test` never needs Docker.
compose-test: install
	MAKE="$(MAKE)" PYTHON_BIN=$(BIN)/python bash tests/compose/run.sh

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) $(NEWEST_VENV) $(TINY_DIR)
