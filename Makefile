# Two commands matter: `make test` and `make run`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test unit integration run bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0   # explicit pin first: a bare "torch" can pull a multi-GB CUDA build
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests

unit: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not integration" tests

integration: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m integration tests

run: $(STAMP)
	@echo "watch it from another shell:"
	@echo "  $(VENV)/bin/fsdp-supervisor status -c deploy/examples/demo.toml"
	@echo "  $(VENV)/bin/fsdp-supervisor logs -c deploy/examples/demo.toml -f"
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/fsdp-supervisor run -c deploy/examples/demo.toml

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench

clean:
	rm -rf $(VENV) deploy/examples/ckpts deploy/examples/.fsdp-supervisor .pytest_cache bench-results.json
