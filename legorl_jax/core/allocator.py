"""Process-wide malloc settings for processes that run XLA on CPU.

XLA on CPU allocates each program run's buffers with malloc and frees them
when the run ends. glibc serves every block over 32 MB with a fresh mmap, and
blocks of threads other than the main one from per-thread arenas that also
fall back to mmap, so every engine step (a KV window of tens of MB per layer)
and every learner step faults its buffers' pages in again. Measured on the
engine's decode attention (qwen3-0.6b shape, 8 rows, 1,024 positions): 28 ms
per layer with glibc's defaults, 8 ms with one arena and no mmap, the same
work. The price is that freed memory stays in the heap for reuse instead of
going back to the system: a process's resident size stays near its peak.

Only glibc is tuned; elsewhere this does nothing. `LEGORL_MALLOC=default`
keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Free space at the heap's top beyond this goes back to the system; below it stays for reuse.
_TRIM_BYTES = 2**31 - 1


def keep_freed_memory() -> bool:
    """Serves all threads from one heap with no per-block mmap; True if applied.

    Call first thing in a process, before any thread exists: arenas that
    threads have already made stay in use.
    """
    if os.environ.get("LEGORL_MALLOC", "") == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the running process, which has glibc loaded
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_BYTES))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def release_freed_memory() -> None:
    """Returns the heap's free pages to the system (glibc's malloc_trim).

    With `keep_freed_memory` the heap keeps what a one-off job freed (a
    checkpoint's read buffers, a load's conversions); call this after such
    jobs so the process's resident size is what it holds, not its peak.
    """
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
