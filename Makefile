# Two commands do all setup on a fresh machine (see README):
#   make demo   - build the environment if missing, then run `evenflow demo`
#   make test   - build the environment if missing, then lint and run the CPU test suite
# The environment lives in .venv. Without an NVIDIA driver it gets the CPU build of
# torch and the Triton version whose interpreter we test against; with one, the
# default (CUDA) torch build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH   := "torch>=2.6" "triton>=3.3"
TORCH_CPU :=
else
TORCH   := "torch==2.13.0+cpu" "triton==3.6.0" "numpy<2.4"
# the CPU build (PyPI's Linux torch wheel is the CUDA one, gigabytes of libraries a CPU cannot use): torch alone from
# PyTorch's CPU index beside the default one (where that index cannot be reached pip warns and takes what it can
# reach), then its dependencies from the default index
TORCH_CPU := --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
endif
# vLLM for its adapter's tests, without its dependency tree (which pins its own CUDA torch): the wheel and the
# modules its attention-backend interface imports. The adapter's tests use vLLM's own classes on the CPU.
VLLM    := "vllm==0.34.0" psutil pyzmq urllib3 aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal \
           frozenlist requests certifi pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo \
           prometheus-client llguidance xgrammar "apache-tvm-ffi==0.1.15.post2" einops
# SGLang for its adapter's tests, the same way: the wheel and the modules its import chain reaches on the way to the
# attention-backend interface (on the CPU without torchvision: tests/tests_support_engines.import_sglang says why).
SGLANG  := "sglang==0.5.23" orjson starlette ipython traitlets dill sentencepiece compressed-tensors loguru gguf \
           openai sniffio partial-json-parser
# pytest workers: the interpreter is CPU-bound, one worker per core.
JOBS    ?= $(shell $(PY) -c 'import os; print(max(1, min(4, os.cpu_count() or 1)))')

.PHONY: env demo test lint gpu-test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_CPU),$(BIN)/python -m pip install -q $(TORCH_CPU))
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps $(VLLM)
	$(BIN)/python -m pip install -q --no-deps $(SGLANG)
	touch $@

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/evenflow demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest -q -n $(JOBS) -p no:cacheprovider tests

# On a GPU machine: the whole suite, the GPU-marked tests and the CPU suite's compiled for the GPU, on GPU_JOBS pytest
# workers sharing the GPU (the tests are mostly Triton compiles, CPU-bound: on an H200 with 16 cores the 517
# GPU-marked tests took 295 s on 8 workers, round BC2, and the others 267 s on 12, BC4); then, alone, the one test
# that needs an idle GPU (it skips itself under workers). GPU_JOBS=0: one process, no workers.
GPU_JOBS ?= $(shell $(PY) -c 'import os; print(max(1, min(8, (os.cpu_count() or 2) // 2)))')
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(GPU_JOBS) -p no:cacheprovider tests
	$(BIN)/python -m pytest -q -m gpu -p no:cacheprovider tests/test_foundation.py -k idle_gpu

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
