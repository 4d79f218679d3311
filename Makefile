# make train: create .venv, install, run the default training. make test: the whole suite. make lint: ruff.
PY ?= python3
# pytest-xdist workers for make test: the suite is single-threaded (tiny models; TPU compiles), so 2 workers
# halve its wall time on CI's 2 cores. Tests that share a fixture run on one worker (tests/conftest.py ONE_WORKER).
TEST_WORKERS ?= 2
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: venv train test test-fast lint
venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/shardtrain train meshes/demo.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup
