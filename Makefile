# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; any other spec may pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_EXTRAS := ray,torch,plot
TEST_EXTRAS := ray,torch,plot,dev

.PHONY: demo test lint bench install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Install the CPU torch first when the venv has none; an installed torch is kept as it is.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[$(DEMO_EXTRAS)]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[$(TEST_EXTRAS)]"
	touch $@

install: $(VENV)/.installed-demo
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/rlmetrics demo

test: install-test
	$(BIN)/python -m pytest

lint: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: install-test
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
