# make train: create .venv, install, run the default training. make test: the whole suite. make lint: ruff.
PY ?= python3
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
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow"
