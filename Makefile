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
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=2 --max-restarts=0 \
		-m trainer --checkpoint-dir demo-ckpts --steps 200 --save-every 25

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench

clean:
	rm -rf $(VENV) demo-ckpts .pytest_cache bench-results.json
