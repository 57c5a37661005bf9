"""The C heap of a process whose forwards run on the host (a CPU replica).

A CPU forward allocates its activations (megabytes each) and frees them before the next
one. By default glibc gives such blocks back to the kernel (as separate mappings above
its mmap threshold, and by trimming the heap's top once 128 KiB of it are free), and the
next forward takes them back as fresh pages, each zeroed by the kernel on its first
touch: 3,000-6,000 minor page faults a forward of a 25 M-parameter LLaDA at batch 1,
30,000-60,000 at batch 8, about a tenth of the forward's time on the project's 2-core VM
(docs/benchmarks.md). With blocks up to the largest mmap threshold glibc allows taken
from the heap, and the heap's free top kept, the same pages serve every forward.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30  # the heap's free top kept, up to this


def keep_freed_memory() -> bool:
    """Set the process's glibc heap to keep what forwards free (for every thread); False
    where the C library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("the C library has no mallopt: freed host memory goes back to the kernel as it will")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
