# Every target sets up .venv itself, so `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install -q --disable-pip-version-check
# The CPU build of PyTorch, installed first so that nothing pulls a CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test bench zoo dist clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(PIP) $(TORCH)
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PIP) -e '.[lightning,demo,report]'
	touch $@

# Keras runs on TensorFlow, torch and JAX in the tests: all three backends are installed (CPU builds), and
# XGBoost's CPU build (never with the xgboost extra: the two builds overwrite each other's module).
$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) -e '.[dev,lightning,keras,xgboost-cpu,dask,transformers,s3,report,tensorboard,demo]' tensorflow-cpu 'jax[cpu]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/tripwire demo

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.test
	$(BIN)/python -m benchmarks.run

# Every zoo case in its longer run, Keras on TensorFlow, torch and JAX: the table goes to benchmarks/results/zoo.md,
# each rule's record to zoo.json and from there into docs/rules.md.
zoo: $(VENV)/.test
	$(BIN)/python -m benchmarks.zoo.run
	$(BIN)/python -m tripwire.core.rulesdoc --zoo benchmarks/results/zoo.json > docs/rules.md

# A wheel of this repository in dist/, rules.yaml and xgboost.yaml inside: `pip install 'dist/<wheel>[lightning]'`.
dist: | $(BIN)/python
	$(BIN)/python -m pip wheel -q --disable-pip-version-check --no-deps -w dist .

clean:
	rm -rf $(VENV) runs build dist *.egg-info
