"""Timing and memory inside one benchmark point's process (the child that lra.bench.point runs).

Timing: CUDA events on a GPU, the wall clock (perf_counter) on the CPU; warm-up runs of every
mode first, then as many timed repeats as the point's time budget allows (at least one of each
mode, or the point is over budget). Memory: ``max_memory_allocated`` on a GPU; on the CPU the peak
resident set (VmHWM) of the child minus its resident set before the point was built (the baseline:
the interpreter and torch), both recorded.

On the CPU the two are measured under different allocator settings (lra/machine/allocator.py): the warm-up
runs with big blocks mapped per use, so the resident set follows what the tensors need, and its
peak is the point's memory; the timed runs keep every freed block on the heap (no page faults,
which at batch 32 and N = 4K took half of a step's time), after one more untimed run of each mode
that grows the heap (when the budget has room for it). A timed run that runs out of memory that
way is timed again with the blocks mapped; ``allocator`` in each mode's timings says which setting
timed it.
"""
from __future__ import annotations

import resource
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from ..machine import allocator


class OverBudget(Exception):
    """The point cannot finish its warm-up and one timed run of each mode within its budget."""


def proc_status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM, VmSize) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                # "VmRSS:     12345 kB"
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Set this process's peak resident set (VmHWM) back to its resident set now (Linux 4.0 and
    later: /proc/self/clear_refs, value 5); whether it took. Lets one process measure the peaks of
    several pieces of work in turn."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return proc_status_mb("VmHWM") <= proc_status_mb("VmRSS") + 1.0


def cap_address_space(extra_gb: float) -> None:
    """Let the process map at most ``extra_gb`` GiB more than it maps now (RLIMIT_AS).

    An allocation past the cap fails with an exception in this process, so running out of memory
    is recorded as ``oom`` instead of waking the kernel's OOM killer on a shared machine.
    """
    limit = int((proc_status_mb("VmSize") + extra_gb * 1024) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


class ResidentCap:
    """The memory cap of a process that runs one piece of work after another (the interleaved
    backends of lra/bench/interleaved.py, CPU): each may bring the resident set to at most
    ``extra_gb`` GiB above what the process held when the cap was set.

    ``renew`` before each piece sets RLIMIT_AS to the address space mapped now plus what is left
    under that ceiling, and resets the peak resident set. Address space that earlier work left
    mapped but not resident (heap pages handed back by malloc_trim, the holes of a heap that kept
    every block) then costs the next piece nothing. Those holes are mapped already, so a piece that
    touches them again passes RLIMIT_AS unseen: ``check`` after the piece compares its peak
    resident set with the ceiling, and a piece past it ran out of memory too. Whether a piece fits
    then depends on what it holds resident, not on which pieces ran before it.
    """

    def __init__(self, extra_gb: Optional[float]):
        self.extra_gb = extra_gb
        self.base_mb = proc_status_mb("VmRSS") if extra_gb else 0.0  # no cap: nothing read from /proc
        self.ceiling_mb = self.base_mb + extra_gb * 1024 if extra_gb else None
        self.peak_reset = False

    def renew(self) -> None:
        if self.ceiling_mb is None:
            return
        self.peak_reset = reset_peak_rss()
        left_mb = max(self.ceiling_mb - proc_status_mb("VmRSS"), 0.0)
        limit = int((proc_status_mb("VmSize") + left_mb) * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))

    def check(self, what: str) -> None:
        """MemoryError when the peak resident set since ``renew`` passed the ceiling (where the
        peak could be reset: Linux 4.0 and later)."""
        if self.ceiling_mb is None or not self.peak_reset:
            return
        peak_mb = proc_status_mb("VmHWM")
        if peak_mb > self.ceiling_mb:
            raise MemoryError(f"{what} brought the resident set to {peak_mb:,.0f} MiB, past the memory cap "
                              f"of {self.extra_gb:g} GiB above the {self.base_mb:,.0f} MiB "
                              f"held once set up (out of memory)")


def is_oom(err: BaseException) -> bool:
    """Whether an exception is an allocation failure (CPU allocator, CUDA, or Python's own)."""
    if isinstance(err, MemoryError):
        return True
    if torch.cuda.is_available() and isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("can't allocate memory", "cannot allocate memory", "out of memory", "std::bad_alloc")
    )


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def summarize(times: List[float]) -> Dict[str, object]:
    """Median and spread of repeated timings, in seconds."""
    median = statistics.median(times)
    return {
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        # (max - min) / median: 0.05 means the repeats agree within 5 %
        "spread": (max(times) - min(times)) / median if median > 0 else 0.0,
        "repeats": len(times),
        "times_s": [round(t, 6) for t in times],
    }


