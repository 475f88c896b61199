"""Where a CPU worker's step tensors get their memory.

A step's activations are tensors of megabytes to hundreds of megabytes (a prefill of 2,048
tokens: 25 MB for the gate|up product of a small model, more for the LM head's rows), made and
freed at every layer. glibc's malloc serves a block above its mmap threshold (128 KiB, rising
with what was freed up to 32 MiB) with a fresh mapping and gives it back when it is freed, and
trims the heap's free top above its trim threshold: so each of those tensors is new memory to the
kernel, and every one of its pages faults on first touch, inside the matmul or the norm that
writes it. Measured on a 2-core AVX-512 host: mixed 25-50 MB allocations, each filled once, took
69 ms a round under the defaults and 10 ms with the heap kept.

Once the model and the KV cache are in place (the KV cache is a mapping of its own, and loading
frees large temporaries that should go back), a CPU worker raises both thresholds so the step
tensors come from, and return to, a heap that stays mapped: the process keeps the memory of its
largest step, as a caching allocator does. A user who sets glibc's malloc settings
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) or preloads another
allocator keeps their own.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("troupe.worker")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3           # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30        # blocks below 1 GiB come from the heap
TRIM_THRESHOLD = 2 << 30        # the heap's free top is kept up to 2 GiB
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_applied = False


def keep_step_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); whether they are set.
    Not on another C library, with another allocator preloaded, or where the user set glibc's
    malloc settings."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _applied:
        log.debug("glibc refused the heap thresholds: step tensors keep malloc's defaults")
    return _applied
