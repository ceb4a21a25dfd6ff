# Two entry points, each doing all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kerasdist-installed
# Horovod (distribute="horovod") is built from source with TF + Gloo; the wheel is cached in
# $${KERASDIST_CACHE:-~/.cache/kerasdist}/wheels, so only the first set-up builds it (~4-6 min).
# HOROVOD=0 skips it (the horovod plugin is then listed as unavailable and its tests skip).
HOROVOD ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test bench bench-horovod venv clean

$(STAMP): pyproject.toml .ci/build_horovod.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[cpu,jax,test]'
	# The QAT oracle test runs TFMOT (in its own process): tf-keras requires the `tensorflow` wheel,
	# which would install over tensorflow-cpu, so both come without dependencies (the test extra has theirs).
	$(PIP) install --no-deps 'tf-keras>=2.20,<2.22' 'tensorflow-model-optimization==0.8.1'
	if [ "$(HOROVOD)" = 1 ]; then bash .ci/build_horovod.sh $(PY); fi
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	KERASDIST_CPU_REPLICAS=2 $(PY) examples/two_line.py

test: $(STAMP)
	$(PY) -m pytest -ra

bench: $(STAMP)
	$(PY) bench/bench_mirrored.py

bench-horovod: $(STAMP)
	$(PY) bench/bench_horovod.py

clean:
	rm -rf $(VENV) build *.egg-info
