# Two entry points, each doing all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kerasdist-installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[test]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	KERASDIST_CPU_REPLICAS=2 $(PY) examples/two_line.py

test: $(STAMP)
	$(PY) -m pytest -ra

bench: $(STAMP)
	$(PY) bench/bench_mirrored.py

clean:
	rm -rf $(VENV) build *.egg-info
