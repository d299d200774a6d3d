"""The allocator settings (lra/machine/allocator.py) and the benchmark's two phases (memory in the warm-up
with big blocks mapped per use, timed runs with every freed block kept: lra/bench/measure.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict

import pytest
import torch

from lra.machine import allocator
from lra.bench.measure import PeakMemory, measure

GLIBC = sys.platform.startswith("linux") and allocator._libc() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's mallopt (Linux)")

# page faults of allocating and filling a block (64 MiB unless told) twice, in a fresh process under a
# setting, after a dozen such blocks; then the process's peak resident set in MiB
FAULTS = """
import resource, sys, torch
from lra.machine import allocator
from lra.bench.measure import proc_status_mb
setting, mib = sys.argv[1], int(sys.argv[2])
if setting == "all":
    print(allocator.keep_all_freed_memory())
elif setting == "returned":
    print(allocator.keep_all_freed_memory() and allocator.return_freed_memory())
else:
    print(allocator.keep_freed_memory())
for _ in range(12):  # glibc's heap takes a few rounds to leave a hole that fits the block
    torch.empty(mib << 18).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    torch.empty(mib << 18).fill_(2.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, round(proc_status_mb("VmHWM")))
"""


def faults(setting: str, env: Dict[str, str] | None = None, mib: int = 64) -> tuple:
    out = subprocess.run([sys.executable, "-c", FAULTS, setting, str(mib)], capture_output=True, text=True,
                         check=True, env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@needs_glibc
def test_keeping_every_block_stops_the_page_faults_and_returning_restores_them() -> None:
    # a 64 MiB block is above the 32 MiB that keep_freed_memory keeps: 16,384 pages faulted in each time
    took, mapped, _ = faults("kept")
    assert took and mapped > 20_000
    took, kept, _ = faults("all")
    assert took and kept < 1_000
    took, returned, _ = faults("returned")
    assert took and returned > 20_000


@needs_glibc
def test_blocks_past_the_trim_threshold_are_kept_and_do_not_pile_up_with_the_thread_cache_off() -> None:
    # 1.25 GiB blocks, past glibc's 1 GiB trim threshold (327,680 pages each), with the thread cache
    # off as in lra-bench's point processes: not faulted in again, and the heap holds one block, not 14
    env = allocator.without_thread_cache(os.environ)
    took, kept, peak_mib = faults("all", env, mib=1280)
    assert took and kept < 1_000 and peak_mib < 3 * 1280
    took, returned, _ = faults("returned", env, mib=1280)
    assert took and returned > 300_000


def test_without_thread_cache_adds_one_tunable_and_keeps_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:glibc.x=1"}
    got = allocator.without_thread_cache(env)
    if not GLIBC:  # no glibc to tune
        assert got == env
        return
    assert got == {"A": "1", "GLIBC_TUNABLES": "glibc.x=1:glibc.malloc.tcache_count=0"}
    assert allocator.without_thread_cache({})["GLIBC_TUNABLES"] == allocator.NO_THREAD_CACHE
    monkeypatch.setenv("LRA_MALLOC_TUNING", "0")
    assert allocator.without_thread_cache({"A": "1"}) == {"A": "1"}


@needs_glibc
def test_lra_bench_points_run_with_the_thread_cache_off_and_the_parent_keeps_its_environment(tmp_path: Path) -> None:
    from lra.bench.sweep import child_context

    before = os.environ.get("GLIBC_TUNABLES")
    # the point process's own environment, as the kernel shows it
    proc = child_context().Process(target=shutil.copyfile, args=("/proc/self/environ", str(tmp_path / "environ")))
    proc.start()
    proc.join(60)
    entries = (tmp_path / "environ").read_bytes().split(b"\0")
    tunables = next(e for e in entries if e.startswith(b"GLIBC_TUNABLES=")).split(b"=", 1)[1].decode()
    assert allocator.NO_THREAD_CACHE in tunables.split(":")
    assert os.environ.get("GLIBC_TUNABLES") == before


@needs_glibc
def test_malloc_tuning_0_turns_every_setting_off_and_all_keeps_blocks_for_good() -> None:
    took, mapped, _ = faults("all", {"LRA_MALLOC_TUNING": "0"})
    assert not took and mapped > 20_000
    kept_for_good = "from lra.machine import allocator; allocator.keep_freed_memory(); " \
                    "print(allocator.return_freed_memory(), allocator.setting_now())"
    assert subprocess.run([sys.executable, "-c", kept_for_good], capture_output=True, text=True, check=True,
                          env={**os.environ, "LRA_MALLOC_TUNING": "all"}).stdout.split("\n")[0] == \
        "False every freed block kept"
    assert "every freed block" in subprocess.run(
        [sys.executable, "-c", "from lra.machine import allocator; print(allocator.describe())"], capture_output=True,
        text=True, env={**os.environ, "LRA_MALLOC_TUNING": "all"}, check=True).stdout


def block_mode(mb: int) -> Callable[[], None]:
    def run() -> None:
        torch.empty(mb << 18).fill_(1.0)  # mb MiB of float32, every page touched
    return run


@needs_glibc
def test_peak_memory_comes_from_the_warm_up_and_the_timed_runs_keep_blocks() -> None:
    def grows() -> None:  # 96 MiB, and 400 MiB once the blocks are kept: the peak must not see those
        block_mode(400 if allocator._keep_all else 96)()

    memory = PeakMemory(torch.device("cpu"))
    stats = measure({"train": grows}, 1, 3, time.perf_counter() + 60, torch.device("cpu"), memory)
    assert stats["train"]["allocator"] == "every freed block kept"
    assert stats["train"]["repeats"] == 3
    assert not allocator._keep_all  # given back after the timed runs
    peak = memory.result()["peak_mem_mb"]
    assert 80 < peak < 300, peak
    # a second measurement (the whole point after its slice) keeps the first one's peak
    measure({"train": block_mode(8)}, 1, 1, time.perf_counter() + 60, torch.device("cpu"), memory)
    assert memory.result()["peak_mem_mb"] == peak


def test_without_memory_phases_the_timings_name_the_setting_they_ran_under() -> None:
    stats = measure({"train": block_mode(1)}, 1, 1, time.perf_counter() + 60, torch.device("cpu"))
    assert stats["train"]["allocator"] == allocator.setting_now() != "every freed block kept"


@needs_glibc
def test_a_timed_run_out_of_memory_with_blocks_kept_is_timed_again_mapped() -> None:
    def picky() -> None:
        if allocator._keep_all:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        block_mode(1)()

    memory = PeakMemory(torch.device("cpu"))
    stats = measure({"train": picky}, 1, 2, time.perf_counter() + 60, torch.device("cpu"), memory)
    assert stats["train"]["allocator"].endswith("(every freed block kept ran out of memory)")
    assert stats["train"]["repeats"] == 2


def test_other_errors_in_the_timed_runs_are_not_swallowed() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("a bug in the mode")

    with pytest.raises(ValueError, match="a bug"):
        measure({"train": broken}, 1, 2, time.perf_counter() + 60, torch.device("cpu"), PeakMemory(torch.device("cpu")))
    assert not allocator._keep_all


@needs_glibc
@pytest.mark.parametrize("estimate", ["always", "never"])
def test_a_point_is_timed_with_every_block_kept_whether_whole_or_estimated(estimate: str) -> None:
    from lra.bench.point import run_point

    threads = torch.get_num_threads()
    spec = dict(level="attention", backend="full", length=512, batch=1, heads=2, head_dim=16, layers=2, width=32,
                ffn_dim=32, dropout=0.0, device="cpu", dtype="float32", budget_s=60.0, max_mem_gb=None, warmup=1,
                repeats=2, estimate=estimate, slice_queries=128, threads=1, gemm_size=0, seed=0, attn_options={})
    try:
        result = run_point(spec)
    finally:
        torch.set_num_threads(threads)
    timings = result["slice"] if estimate == "always" else result
    assert timings["train"]["allocator"] == timings["forward"]["allocator"] == "every freed block kept"
    assert not allocator._keep_all


def test_a_record_says_its_memory_stops_at_the_timed_runs_when_its_points_switched() -> None:
    from lra.bench.report import memory_kind

    cpu = {"hardware": {"device": "cpu"}}
    switched = {**cpu, "versions": {"allocator": allocator.describe(benchmark=True)}}
    older = {**cpu, "versions": {"allocator": "glibc, freed blocks up to 32 MiB kept (lra/allocator.py)"}}
    assert ("until its timed runs" in memory_kind(switched)) == GLIBC
    assert "until its timed runs" not in memory_kind(older)
