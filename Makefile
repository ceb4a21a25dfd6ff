# Two entry points, each doing all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.kerasdist-installed
# The set-up installs exactly the versions in the lock (every package, transitive ones included,
# with hashes), so a fresh clone installs the same set on any day. pyproject.toml keeps ranges for
# users. `make lock` refreshes the lock on purpose; nothing else changes it.
LOCK := requirements/lock.txt
NO_DEPS_LOCK := requirements/no-deps.txt
# The next Keras, installed beside the venv (not into it) for the keras-nightly check of `make test`.
NIGHTLY_LOCK := requirements/keras-nightly.txt
# scikit-learn's digits for the optimization tests, also beside the venv (requirements/test-data.in says why).
TEST_DATA_LOCK := requirements/test-data.txt
LOCK_PYTHON := 3.11
LOCK_PLATFORM := x86_64-manylinux_2_28
TOOLS := $${KERASDIST_CACHE:-$$HOME/.cache/kerasdist}/tools
UV := $(TOOLS)/bin/uv
# uv installs the lock: 26 s for lock.txt on this machine kind against pip's 165 s (pip spends 90 s of it compiling
# every module's bytecode; uv leaves that to the first import of each module, and installs wheels in parallel).
# Itself pinned with its hash (requirements/uv.txt) and kept in the tools cache; pip stays the fallback.
UV_PIN := requirements/uv.txt
INSTALL_UV := test -x $(UV) || { $(PYTHON) -m venv $(TOOLS) && $(TOOLS)/bin/pip -q install --require-hashes -r $(UV_PIN); }
UV_INSTALL = $(UV) pip install -q --compile-bytecode --python $(PY) --require-hashes --no-deps $(FIND_LINKS)
# Horovod (distribute="horovod") is built from source with TF + Gloo; the wheel is cached in
# $${KERASDIST_CACHE:-~/.cache/kerasdist}/wheels, so only the first set-up builds it (~4-6 min).
# HOROVOD=0 skips it (the horovod plugin is then listed as unavailable and its tests skip).
HOROVOD ?= 1
# The CPU-only torch build is not on PyPI; this machine kind keeps it in /opt/wheels (pip's find-links).
TORCH_WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS))
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-extended bench bench-horovod bench-torch venv lock check-lock test-latest test-keras-nightly fuzz clean

$(STAMP): pyproject.toml $(LOCK) $(NO_DEPS_LOCK) $(NIGHTLY_LOCK) $(TEST_DATA_LOCK) $(UV_PIN) .ci/build_horovod.sh .ci/check_lock.py .ci/system_packages.sh
	bash .ci/system_packages.sh
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	$(PY) .ci/check_lock.py --platform-only $(LOCK_PYTHON)
	$(INSTALL_UV) || echo "uv could not be installed: pip installs the lock (slower)" >&2
	for lock in $(LOCK) $(NO_DEPS_LOCK); do \
	    { test -x $(UV) && $(UV_INSTALL) -r $$lock; } || { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip -q; \
	        $(PIP) install --require-hashes --no-deps $(FIND_LINKS) -r $$lock; } || exit 1; \
	done
	$(PIP) install --no-deps --no-build-isolation -e .
	for side in keras-nightly:$(NIGHTLY_LOCK) test-data:$(TEST_DATA_LOCK); do \
	    dir=$(VENV)/$${side%%:*}; lock=$${side#*:}; rm -rf $$dir; \
	    { test -x $(UV) && $(UV_INSTALL) --target $$dir -r $$lock; } || \
	        $(PIP) install --require-hashes --no-deps --target $$dir -r $$lock || exit 1; \
	done
	if [ "$(HOROVOD)" = 1 ]; then bash .ci/build_horovod.sh $(PY); fi
	$(PY) .ci/check_lock.py $(LOCK) $(NO_DEPS_LOCK)
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	KERASDIST_CPU_REPLICAS=2 $(PY) examples/two_line.py

# The suite runs on 2 pytest-xdist workers (this machine kind has 2 cores; most tests wait on child
# processes), a test file to a worker so that a module's shared launch runs once, in the order tests/conftest.py
# gives (LONGEST_FIRST; xdist would otherwise start the files with the most tests first). PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2
PYTEST_ARGS := -ra $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The extended tier only: the tests marked `extended` (tests/conftest.py's EXTENDED_HERE lists the rest), each a
# multi-process repeat of what `make test` checks another way. Not part of make test; .ci/run runs both.
test-extended: $(STAMP)
	KERASDIST_EXTENDED_TESTS=1 $(PY) -m pytest $(PYTEST_ARGS) -m extended

# `pip freeze` of the venv against the lock (also run at the end of every set-up).
check-lock: $(STAMP)
	$(PY) .ci/check_lock.py $(LOCK) $(NO_DEPS_LOCK)

# Refresh the lock on purpose: the newest versions that pyproject.toml's ranges allow today.
lock:
	$(INSTALL_UV)
	$(UV) pip compile pyproject.toml requirements/setup-extras.in --extra cpu --extra jax --extra test --extra torch \
	    --constraint requirements/constraints.in $(FIND_LINKS) \
	    --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) --generate-hashes \
	    --custom-compile-command 'make lock' --upgrade -o $(LOCK)
	$(UV) pip compile requirements/no-deps.in --no-deps \
	    --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) --generate-hashes \
	    --custom-compile-command 'make lock' --upgrade -o $(NO_DEPS_LOCK)
	$(UV) pip compile requirements/keras-nightly.in --no-deps \
	    --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) --generate-hashes \
	    --custom-compile-command 'make lock' --upgrade -o $(NIGHTLY_LOCK)
	$(UV) pip compile requirements/test-data.in --no-deps \
	    --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) --generate-hashes \
	    --custom-compile-command 'make lock' --upgrade -o $(TEST_DATA_LOCK)

