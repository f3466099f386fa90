# nanoeuler: every target creates (or reuses) the local virtual environment .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test check bench install models llama-src clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/nanoeuler demo

# two worker processes, each given whole test files (--dist loadfile: a file's module fixtures are built once): most
# of a cold run is numba compiling kernels, one thread per process, so two compile side by side
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile tests

# the published models tests and benchmarks run on (SmolLM2-135M-Instruct, Gemma 3 270M), into .cache/models
models:
	$(PYTHON) scripts/fetch_models.py

# llama-cpp-python's source distribution (vendor/llama.cpp: its vocabulary files and tokenizer tests, read by
# tests/test_llama_cpp_vocabs.py), unpacked into .cache/llama-cpp-python
llama-src:
	mkdir -p .cache/llama-cpp-python
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: --dest .cache llama-cpp-python
	tar xzf "$$(ls -t .cache/llama_cpp_python-*.tar.gz | head -n 1)" -C .cache/llama-cpp-python --strip-components=1

check: $(STAMP)
	$(BIN)/nanoeuler check

bench: $(STAMP)
	$(BIN)/python bench/train_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
