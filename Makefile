# Two commands matter: `make test` and `make run`. Both bootstrap .venv on first use. `make test` runs the
# static gate (`make lint`: ruff, mypy, lint-imports; configured in pyproject.toml) before the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint pythons unit integration soak run bench clean test-clients test-slurm

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "torch==2.13.0 first: the tested version, so .[dev] keeps it (CPU-only where pip's index has a CPU wheel, else the CUDA build, ~3 GB)"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	$(PY) -m pip install --progress-bar on -e '.[dev]'   # dev includes the trainer extra (torch, numpy, safetensors, tqdm)
	touch $(STAMP)

test: lint pythons  # tests/unit, tests/integration and tests/clients' reproductions (tests marked clients skip: make test-clients; tests/slurm skips: make test-slurm)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The daemon claims Python 3.10-3.13 (pyproject): mypy as the oldest and the newest, and tests/unit on each, in venvs
# without torch (.venv-notorch-X.Y; interpreters from pyenv, a missing one is skipped with a line). ~1 min each.
PYTHONS ?= 3.10 3.13
pythons:
	@for v in $(PYTHONS); do bash tests/notorch.sh $$v --mypy || exit 1; done

unit:  # no torch, no subprocess: runs in a venv without torch (.venv-notorch-X.Y of $(PYTHON); docs/development.md)
	bash tests/notorch.sh $(PYTHON)

integration: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/integration

# Opt-in, not part of `make test`: every cell of the setup matrix and SOAK_SEEDS more chaos seeds (docs/reliability.md),
# about 40 minutes on two busy cores. As root: the matrix mounts tmpfs roots (without root those cells skip).
SOAK_SEEDS ?= 5
soak: $(STAMP)
	OMP_NUM_THREADS=1 FSDP_MATRIX=full FSDP_CHAOS_SOAK=$(SOAK_SEEDS) $(PY) -m pytest -q -s -ra --durations=0 \
		tests/integration/test_matrix.py tests/integration/test_chaos.py

RUN_CONFIG ?= deploy/examples/demo.toml
# deploy/foreground.py hands the terminal to the supervisor: Ctrl+C stops the job gracefully and `make run`
# exits with the supervisor's status (0), not make's "Interrupt" (130).
run: $(STAMP)
	@echo "watch it from another shell:"
	@echo "  $(VENV)/bin/fsdp-supervisor status -c $(RUN_CONFIG)"
	@echo "  $(VENV)/bin/fsdp-supervisor logs -c $(RUN_CONFIG) -f"
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) deploy/foreground.py $(VENV)/bin/fsdp-supervisor run -c $(RUN_CONFIG)

# Opt-in tier, not part of `make test`: the real torchtitan and Accelerate under the supervisor (docs/clients.md).
# Their own venv, so `make test` never installs them; torch pinned first (and again beside them) so that
# neither moves torch off the tested version.
CLIENTS_VENV ?= .venv-clients
CLIENTS_PY := $(CLIENTS_VENV)/bin/python
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
CLIENT_PACKAGES := torchtitan==0.3.0 accelerate==1.16.0 lightning==2.6.6 transformers==5.17.0

$(CLIENTS_STAMP): pyproject.toml
	test -x $(CLIENTS_PY) || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_PY) -m pip install --progress-bar on torch==2.13.0
	$(CLIENTS_PY) -m pip install --progress-bar on torch==2.13.0 $(CLIENT_PACKAGES)
	$(CLIENTS_PY) -m pip install --progress-bar on -e '.[dev]'
	touch $(CLIENTS_STAMP)

test-clients: $(CLIENTS_STAMP)
	OMP_NUM_THREADS=1 $(CLIENTS_PY) -m pytest -q -ra -m clients tests/clients

# Opt-in tier, not part of `make test`: the sbatch script on a real Slurm cluster on this host (root; installs
# Debian's slurm-wlm and munge when missing; deploy/slurm/local-cluster.sh starts and stops the daemons). ~10 min.
test-slurm: $(STAMP)
	OMP_NUM_THREADS=1 FSDP_TEST_SLURM=1 $(PY) -m pytest -q -ra --durations=0 -m slurm tests/slurm

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .venv-notorch-* deploy/examples/ckpts deploy/examples/.fsdp-supervisor deploy/examples/best \
		deploy/examples/demo .pytest_cache bench-results.json \
		.ruff_cache .mypy_cache .import_linter_cache
