# lowprec: `make demo` runs the main job on its embedded default; `make test` runs the tests.
# Both create .venv when it is missing and install what is needed. torch is pinned here:
# torch==2.13.0 is a CPU build on this machine's disk; a bare `torch` pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml setup.py src/lowprec/_qkernel.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=68" wheel
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q --no-build-isolation -e ".[data,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowprec demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/quantize.py

clean:
	rm -rf $(VENV) build src/*.egg-info src/lowprec/*.so
