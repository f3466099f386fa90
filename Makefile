# nanoeuler: every target creates (or reuses) the local virtual environment .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test check bench install models clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/nanoeuler demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# the published models tests and benchmarks run on (SmolLM2-135M-Instruct, Gemma 3 270M), into .cache/models
models:
	$(PYTHON) scripts/fetch_models.py

check: $(STAMP)
	$(BIN)/nanoeuler check

bench: $(STAMP)
	$(BIN)/python bench/train_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
