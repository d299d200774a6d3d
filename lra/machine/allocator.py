"""glibc's allocator, set up for training on the CPU: freed memory stays in the process.

By default glibc gives blocks between 128 KiB and 32 MiB back to the kernel when they are freed
(mmap'd blocks, or the heap's top trimmed), so every training step faults its activations back
in, page by page. In the LRA encoder at N = 4K, batch 8 (2-core AMD EPYC) that was 30,000 page
faults and 0.1 s of system time per MoBA step of 0.7 s (full attention, N = 2K: 9,700 per step);
with blocks up to 32 MiB kept on an untrimmed heap (``keep_freed_memory``), about 2,000. The
process keeps the footprint it reaches every step anyway (its peak RSS is unchanged).

Blocks of 32 MiB and more (glibc's ceiling for that setting) are still mapped per use: at batch 32
and N = 4K every activation [32, 4096, 64] is one, and a step faulted 500,000-700,000 pages in
(2-3 s of system time in a MiTA step of 3.8 s, in a pass-through model's step of 2.8 s); MiTA's
attention at N = 64K 49,000 per step (0.18 s of 0.86 s). ``keep_all_freed_memory`` takes every
block from the heap and never unmaps one: no faults after the first steps, but the heap keeps
the holes between blocks of different sizes, so the resident set grows above what the tensors
need (+7% to +80% at batch 32, N = 4K, Top-k 2.6x). lra-bench therefore measures a point's peak
memory in its warm-up, with big blocks mapped per use, and times it with every block kept
(lra/bench/measure.py); ``return_freed_memory`` goes back between the two.

For blocks of a GiB and more, keeping them takes two more glibc settings, which lra-bench's point
processes have:
- glibc's per-thread cache of small blocks is off (GLIBC_TUNABLES, read when a process starts:
  ``without_thread_cache``). torch allocates with posix_memalign, which splits a small remainder
  off each block it hands out. In the thread cache, such a remainder counts as in use, so the
  freed block beside it can neither merge with its neighbours nor be handed out again to a
  request of its own size.
- With the cache off, the heap's top is never trimmed. With the 1 GiB threshold, a step whose
  freed blocks leave more than that at the top hands them back at each free, and the next step
  faults them in again. A process with the cache on (lra-run) keeps the threshold: its heap piles
  up freed blocks either way, less when trimmed (a 1.25 GiB block allocated and freed 14 times:
  9 GiB resident trimmed, 16 GiB untrimmed; 1.5 GiB with the cache off).
Informer's step on the Text model at N = 2K, batch 16 (Intel Xeon, 2 threads) took 9.3-15.9 s with
4.4 million faults and 8-19 s of system time a step; with both settings, 5.7-5.8 s with at most
20 faults. The cache off changed nothing measurable in the steps of MiTA, MoBA and full attention
on that model at N = 1K, batch 8 (medians within 1%).

Applied by lra-run, lra-bench's points and scripts/step_compare.py. LRA_MALLOC_TUNING=0 turns all
of it off (to measure its effect); LRA_MALLOC_TUNING=all keeps every block for training too (lra-run
at long rows and big batches: faster, with the larger resident set in the run's peak memory).
Elsewhere than glibc (musl, macOS, Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Dict, Mapping

from ..errors import UserError

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
TRIM_THRESHOLD = 1 << 30
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, 64 << 20))
NEVER_TRIM = -1  # mallopt's int, read by glibc as the largest size_t
GLIBC_MMAP_MAX = 65536  # glibc's default number of mapped blocks
NO_THREAD_CACHE = "glibc.malloc.tcache_count=0"  # a GLIBC_TUNABLES entry

_applied = None
_keep_all = False


SETTING_VALUES = ("0", "1", "all")


def setting() -> str:
    """LRA_MALLOC_TUNING (default 1); a value outside SETTING_VALUES is a UserError (on any platform)."""
    value = os.environ.get("LRA_MALLOC_TUNING", "1")
    if value not in SETTING_VALUES:
        raise UserError(f"LRA_MALLOC_TUNING={value!r}: use 0 (glibc's defaults), 1 (freed blocks up to 32 MiB "
                        "kept, the default) or all (every freed block kept)")
    return value


def _libc():
    """glibc where this process may tune it (Linux, LRA_MALLOC_TUNING not 0), else None."""
    if not sys.platform.startswith("linux") or setting() == "0":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    return libc


def keep_freed_memory() -> bool:
    """Keep freed blocks up to 32 MiB (once per process; with LRA_MALLOC_TUNING=all every block);
    whether the setting is in effect."""
    global _applied
    chosen = setting()  # checked on every call: a bad value is the user's to hear about
    if _applied is None:
        libc = _libc()
        _applied = libc is not None and all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
        if _applied and chosen == "all":
            keep_all_freed_memory()
    return _applied


def keep_all_freed_memory() -> bool:
    """Take every block from the heap from now on (none mapped; in a process started with the thread
    cache off, the heap's top never trimmed: none given back); whether it took."""
    global _keep_all
    libc = _libc()
    if keep_freed_memory() and libc is not None and libc.mallopt(M_MMAP_MAX, 0) == 1:
        _keep_all = True
        if thread_cache_off():  # untrimmed, a heap whose freed blocks cannot merge grows without end
            libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    return _keep_all


def return_freed_memory() -> bool:
    """Undo ``keep_all_freed_memory``: big blocks mapped per use again, the heap's top trimmed past
    1 GiB again and its free pages handed back (malloc_trim); whether there was anything to undo."""
    global _keep_all
    libc = _libc()
    if not _keep_all or libc is None or setting() == "all":  # LRA_MALLOC_TUNING=all: kept for good
        return False
    libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    libc.malloc_trim(0)
    _keep_all = False
    return True


def trim() -> bool:
    """Hand every free page of the heaps back to the kernel (glibc's malloc_trim(0)), so that the
    resident set holds only what live blocks use; whether it ran (not on musl, macOS or Windows).
    Independent of LRA_MALLOC_TUNING: it changes no setting."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True


def without_thread_cache(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` with glibc's per-thread cache off for a process started with it (GLIBC_TUNABLES, its
    other entries kept); ``env`` as it is where this process may not tune glibc (``_libc``)."""
    if _libc() is None:
        return dict(env)
    kept = [entry for entry in env.get("GLIBC_TUNABLES", "").split(":")
            if entry and not entry.startswith("glibc.malloc.tcache_count=")]
    return {**env, "GLIBC_TUNABLES": ":".join(kept + [NO_THREAD_CACHE])}


def thread_cache_off() -> bool:
    """Whether this process was started with glibc's per-thread cache off."""
    return NO_THREAD_CACHE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def setting_now() -> str:
    """The setting in effect in this process now, in a few words."""
    if _keep_all:
        return "every freed block kept" + (", thread cache off" if thread_cache_off() else "")
    return "freed blocks up to 32 MiB kept" if _applied else "system default"


def describe(benchmark: bool = False) -> str:
    """What the records say about the allocator of the process that measures (this one, or a child
    with its environment); ``benchmark``: a point of lra-bench, which switches between the two."""
    if _libc() is None:
        return "system default"
    if setting() == "all":
        return ("glibc, every freed block kept (LRA_MALLOC_TUNING=all, lra/machine/allocator.py)"
                + ("; peak memory includes the heap's holes" if benchmark else ""))
    if benchmark:
        return ("glibc: peak memory from the warm-up with freed blocks up to 32 MiB kept, "
                "timed runs with every freed block kept and the heap untrimmed, "
                "the thread cache off (lra/machine/allocator.py)")
    return "glibc, freed blocks up to 32 MiB kept (lra/machine/allocator.py)"
