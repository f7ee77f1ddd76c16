# Front door: `make test` and `make run` work on a fresh clone (they create .venv when missing).
# The test path runs Python >= 3.12 with jax 0.11.2, the lent GPU machines' versions
# (scripts/find_python.sh picks python3.12, python3.13 or pyenv's); where only an older Python
# exists, `make run` still works on Python >= 3.10 with the jax that Python gets.
PY ?= $(shell sh scripts/find_python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
GPU_STAMP := $(VENV)/.installed-gpu
PIP := $(BIN)/python -m pip

.PHONY: install test test-slow run bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# True when .venv's Python can run the test path (constraints-cpu.txt pins jax 0.11.2: Python >= 3.12).
TESTABLE := $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'

# `make run`: the runtime alone (jax, flax, pillow, ...: no torch, no test stack). On Python >= 3.12
# with the test path's pins, so that `make test` later adds to this .venv without moving a version.
$(RUN_STAMP): $(BIN)/python pyproject.toml constraints-cpu.txt
	@if $(TESTABLE); then $(PIP) install -q -c constraints-cpu.txt -e .; \
	else echo "$$($(BIN)/python -V): installing preheat alone (make run); make test needs Python >= 3.12"; \
	$(PIP) install -q -e .; fi
	touch $(RUN_STAMP)

# `make test`: the test stack (torch, diffusers, the servers, ...) added to the same .venv in one
# resolve; it holds the runtime too, so `make run` after it installs nothing.
$(STAMP): $(BIN)/python pyproject.toml constraints-cpu.txt
	@$(TESTABLE) || { echo "make test needs Python >= 3.12 (jax 0.11.2, as on the GPU machines); .venv has $$($(BIN)/python -V): install python3.12, then make clean test"; exit 2; }
	$(PIP) install -q -c constraints-cpu.txt -e ".[test]"
	touch $(STAMP) $(RUN_STAMP)

# `make test-slow` adds the GPU-only test extra (the CUDA jax plugin for deviceless GPU compiles):
# those tests skip, saying why, without it.
$(GPU_STAMP): $(STAMP)
	$(PIP) install -q -c constraints-cpu.txt -e ".[test,test-gpu]"
	touch $(GPU_STAMP)

install: $(STAMP) browser

# The playground page's tests drive headless Chromium (Debian's chromium + chromium-driver). Installed
# here when missing and running as root with apt; otherwise those tests skip, saying why.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	echo "installing chromium and chromium-driver (apt) for the playground page's browser tests"; \
	{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; }; } || \
	echo "could not apt-get install chromium chromium-driver: the browser tests will skip"; \
	else echo "no chromium/chromedriver and no root apt-get: the browser tests will skip"; fi

# Random order (pytest-randomly); the seed is printed so that a failing order can be replayed with
# `make test SEED=<seed>`. `make test` is the suite a developer runs (under 20 minutes on 2 cores);
# `make test-slow` runs the rest, the tests marked slow or ray (a Ray cluster, fresh-process torch
# compile caches, a clean venv, full-size layers, multi-process races, the parity grids' cases beyond
# make test's covering subset: tests/_support/tiers.py); CI (.ci/run) runs both.
SEED ?= $(shell date +%s)
PYTEST := $(BIN)/python -m pytest -n 2 --dist loadfile -q --randomly-seed=$(SEED)
test: $(STAMP) browser
	@$(TESTABLE) || { echo "make test needs Python >= 3.12 (jax 0.11.2, as on the GPU machines); .venv has $$($(BIN)/python -V): install python3.12, then make clean test"; exit 2; }
	@echo "test order: random, seed $(SEED) (replay: make test SEED=$(SEED))"
	$(PYTEST) -m "not slow and not ray"

test-slow: $(GPU_STAMP) browser
	@$(TESTABLE) || { echo "make test-slow needs Python >= 3.12 (jax 0.11.2, as on the GPU machines); .venv has $$($(BIN)/python -V): install python3.12, then make clean test"; exit 2; }
	@echo "slow tests, order: random, seed $(SEED) (replay: make test-slow SEED=$(SEED))"
	$(PYTEST) -m "slow or ray"

# The main job: a grid of digits from the built-in class model, then prompts -> digits from the
# built-in text-to-image model (a tiny StableDiffusionPipeline trained by preheat train-text-digits).
run: $(RUN_STAMP)
	$(BIN)/preheat sample --n 16 --out samples.png
	$(BIN)/preheat sample builtin:text-digits --n 10 --out prompts.png --prompt "a zero" --prompt "a one" \
	  --prompt "a two" --prompt "a 3" --prompt "a bold four" --prompt "a thin five" --prompt "a six" \
	  --prompt "a 7" --prompt "an eight" --prompt "a bold nine"

clean:
	rm -rf $(VENV) build *.egg-info
