# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The one place the torch build is pinned: the CPU wheel this project is tested with.
TORCH_PIN := torch==2.13.0
EXTRAS := dev
# DeepSpeed compiles a shared-memory extension on first use. The build records the venv's
# paths, so each venv keeps its own (and `make clean` removes it with the venv).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: test lint typecheck docs unit demo bench clean coverage

# Benchmarks get a venv of their own: the peers (Lightning, Accelerate) never enter .venv.
BENCH_VENV := .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin

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

# DeepSpeed's extension is compiled here once, so no test's time limit has to cover it.
$(VENV)/.deepspeed-built: $(VENV)/.installed
	$(BIN)/python scripts/warm_deepspeed.py
	touch $@

# pytest-xdist runs one worker per core; a file's tests stay on one worker, so a module's
# fixtures (a reference fit, a fork server that imported torch) are made once.
PYTEST_WORKERS ?= auto
# src/ and tests/ are compiled to bytecode first: the suite starts a few hundred Python
# processes, and where PYTHONDONTWRITEBYTECODE is set each would compile them again.
unit: $(VENV)/.installed $(VENV)/.deepspeed-built
	rm -f .coverage .coverage.*
	$(BIN)/python -m compileall -q src tests
	$(BIN)/coverage run -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)
	$(BIN)/coverage combine -q
	$(BIN)/coverage report

# The lanes below measure branch coverage too, each with its own venv's coverage, into data
# files beside unit's .coverage; every venv runs this checkout's src/, so the paths agree.
# `make coverage` adds the lanes' files to .coverage and prints the total.
coverage: $(VENV)/.installed
	@if ls .coverage.* >/dev/null 2>&1; then $(BIN)/coverage combine -q --append; fi
	$(BIN)/coverage report

# The documentation site (docs/, mkdocs.yml), built offline; --strict fails on any warning.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# DeepSpeed's extension compiles while ruff, mypy and the docs build run (two jobs; each
# one's output printed whole when it ends), then the tests.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(VENV)/.deepspeed-built lint typecheck docs
	@$(MAKE) --no-print-directory unit

demo: $(VENV)/.installed
	$(BIN)/python examples/demo.py

# The Horovod lane: its own venv, with a Horovod wheel compiled once against TORCH_PIN and
# cached outside the repository (scripts/build_horovod_wheel.sh, 10-20 minutes on two
# cores), so later runs only install it. Its tests start real horovodrun jobs over gloo.
HVD_VENV := .venv-horovod
HVD_BIN := $(HVD_VENV)/bin
HOROVOD_VERSION := 0.28.1
# The wheel links against torch's C++ library: one cache directory per torch pin.
HOROVOD_WHEELS ?= $(HOME)/.cache/accord/wheels/$(subst ==,,$(TORCH_PIN))

.PHONY: test-horovod clean-horovod

$(HVD_BIN)/python:
	$(PYTHON) -m venv $(HVD_VENV)

$(HVD_VENV)/.installed: pyproject.toml Makefile scripts/build_horovod_wheel.sh | $(HVD_BIN)/python
	$(HVD_BIN)/pip install -q --disable-pip-version-check '$(TORCH_PIN)' -e '.[test]'
	HOROVOD_VERSION=$(HOROVOD_VERSION) scripts/build_horovod_wheel.sh $(HVD_BIN)/python '$(HOROVOD_WHEELS)'
	$(HVD_BIN)/pip install -q --disable-pip-version-check '$(HOROVOD_WHEELS)'/horovod-$(HOROVOD_VERSION)-*.whl
	touch $@

test-horovod: $(HVD_VENV)/.installed
	$(HVD_BIN)/coverage run -m pytest tests/strategies/test_horovod.py $(PYTEST_ARGS)

clean-horovod:
	rm -rf $(HVD_VENV)

# The XLA lane: torch-xla 2.9.0 needs torch==2.9.0 exactly (not TORCH_PIN; from PyPI that
# is a CUDA build, about 7 GB with its nvidia-* packages), so it gets a venv of its own,
# with accord installed without dependencies next to it. Its tests run on torch_xla's CPU
# runtime: one process, one thread per XLA device.
XLA_VENV := .venv-xla
XLA_BIN := $(XLA_VENV)/bin
XLA_PINS := 'torch==2.9.0' 'torch-xla==2.9.0'
# The venv ends at about 7 GB, and pip holds its downloads (about 4 GB more) until the
# install is over: 11 GB at the peak, measured. `make xla-disk` says whether there is room.
XLA_DISK_GB := 12

.PHONY: test-xla clean-xla xla-disk

xla-disk:
	@scripts/check_disk.sh $(XLA_DISK_GB) "the XLA lane's install ($(XLA_VENV) and pip's downloads)" \
		$(CURDIR) "$${TMPDIR:-/tmp}"

$(XLA_BIN)/python:
	$(PYTHON) -m venv $(XLA_VENV)

$(XLA_VENV)/.installed: pyproject.toml Makefile | $(XLA_BIN)/python
	@$(MAKE) --no-print-directory xla-disk
	$(XLA_BIN)/pip install -q --disable-pip-version-check $(XLA_PINS) 'pytest>=8' \
		'pytest-timeout>=2.2' 'coverage[toml]>=7.10' 'lightning-utilities>=0.10' \
		'typing-extensions>=4.7' 'tqdm>=4.60'
	$(XLA_BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_BIN)/coverage run -m pytest tests/strategies/test_xla.py $(PYTEST_ARGS)

clean-xla:
	rm -rf $(XLA_VENV)

# The SLURM lane: scripts/slurm_cluster.sh installs slurm-wlm and munge when missing (needs
# root), starts a one-node cluster on this machine from ci/slurm/slurm.conf, and stops the
# daemons it started afterwards, whether the tests passed or not.
SLURM_CLUSTER := scripts/slurm_cluster.sh

.PHONY: test-slurm

test-slurm: $(VENV)/.installed
	$(SLURM_CLUSTER) start || { $(SLURM_CLUSTER) stop; exit 1; }
	SLURM_CONF=$(abspath ci/slurm/slurm.conf) $(BIN)/coverage run -m pytest tests/slurm \
		$(PYTEST_ARGS) || { $(SLURM_CLUSTER) stop; exit 1; }
	$(SLURM_CLUSTER) stop

# The constraints file holds torch at TORCH_PIN while pip resolves the peers' requirements.
# accord comes with its deepspeed extra, for bench_checkpoint.py's deepspeed_stage_2 rows.
$(BENCH_VENV)/.installed: pyproject.toml benchmarks/requirements.txt Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	echo '$(TORCH_PIN)' > $(BENCH_VENV)/constraints.txt
	$(BENCH_BIN)/pip install -q --disable-pip-version-check -c $(BENCH_VENV)/constraints.txt \
		'$(TORCH_PIN)' -e '.[deepspeed]' -r benchmarks/requirements.txt
	touch $@

# The bench venv's own DeepSpeed extension (its build records the venv's paths), built once.
BENCH_EXTENSIONS := $(abspath $(BENCH_VENV))/torch_extensions

$(BENCH_VENV)/.deepspeed-built: $(BENCH_VENV)/.installed
	TORCH_EXTENSIONS_DIR=$(BENCH_EXTENSIONS) $(BENCH_BIN)/python scripts/warm_deepspeed.py
	touch $@

bench: $(BENCH_VENV)/.installed $(BENCH_VENV)/.deepspeed-built
	TORCH_EXTENSIONS_DIR=$(BENCH_EXTENSIONS) $(BENCH_BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .coverage .coverage.* .mypy_cache .ruff_cache .pytest_cache
