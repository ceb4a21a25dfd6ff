#!/usr/bin/env bash
# Build horovod 0.28.1 (TensorFlow + Gloo, MPI when present) for the given Python and install it.
#
#   .ci/build_horovod.sh [PYTHON]        # default: .venv/bin/python
#
# Horovod's last release does not build against TF >= 2.16 unchanged: its optional XLA ops
# (horovod/tensorflow/xla_mpi_ops.cc) include headers that moved in newer XLA. We build the
# PyPI sdist with that one source file left out of horovod/tensorflow/CMakeLists.txt.
# The wheel is cached outside the repository, keyed by what it was built against (see KEY), so
# re-runs only reinstall it (seconds). Nothing from horovod is written into the repo.
set -euo pipefail

HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
PY="${1:-.venv/bin/python}"
CACHE="${KERASDIST_CACHE:-$HOME/.cache/kerasdist}/wheels"
PIP=("$PY" -m pip --disable-pip-version-check -q)

log() { echo "[build_horovod] $*" >&2; }

meta_version() {  # version of an installed distribution, or empty; never imports the package
  "$PY" - "$@" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(metadata.version(name)); break
    except metadata.PackageNotFoundError:
        pass
EOF
}

TF_VERSION="$(meta_version tensorflow-cpu tensorflow)"
[ -n "$TF_VERSION" ] || { log "TensorFlow is not installed for $PY; install kerasdist first (pip install -e .)"; exit 1; }
PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
ARCH="$(uname -m)"
if command -v mpicxx >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  CONTROLLERS="gloo-mpi"; MPI_FLAG=(HOROVOD_WITH_MPI=1)
else
  CONTROLLERS="gloo"; MPI_FLAG=(HOROVOD_WITHOUT_MPI=1)
fi
# The key names everything the wheel was built against: the TensorFlow distribution and version it
# compiled against, Python, machine, controllers, the C++ compiler, and this script (its patch).
TF_DIST=tensorflow; [ -n "$(meta_version tensorflow-cpu)" ] && TF_DIST=tensorflow-cpu
CXX_VERSION="$( (${CXX:-c++} -dumpfullversion 2>/dev/null || ${CXX:-c++} -dumpversion 2>/dev/null || echo none) | head -n1)"
SCRIPT_HASH="$(sha256sum "$0" | cut -c1-8)"
KEY="horovod-${HOROVOD_VERSION}_${TF_DIST}-${TF_VERSION}_${PY_TAG}_${ARCH}_${CONTROLLERS}_cxx-${CXX_VERSION}_build-${SCRIPT_HASH}"
WHEEL_DIR="$CACHE/$KEY"

installed_ok() {  # right version installed, and its TF op library exists (no TF import needed)
  [ "$(meta_version horovod)" = "$HOROVOD_VERSION" ] || return 1
  "$PY" - "$KEY" <<'EOF'
import glob, os, sys
from importlib import metadata
dist = metadata.distribution("horovod")
base = dist.locate_file("horovod/tensorflow")
marker = dist.locate_file("horovod/.kerasdist-build")
ok = glob.glob(os.path.join(str(base), "mpi_lib*.so")) and os.path.exists(str(marker)) \
    and open(str(marker)).read().strip() == sys.argv[1]
sys.exit(0 if ok else 1)
EOF
}

if installed_ok; then
  log "horovod $HOROVOD_VERSION ($KEY) already installed"
  exit 0
fi

wheel="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  log "building horovod $HOROVOD_VERSION for TF $TF_VERSION ($CONTROLLERS); about 6 minutes on 2 cores"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "${PIP[@]}" install setuptools wheel  # build requirements (no build isolation: must see TF)
  "${PIP[@]}" download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  cmakelists="$src/horovod/tensorflow/CMakeLists.txt"
  grep -q 'xla_mpi_ops.cc' "$cmakelists" || { log "xla_mpi_ops.cc not found in $cmakelists"; exit 1; }
  sed -i '/xla_mpi_ops\.cc/d' "$cmakelists"
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "${MPI_FLAG[@]}" \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$work/dist" "$src"
  mkdir -p "$WHEEL_DIR"
  built="$(ls "$work"/dist/horovod-*.whl)"
  cp "$built" "$WHEEL_DIR/.partial" && mv "$WHEEL_DIR/.partial" "$WHEEL_DIR/$(basename "$built")"
  wheel="$WHEEL_DIR/$(basename "$built")"
  log "cached $wheel"
else
  log "using cached $wheel"
fi

"${PIP[@]}" install --force-reinstall --no-deps "$wheel"
"${PIP[@]}" install "$wheel"  # horovod's own dependencies (cloudpickle, psutil, pyyaml, cffi)
"$PY" - "$KEY" <<'EOF'
import sys
from importlib import metadata
open(str(metadata.distribution("horovod").locate_file("horovod/.kerasdist-build")), "w").write(sys.argv[1])
EOF
installed_ok || { log "installed horovod lacks its TensorFlow op library"; exit 1; }
log "installed horovod $HOROVOD_VERSION ($KEY)"
