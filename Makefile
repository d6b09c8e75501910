# lowprec: `make demo` runs the main job on its embedded default; `make test` runs the tests.
# Both create .venv when it is missing and install what is needed. torch is pinned here:
# torch==2.13.0 is a CPU build on this machine's disk; a bare `torch` pulls a multi-GB CUDA build,
# and constraints.txt holds it there while the extras (lightning, transformers) are installed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: demo test install bench bench-gpu clean system-deps

# Debian packages the tests use: Chromium + ChromeDriver (the report is checked in a real
# headless browser) and the Fashion-MNIST files. Installed once when apt-get can run.
SYSTEM_STAMP := $(VENV)/.system-deps

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard src/lowprec/numerics/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=68" wheel
	$(PIP) install -q -c constraints.txt "$(TORCH)"
	$(PIP) install -q -c constraints.txt --no-build-isolation -e ".[data,test,integrations,ray,export,completion,results,docs]"
	touch $(STAMP)

$(SYSTEM_STAMP): | $(STAMP)
	@if command -v chromedriver >/dev/null 2>&1 && [ -d /usr/share/datasets/fashion-mnist ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -q chromium chromium-driver dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver \
		  dataset-fashion-mnist >/dev/null)) || echo "warning: could not install chromium"; \
	else echo "note: chromium/chromedriver not installed; the browser test will be skipped"; fi
	touch $(SYSTEM_STAMP)

system-deps: $(SYSTEM_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowprec compare --out runs/demo --resume

test: $(STAMP) $(SYSTEM_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/summation.py
	$(PIP) install -q -c constraints.txt --no-build-isolation -e ".[bench]" && $(PY) benchmarks/peers.py

# On a machine lent a GPU, with that image's own python and torch (no venv, no network): the
# GPU measurements (about 8 minutes on an H200), then the device-independent tests on CUDA.
# Results in $(GPU_OUT)/gpu.json and gpu.md. That image has no gfloat (test_quantize_exact
# imports it): carry its wheel (the device tool's README says how) or its tests are not collected.
GPU_OUT ?= benchmarks/gpu
bench-gpu:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu.py --out $(GPU_OUT)
	PYTHONPATH=src timeout 150 $(PYTHON) -m pytest -q -p no:cacheprovider --device cuda \
		tests/numerics/test_quantize_exact.py tests/numerics/test_stochastic.py \
		tests/training/test_loss_scale.py tests/training/test_optim.py \
		tests/training/test_emulation.py || true

clean:
	rm -rf $(VENV) build src/*.egg-info src/lowprec/*.so src/lowprec/numerics/*.so
