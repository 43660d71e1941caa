PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test lint demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned here (and only here): an unpinned torch would pull a multi-GB CUDA build.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,dev]"

test: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy --strict src/

demo: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/aiowsync demo

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