def warm(modes: Dict[str, Callable[[], None]], runs: int, slowest: Dict[str, float], deadline: float,
         device: torch.device, what: str) -> None:
    """``runs`` untimed runs of every mode, noting the slowest of each; OverBudget past ``deadline``."""
    for name, fn in modes.items():
        for _ in range(runs):
            slowest[name] = max(slowest[name], timed(fn, device))
            if time.perf_counter() > deadline:
                raise OverBudget(f"{what} {name} run took {slowest[name]:.1f} s and used up the budget")


def timed_runs(
    modes: Dict[str, Callable[[], None]], repeats: int, slowest: Dict[str, float], deadline: float,
    device: torch.device,
) -> Dict[str, List[float]]:
    """Up to ``repeats`` timed runs of each mode (interleaved), cut to what the budget allows, judged
    from the slowest run seen so far; fewer than one timed run of each mode raises OverBudget."""
    times: Dict[str, List[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        for name, fn in modes.items():
            if times[name] and time.perf_counter() + slowest[name] > deadline:
                continue
            if not times[name] and time.perf_counter() + slowest[name] > deadline:
                raise OverBudget(f"one {name} run takes {slowest[name]:.1f} s; no time left in the budget")
            took = timed(fn, device)
            times[name].append(took)
            slowest[name] = max(slowest[name], took)
        if time.perf_counter() > deadline:
            break
    missing = [name for name, t in times.items() if not t]
    if missing:
        raise OverBudget(f"the budget ran out before a timed {missing[0]} run")
    return times


def measure(
    modes: Dict[str, Callable[[], None]], warmup: int, repeats: int, deadline: float, device: torch.device,
    memory: Optional["PeakMemory"] = None,
) -> Dict[str, Dict[str, object]]:
    """Warm up every mode, then time up to ``repeats`` runs of each within ``deadline`` (perf_counter).

    With ``memory`` (CPU): the warm-up's peak resident set goes into it, and the timed runs keep
    every freed block (see the module's docstring).
    """
    slowest = {name: 0.0 for name in modes}
    warm(modes, warmup, slowest, deadline, device, "warm-up")
    if memory is None or not memory.keep_blocks():
        times = timed_runs(modes, repeats, slowest, deadline, device)
        return {name: {**summarize(t), "allocator": allocator.setting_now()} for name, t in times.items()}
    times = None
    try:
        if time.perf_counter() + 2 * sum(slowest.values()) <= deadline:  # else the first timed runs grow it
            warm(modes, 1, slowest, deadline, device, "heap-growing")
        times, setting = timed_runs(modes, repeats, slowest, deadline, device), allocator.setting_now()
    except Exception as err:  # noqa: BLE001 - running out of memory is timed again below, the rest re-raised
        if not is_oom(err):
            raise
    finally:
        memory.release_blocks()
    if times is None:  # outside the except block, so that the failed run's tensors are freed
        times = timed_runs(modes, repeats, slowest, deadline, device)
        setting = allocator.setting_now() + " (every freed block kept ran out of memory)"
    return {name: {**summarize(t), "allocator": setting} for name, t in times.items()}


class PeakMemory:
    """A point's peak memory: ``max_memory_allocated`` on a GPU; on the CPU the peak resident set
    until its timed runs first keep every freed block (after that the heap keeps blocks that would
    otherwise go back, and may hand them out again), minus the resident set before the point."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline_mb = memory_reset(device)
        self.peak_rss_mb: Optional[float] = None

    def keep_blocks(self) -> bool:
        """Keep every freed block from now on (CPU; the peak so far noted the first time); whether it took."""
        if self.device.type == "cuda":
            return False
        if self.peak_rss_mb is None:
            self.peak_rss_mb = proc_status_mb("VmHWM")
        return allocator.keep_all_freed_memory()

    def release_blocks(self) -> None:
        """Map big blocks per use again and hand the heap's free pages back."""
        allocator.return_freed_memory()

    def result(self) -> Dict[str, object]:
        return memory_peak(self.device, self.baseline_mb, self.peak_rss_mb)


def memory_reset(device: torch.device) -> Optional[float]:
    """Start the point's memory count; returns the CPU baseline resident set in MiB (None on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return None
    return proc_status_mb("VmRSS")


def memory_peak(
    device: torch.device, baseline_mb: Optional[float], peak_rss_mb: Optional[float] = None
) -> Dict[str, object]:
    """The point's peak memory, how it was measured, and the baseline it excludes; on the CPU
    ``peak_rss_mb`` when given (PeakMemory's), else the process's peak resident set so far."""
    if device.type == "cuda":
        return {
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "memory_kind": "cuda_max_memory_allocated",
            "baseline_mem_mb": 0.0,
        }
    peak = proc_status_mb("VmHWM") if peak_rss_mb is None else peak_rss_mb
    return {
        "peak_mem_mb": peak - (baseline_mb or 0.0),
        "memory_kind": "cpu_peak_rss_minus_baseline",
        "baseline_mem_mb": baseline_mb,
        "peak_rss_mb": peak,
    }
