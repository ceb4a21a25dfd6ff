#!/usr/bin/env bash
# System packages the test suite needs beside the venv, installed when missing (Debian/Ubuntu, as root):
#   qemu-user   runs onnxruntime under an AVX2-only CPU model (qemu-x86_64 -cpu Haswell), so the onnx-int8
#               test proves the file is right on CPUs without AVX-512/VNNI whatever CPU runs the suite.
#   slurmctld slurmd slurm-client munge iproute2
#               a real one-node Slurm for tests/test_slurm_real.py, started by each test in a private network
#               namespace (loopback only); ~3 MB, about 20 s to install.
# Without root or apt the tests that need a package skip locally, naming the install line (they fail under CI=true).
set -euo pipefail
missing=()
command -v qemu-x86_64 >/dev/null 2>&1 || missing+=(qemu-user)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
command -v srun >/dev/null 2>&1 || missing+=(slurm-client)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[system_packages] installing ${missing[*]}" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "[system_packages] missing ${missing[*]}: sudo apt-get install -y ${missing[*]} (the tests that need them skip)" >&2
fi
