# make train: create .venv (with the test extra: about 2 GB), install, run the default training. make test: the whole
# suite. make lint: ruff. Users install with `pip install .` instead (README, Quick start).
PY ?= python3
# pytest-xdist workers for make test: one pytest process keeps ~1.4 of CI's 2 cores busy; 2 workers measured
# 81 s faster (15:27 against 16:48). Tests that share a fixture run on one worker (tests/conftest.py ONE_WORKER).
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
