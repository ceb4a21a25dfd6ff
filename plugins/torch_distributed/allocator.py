"""glibc's allocator set to keep freed host memory for reuse in a CPU training process.

A Keras ``fit`` step on torch allocates and frees tens of megabytes (activations, gradients, the batch, the
gradient buffer). glibc hands blocks above its mmap threshold (at most 32 MiB, adapted at run time) to
``mmap``/``munmap`` and trims the heap's free top above twice that threshold, so each step gets fresh pages
from the kernel again: 1,400-2,600 page faults and 3.7-6 ms of system time a step in bench/bench_torch.py's
set-up (1.6-2.3 ms with the thresholds raised). With the thresholds below, blocks up to 64 MiB come from the
heap and up to 512 MiB of freed heap is kept, as torch's own CPU launcher gets by preloading jemalloc or tcmalloc.

Left alone when the user chose an allocator (``LD_PRELOAD``) or glibc's tunables (``GLIBC_TUNABLES``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``), on a libc
other than glibc, and with ``keep_freed_memory=False``.
"""

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 512 << 20
USER_SETTINGS = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied = None


def keep_freed_memory(environ=None):
    """Set glibc's thresholds once per process; returns why not (a sentence) or None when they are set."""
    global _applied
    if _applied is None:
        _applied = _why_not(os.environ if environ is None else environ) or _set_thresholds() or ""
    return _applied or None


def _set_thresholds():
    """None when set, else why not. An older glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2
    (32 MiB on 64-bit): 32 MiB there."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library, glibc here
        trimmed = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError) as exc:
        return f"glibc's mallopt could not be called ({type(exc).__name__}: {exc})"
    return None if trimmed and mapped else "glibc's mallopt refused the thresholds"


def status():
    """"kept" once the thresholds are set, "not asked" before :func:`keep_freed_memory`, else why not."""
    return "not asked" if _applied is None else _applied or "kept"


def _why_not(environ):
    chosen = [name for name in USER_SETTINGS if environ.get(name)]
    if chosen:
        return f"the user set {', '.join(chosen)}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    return None