# Not part of `make test`: the suite on the newest versions the ranges allow today, and on the
# next Keras (keras-nightly in place of keras). Each in its own venv.
# test-latest runs on the newest Python the packages support here (JAX >= 0.11 needs Python >= 3.12); there the
# registry's torch is the CUDA build (with NVIDIA's wheels, about 3 GB), which also runs on CPU.
LATEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12) $(PYTHON))

test-latest:
	$(MAKE) --no-print-directory fresh-venv-test VENV_X=.venv-latest KERAS_PKG= VENV_PYTHON=$(LATEST_PYTHON) TORCH_PIN=

test-keras-nightly:
	$(MAKE) --no-print-directory fresh-venv-test VENV_X=.venv-keras-nightly KERAS_PKG=keras-nightly

VENV_PYTHON ?= $(PYTHON)
TORCH_PIN ?= torch==2.13.0+cpu
fresh-venv-test:
	rm -rf $(VENV_X) && $(VENV_PYTHON) -m venv $(VENV_X)
	$(VENV_X)/bin/python -m pip -q install --upgrade pip
	$(VENV_X)/bin/python -m pip -q install --upgrade --upgrade-strategy eager $(FIND_LINKS) -e '.[cpu,jax,test,torch]' $(TORCH_PIN)
	$(VENV_X)/bin/python -m pip -q install --no-deps -r requirements/no-deps.in
	# The registry's CUDA torch brings triton (GPU kernels), whose import segfaults in a process that has
	# imported TensorFlow 2.21 first (as the test process does); torch runs without it on CPU.
	if [ -z "$(TORCH_PIN)" ]; then $(VENV_X)/bin/python -m pip -q uninstall -y triton || true; fi
	if [ -n "$(KERAS_PKG)" ]; then $(VENV_X)/bin/python -m pip -q uninstall -y keras && \
	    $(VENV_X)/bin/python -m pip -q install --pre --no-deps $(KERAS_PKG); \
	else rm -rf $(VENV_X)/keras-nightly && $(VENV_X)/bin/python -m pip -q install --require-hashes --no-deps \
	    --target $(VENV_X)/keras-nightly -r $(NIGHTLY_LOCK); fi
	rm -rf $(VENV_X)/test-data && $(VENV_X)/bin/python -m pip -q install --require-hashes --no-deps \
	    --target $(VENV_X)/test-data -r $(TEST_DATA_LOCK)
	if [ "$(HOROVOD)" = 1 ]; then $(VENV_X)/bin/python -m pip -q install setuptools wheel cloudpickle cffi && \
	    bash .ci/build_horovod.sh $(VENV_X)/bin/python; fi
	$(VENV_X)/bin/python -m pip freeze | grep -iE '^(keras|keras-nightly|tensorflow-cpu|jax|numpy|onnxruntime|protobuf)==' || true
	$(VENV_X)/bin/python -m pytest $(PYTEST_ARGS) -p no:cacheprovider

# The differential fuzzer's long tier (docs/fuzzing.md): jobs drawn from FUZZ_SEED on, every word, until
# FUZZ_MINUTES end; the coverage table goes to docs/fuzzing-table.md, each defect's script to FUZZ_OUT/defects.
FUZZ_MINUTES ?= 30
FUZZ_SEED ?= 1000
fuzz: $(STAMP)
	FUZZ_MINUTES=$(FUZZ_MINUTES) FUZZ_SEED=$(FUZZ_SEED) $(PY) tests/fuzz/long.py

bench: $(STAMP)
	$(PY) bench/bench_mirrored.py

bench-horovod: $(STAMP)
	$(PY) bench/bench_horovod.py

bench-torch: $(STAMP)
	$(PY) bench/bench_torch.py --rounds 3

clean:
	rm -rf $(VENV) .venv-latest .venv-keras-nightly build *.egg-info
