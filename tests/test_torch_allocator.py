"""distribute="data_parallel" on torch keeps freed host memory for reuse (plugins/torch_distributed/allocator.py):
a training step's blocks come back from the heap, not as fresh pages from the kernel."""

import importlib.util
import json
import platform

import pytest

from kerasdist_plugins.torch_distributed import allocator
from tests.helpers import child_env, python, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (pip install torch)")

#: a 40 MiB tensor made and freed ten times (above glibc's largest adapted mmap threshold, 32 MiB), with and
#: without keep_freed_memory(): the bytes glibc had mmapped while the first was held, the heap's free bytes once
#: it was freed (mallinfo2), and the page faults of the last nine
FAULTS = """
import ctypes, ctypes.util, json, resource, sys
import torch
from kerasdist_plugins.torch_distributed import allocator
why = allocator.keep_freed_memory() if sys.argv[1] == "kept" else "not asked"
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(10 << 20)
    mmapped = mmapped if faults else libc.mallinfo2().hblkhd
    del block
    free_in_heap = free_in_heap if faults else libc.mallinfo2().fordblks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("RESULT", json.dumps({"why": why, "status": allocator.status(), "faults": sum(faults[1:]),
                            "mmapped": mmapped, "free_in_heap": free_in_heap}))
"""
BLOCK = 40 << 20


def _faults(mode, **env):
    """The child's figures, without an allocator choice of this machine's (LD_PRELOAD, MALLOC_*, ...)."""
    environment = {k: v for k, v in child_env(**env).items() if k not in allocator.USER_SETTINGS or k in env}
    out = run(python("-c", FAULTS, mode), timeout=120, env=environment).stdout
    return json.loads(out.split("RESULT", 1)[1])


def _glibc_has_mallinfo2():
    version = platform.libc_ver()[1]
    return allocator._why_not({}) is None and tuple(int(p) for p in version.split(".")[:2]) >= (2, 33)


@pytest.mark.skipif(not _glibc_has_mallinfo2(), reason="glibc 2.33 or later on Linux only (mallinfo2)")
def test_kept_freed_memory_takes_no_fresh_pages_for_a_repeated_block():
    plain, kept = _faults("plain"), _faults("kept")
    assert kept["why"] is None and kept["status"] == "kept" and plain["status"] == "not asked"
    assert plain["mmapped"] >= BLOCK and plain["free_in_heap"] < BLOCK, plain  # glibc: mmap, then munmap
    assert kept["mmapped"] < BLOCK and kept["free_in_heap"] >= BLOCK, kept  # from the heap, and kept there
    pages = 9 * BLOCK // 4096  # every byte of the nine later blocks, page by page
    assert kept["faults"] < pages // 4, kept  # reused (at most one block's pages again)


def test_a_users_allocator_choice_is_left_alone():
    assert _faults("kept", MALLOC_TRIM_THRESHOLD_="131072")["status"] == "the user set MALLOC_TRIM_THRESHOLD_"
    assert "LD_PRELOAD" in allocator._why_not({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    assert "GLIBC_TUNABLES" in allocator._why_not({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})


def test_keep_freed_memory_is_a_checked_spec_option():
    code = ("import kerasdist\nprint('OFF', kerasdist.data_parallel(keep_freed_memory=False).keep_freed_memory)\n"
            "kerasdist.data_parallel(keep_freed_memory='yes')")
    out = run(python("-c", code), timeout=60, env=child_env(KERAS_BACKEND="torch"), check=False).stdout
    assert "OFF False" in out and "keep_freed_memory='yes'" in out, out[-2000:]
