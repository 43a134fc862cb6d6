# `make train` and `make test` each set up .venv first when it is missing or stale.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/gpt_tiny.yaml
OUTPUT ?= runs/gpt_tiny
TRAIN_ARGS ?=

.PHONY: install train test test-fast plan clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jaxspeed train $(CONFIG) --output $(OUTPUT) $(TRAIN_ARGS)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

plan: $(STAMP)
	$(VENV)/bin/jaxspeed plan configs/gpt_tp2_zero3.yaml --cpu-devices 8

clean:
	rm -rf $(VENV) runs .pytest_cache
