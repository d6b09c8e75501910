"""Process-level tuning that every regime benefits from alike.

glibc returns large freed blocks to the kernel (mmap/munmap beyond a dynamic threshold, heap
trimming), so the next step's activations are page-faulted in again. On a virtual machine each
4 KiB page's fault is costly enough to slow an emulated training step of a small CNN markedly
(benchmarks/RESULTS.md, figure F16). Raising the two thresholds keeps freed memory for reuse,
as the jemalloc/tcmalloc preloads PyTorch's CPU tuning guide recommends do. Disabled with
LOWPREC_MALLOPT=0; a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["tune_cpu_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_done = False


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the heap (once per process). Returns True if applied."""
    global _done
    if _done:
        return True
    if os.environ.get("LOWPREC_MALLOPT", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
        # glibc caps the mmap threshold at 32 MiB: a bigger block (a batch-256 activation of a
        # CNN: 51 MB) would still be mmapped and faulted in afresh on every allocation (slower
        # than a block from the heap: benchmarks/RESULTS.md, figure F17). No mmap at all: every
        # block from the heap, at some cost in peak memory (figure F18)
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and ok
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
