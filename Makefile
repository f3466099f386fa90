# nanoeuler: every target creates (or reuses) the local virtual environment .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test check bench install clean

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

check: $(STAMP)
	$(BIN)/nanoeuler check

bench: $(STAMP)
	$(BIN)/python bench/train_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
