# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The one place the torch build is pinned: the CPU wheel this project is tested with.
TORCH_PIN := torch==2.13.0
EXTRAS := dev
# DeepSpeed compiles a shared-memory extension on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/accord/torch_extensions

.PHONY: test lint typecheck unit demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check '$(TORCH_PIN)' -e '.[$(EXTRAS)]'
	touch $@

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(VENV)/.installed
	$(BIN)/mypy --strict src

unit: $(VENV)/.installed
	rm -f .coverage .coverage.*
	$(BIN)/coverage run -m pytest $(PYTEST_ARGS)
	$(BIN)/coverage combine -q
	$(BIN)/coverage report

test: lint typecheck unit

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) .coverage .coverage.* .mypy_cache .ruff_cache .pytest_cache
