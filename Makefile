# Every target creates .venv on first use, so a fresh clone needs nothing but python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny.yaml
ARGS ?=

.PHONY: install train test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: install
	$(BIN)/python -m lumen_jax.train --config $(CONFIG) $(ARGS)

# Two pytest workers (the machine's two cores), a test file's tests on one worker (its module fixtures computed once).
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

clean:
	rm -rf $(VENV) runs .cache
