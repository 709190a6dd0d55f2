# The two commands a fresh machine needs (see README):
#   make demo   install, prepare the bundled digits store, train the demo DiT, write the sample grid,
#               then test it: held-out loss and how many generated digits a classifier recognises
#   make test   install with the test extras, check lint / format / types, run the test suite
#   make lint   ruff (lint + format check) and mypy
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint

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

# Each run gets its own directory (outputs/demo/version_N); `last` is the newest run's last checkpoint.
demo: $(VENV)/.installed-demo
	$(BIN)/dit-lightning fit --config configs/demo.yaml
	$(BIN)/dit-lightning test --config configs/demo.yaml --ckpt_path last

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

test: install lint
	$(BIN)/python -m pytest -q
