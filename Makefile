# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; any other spec may pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_EXTRAS := ray,torch,console,tensorboard,plot
TEST_EXTRAS := ray,torch,console,trackers,plot,dev

# Recipes run with PYTHONDONTWRITEBYTECODE empty, which Python treats as unset (the export below): each
# module's bytecode (.pyc) is cached by the first process that imports it. Where the environment sets
# it, every Ray worker and subprocess of the tests compiled the same modules again at each start
# (a pytest run outside make still does). pip installs without compiling: it would compile the venv's
# 22,500 files one at a time (80 s of CPU), most of which a run never imports.
export PYTHONDONTWRITEBYTECODE =
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile

.PHONY: demo test test-core lint bench bench-peers soak chaos install install-test install-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Install the CPU torch first when the venv has none; an installed torch is kept as it is.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.torch
	$(PIP_INSTALL) -e ".[$(DEMO_EXTRAS)]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PIP_INSTALL) -e ".[$(TEST_EXTRAS)]"
	touch $@

# The peer system of tests/peers and benchmarks/bench_peers.py: siiRL 0.2.0 without its pins (they would
# downgrade tensordict and pull GPU stacks), plus what its metric modules import (psutil is a core dep).
PEERS_SPEC ?= siirl==0.2.0
PEERS_DEPS := pandas scipy loguru packaging

# Its wheel also installs top-level `tests`, `examples` and `docs` packages into site-packages; the
# regular package `tests` there shadows our `tests/` in Ray workers (ModuleNotFoundError:
# tests.test_ray_backend), so those files of siiRL's RECORD are removed again.
PEERS_STRAY := tests examples docs

# The verl peer (tests/peers/test_verl_*.py, benchmarks/bench_verl.py): verl 0.9.1 without its pins
# (they would downgrade tensordict and pull GPU stacks), plus what its metric modules
# (verl/trainer/ppo/metric_utils.py, verl/utils/metric/utils.py) import: omegaconf and transformers
# in verl's range. Its wheel's top-level `tests` and `scripts` packages are removed as siiRL's are.
VERL_SPEC ?= verl==0.9.1
VERL_DEPS := omegaconf "transformers>=5.5.3,<5.11,!=5.6.0"
VERL_STRAY := tests scripts

# $(call remove-stray,DIST,TOPS): delete the files of distribution DIST under the top-level names TOPS,
# and those directories once no other distribution's files are left in them.
remove-stray = $(BIN)/python -c "import importlib.metadata as md, pathlib, shutil; \
	d = md.distribution('$(1)'); tops = '$(2)'.split(); \
	[pathlib.Path(d.locate_file(f)).unlink(missing_ok=True) for f in d.files if f.parts[0] in tops]; \
	roots = [pathlib.Path(d.locate_file(t)) for t in tops]; \
	[shutil.rmtree(r) for r in roots if r.is_dir() \
	 and not any(p.is_file() and '__pycache__' not in p.parts for p in r.rglob('*'))]"

# Both peers in one pip call each (without their pins, then what their metric modules import).
$(VENV)/.installed-peers: $(VENV)/.installed-test
	$(PIP_INSTALL) --no-deps "$(PEERS_SPEC)" "$(VERL_SPEC)"
	$(PIP_INSTALL) $(PEERS_DEPS) $(VERL_DEPS)
	$(call remove-stray,siirl,$(PEERS_STRAY))
	$(call remove-stray,verl,$(VERL_STRAY))
	touch $@

install: $(VENV)/.installed-demo
install-test: $(VENV)/.installed-test
install-peers: $(VENV)/.installed-peers

# The GRPO demo of examples/grpo (docs/demo.md); its options through ARGS: make demo ARGS="--steps 20"
demo: install
	$(BIN)/python -m examples.grpo $(ARGS)

# Two pytest workers, one test file each at a time (a file's Ray instance and fixtures stay in one
# process): most tests wait on Ray, subprocesses or sockets, so two run in about 55% of the time.
test: install-test install-peers
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The core in seconds: no Ray, no torch, nothing slow (the markers of pyproject.toml; conftest.py)
test-core: install-test
	$(BIN)/python -m pytest -n 2 -m "not slow and not ray and not torch"

# mypy types the modules listed in pyproject.toml's [tool.mypy] files.
lint: install-test
	$(BIN)/ruff check src tests benchmarks examples conftest.py
	$(BIN)/ruff format --check src tests benchmarks examples conftest.py
	$(BIN)/mypy

# install-peers: benchmarks/bench_peers.py is one of benchmarks/bench_*.py
bench: install-test install-peers
	$(BIN)/python benchmarks/run.py

bench-peers: install-peers
	$(BIN)/python benchmarks/bench_peers.py
	$(BIN)/python benchmarks/bench_verl.py

# Not part of `make test` (which runs soaks of 120 to 1,200 steps and 50 steps of chaos): the long runs
# of docs/reliability.md.
soak: install-test
	$(BIN)/python benchmarks/soak.py

chaos: install-test
	$(BIN)/python benchmarks/chaos.py --seed 0 --steps 200

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache .mypy_cache
