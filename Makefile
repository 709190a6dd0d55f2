# The two commands a fresh machine needs (see README):
#   make demo   install, prepare the bundled digits store, train the demo DiT, write the sample grid,
#               then test it: held-out loss and how many generated digits a classifier recognises;
#               ARGS="--trainer.max_steps 200 ..." are overrides for the fit (and its test)
#   make test   install with the test extras, check lint / format / types, run the test suite
#   make lint   ruff (lint + format check) and mypy
# On a machine with one CUDA GPU (docs/benchmarks/README.md):
#   make gpu-check      every CUDA path and the real-size benchmarks in one command (< 8 minutes): installs what
#                       it needs, writes docs/benchmarks/*_<gpu>.{md,csv}, prints the summary
#   make gpu-check-dry  the same script at tiny sizes on the CPU (< 3 minutes), into outputs/gpu-check-dry
#   make gpu-wheels     wheels of the pure-Python dependencies a bare PyTorch image lacks, into .whl/
#                       (for GPU machines without a package index: carry .whl/ along, gpu-check installs them)
#   make bench          the CPU benchmark tables of docs/benchmarks/ (long: tens of minutes)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
GPU_CHECK_ARGS ?=
ARGS ?=
GPU_WHEELS ?= jsonargparse docstring-parser typeshed-client importlib-resources importlib-metadata diffusers
WHEEL_PYTHON ?= 3.12

.PHONY: install demo test lint bench gpu-check gpu-check-dry gpu-wheels

# One venv; each target installs the extras it needs (again when pyproject.toml changes).
$(VENV)/.installed-demo: pyproject.toml
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

$(VENV)/.installed-test: pyproject.toml
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed-test

# Each run gets its own directory (outputs/demo/version_N). The test step measures the run this fit
# trained, by the path the fit records, not the shared outputs/demo/last.ckpt another run may move.
demo: $(VENV)/.installed-demo
	@run=$$(mktemp) && trap 'rm -f "$$run"' EXIT && set -x && \
	$(BIN)/dit-lightning fit --config configs/demo.yaml $(ARGS) --checkpoint.last_path_file "$$run" && \
	$(BIN)/dit-lightning test --config configs/demo.yaml $(ARGS) --ckpt_path "$$(cat "$$run")"

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# -n 2: two pytest-xdist workers, one per core of the CI machine; --dist loadfile keeps each test file on
# one worker, so a module fixture (the digits store, a distributed run) is built once.
# --durations: the slowest tests, to keep the suite inside CI's time limit
test: install lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

bench: install
	$(BIN)/python benchmarks/bench_optimizations.py --device cpu
	$(BIN)/python benchmarks/bench_sampling.py --threads 1 --repeats 3
	$(BIN)/python benchmarks/bench_loader.py
	$(BIN)/python benchmarks/bench_step.py
	$(BIN)/python benchmarks/bench_communication.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_own_data.py  # MNIST: 5 recipes x 3 seeds (docs/benchmarks/recipes_mnist.md)
	@echo "not run: bench_shrink.py needs a trained teacher checkpoint (its command: docs/benchmarks/shrink_cpu.md)"

# No install prerequisite: the script finds (or installs) an interpreter with the dependencies itself,
# inside its time budget, and uses a machine image's own PyTorch when it has one.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

gpu-check-dry: install
	$(BIN)/python benchmarks/gpu_check.py --dry-run $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PYTHON) \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
