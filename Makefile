# The two commands a fresh machine needs (see README):
#   make demo   install, prepare the bundled digits store, train the demo DiT, write the sample grid,
#               then test it: held-out loss and how many generated digits a classifier recognises
#   make test   install with the test extras, check lint / format / types, run the test suite
#   make lint   ruff (lint + format check) and mypy
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint

$(BIN)/dit-lightning: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/dit-lightning

demo: install
	$(BIN)/dit-lightning fit --config configs/demo.yaml
	$(BIN)/dit-lightning test --config configs/demo.yaml --ckpt_path outputs/demo/checkpoints/last.ckpt

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

test: install lint
	$(BIN)/python -m pytest -q
