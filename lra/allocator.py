"""glibc's allocator, set up for training on the CPU: freed memory stays in the process.

By default glibc gives blocks between 128 KiB and 32 MiB back to the kernel when they are freed
(mmap'd blocks, or the heap's top trimmed), so every training step faults its activations back
in, page by page. In the LRA encoder at N = 4K, batch 8 (2-core AMD EPYC) that was 30,000 page
faults and 0.1 s of system time per MoBA step of 0.7 s (full attention, N = 2K: 9,700 per step);
with blocks up to 32 MiB kept on an untrimmed heap, about 2,000. The process keeps the footprint
it reaches every step anyway (its peak RSS is unchanged). Blocks over 32 MiB (glibc's ceiling for
this setting), such as full attention's score matrices at long N, are still mapped per use.

Applied by lra-run, lra-bench's points and scripts/step_compare.py; LRA_MALLOC_TUNING=0 turns it off
(to measure its effect). Elsewhere than glibc (musl, macOS, Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

_applied = None


def _mallopt():
    """glibc's mallopt where this process may use it (Linux, LRA_MALLOC_TUNING not 0), else None."""
    if not sys.platform.startswith("linux") or os.environ.get("LRA_MALLOC_TUNING", "1") == "0":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (once per process); whether they are in effect."""
    global _applied
    if _applied is None:
        mallopt = _mallopt()
        _applied = mallopt is not None and all(mallopt(param, value) == 1 for param, value in SETTINGS)
    return _applied


def describe() -> str:
    """What the records say about the allocator of the process that measures (this one, or a child
    with its environment)."""
    return "system default" if _mallopt() is None else "glibc, freed blocks up to 32 MiB kept (lra/allocator.py)"
