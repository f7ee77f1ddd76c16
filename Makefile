# Front door: `make test` and `make run` work on a fresh clone (they create .venv when missing).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip

.PHONY: install test run bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints-cpu.txt
	$(PIP) install -q -c constraints-cpu.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Random order (pytest-randomly); the seed is printed so that a failing order can be replayed with
# `make test SEED=<seed>`.
SEED ?= $(shell date +%s)
test: $(STAMP)
	@echo "test order: random, seed $(SEED) (replay: make test SEED=$(SEED))"
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --randomly-seed=$(SEED)

# The main job: sample a grid of digits with the built-in model.
run: $(STAMP)
	$(BIN)/preheat sample --n 16 --out samples.png

clean:
	rm -rf $(VENV) build *.egg-info
