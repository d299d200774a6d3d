"""lra-bench model --task and --interleaved: a task configuration's model, every backend of a length in
one process (the batch halved for every backend while one runs out of memory, a backend past its
budget recorded and not run longer), each backend's own peak memory, and the flags' bad input."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

from lra.bench import sweep as bench_sweep
from lra.bench.cli import main as bench_main
from lra.bench import interleaved
from lra.bench.interleaved import BackendMemory, run_interleaved
from lra.bench.measure import reset_peak_rss
from lra.bench.sweep import Settings
from lra.bench.task_model import task_settings
from lra.cli import guarded
from lra.machine import allocator


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_batch_that_does_not_fit_is_halved_for_every_backend(tmp_path: Path) -> None:
    # the paper preset's text model (2 layers, width 64) at batch 64 x 512 tokens needs more than 0.3 GiB
    out = tmp_path / "out"
    assert bench_main(["model", "--task", "text", "--interleaved", "--attn", "full,linear", "--lengths", "512",
                       "--batch", "64", "--repeats", "1", "--max-mem-gb", "0.3", "--gemm-size", "0", "--threads", "1", "--quiet",
                       "--no-plot", "--out", str(out)]) == 0
    record = json.loads((out / "record.json").read_text())
    tried = record["per_length"][0]["batches_tried"]
    assert tried[0]["batch"] == 64 and tried[0]["status"] == "oom" and tried[-1]["status"] == "ok"
    assert [t["batch"] for t in tried] == [64 // 2**i for i in range(len(tried))]
    assert {p["batch"] for p in record["points"]} == {tried[-1]["batch"]}
    assert all(p["status"] == "ok" for p in record["points"])


def test_a_backend_past_its_budget_is_recorded_and_not_run_longer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench_main(["model", "--task", "text", "--interleaved", "--attn", "full", "--lengths", "64,128",
                       "--batch", "1", "--budget-s", "0.001", "--gemm-size", "0", "--threads", "1", "--quiet", "--no-plot",
                       "--out", str(out)]) == 0
    points = json.loads((out / "record.json").read_text())["points"]
    assert [(p["status"], p["skipped"]) for p in points] == [("timeout", False), ("timeout", True)]
    assert "budget" in points[0]["message"]


def test_each_length_starts_at_the_last_batch_with_the_hungriest_backend_first(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: List[Dict[str, Any]] = []

    def fake_child(spec: Dict[str, Any], _workdir: Path) -> Dict[str, Any]:
        calls.append(spec)
        # batches above 8 do not fit at 1K, above 4 at 2K; topk is over its budget at 1K
        if spec["batch"] > 8 * 1024 // spec["length"]:
            return {"status": "oom", "halve": "mita", "message": "mita: out of memory", "batch": spec["batch"]}
        points = {b: {"status": "ok", "train": {"median_s": 1.0}, "peak_mem_mb": {"full": 10.0, "mita": 30.0}.get(b, 1.0)}
                  for b in spec["backends"]}
        points.get("topk", {}).update(status="timeout", message="over budget")
        return {"status": "ok", "batch": spec["batch"], "points": points, "allocator": "kept"}

    monkeypatch.setattr(bench_sweep, "run_child", fake_child)
    settings = Settings(
        level="model", backends=["full", "topk", "mita"], lengths=[1024, 2048], device="cpu", dtype="float32",
        batch=32, heads=2, head_dim=16, layers=1, width=32, ffn_dim=32, dropout=0.0, budget_s=10.0, max_mem_gb=None,
        warmup=1, repeats=1, estimate="never", slice_queries=256, threads=1, gemm_size=0, max_batch=1, min_gain=0.0,
        interleaved=True,
    )
    record = bench_sweep.sweep(settings, quiet=True)
    assert [(c["length"], c["batch"]) for c in calls] == [(1024, 32), (1024, 16), (1024, 8), (2048, 8), (2048, 4)]
    # topk failed at 1K: not run at 2K, and the memory steps there start with mita, the hungriest at 1K
    assert calls[-1]["backends"] == ["full", "mita"] and calls[-1]["memory_order"] == ["mita", "full"]
    assert [(p["backend"], p["length"], p["batch"], p["status"], p["skipped"]) for p in record["points"]] == [
        ("full", 1024, 8, "ok", False), ("topk", 1024, 8, "timeout", False), ("mita", 1024, 8, "ok", False),
        ("full", 2048, 4, "ok", False), ("topk", 2048, 8, "timeout", True), ("mita", 2048, 4, "ok", False)]
    assert [[t["status"] for t in r["batches_tried"]] for r in record["per_length"]] == [["oom", "oom", "ok"], ["oom", "ok"]]


def test_each_backends_memory_is_its_own_in_one_process() -> None:
    if not reset_peak_rss():
        pytest.skip("the peak resident set cannot be reset here (/proc/self/clear_refs)")
    memory = BackendMemory(torch.device("cpu"))
    peaks = []
    for mib in (256, 64):
        memory.start()
        block = torch.ones(mib * 2**18)  # mib MiB of float32, touched
        del block
        peaks.append(memory.result()["peak_mem_mb"])
    # the second measurement is of its own 64 MiB, not the first one's 256 MiB peak
    assert peaks[0] == pytest.approx(256, abs=24) and peaks[1] == pytest.approx(64, abs=24)


# One process, its memory cap of 256 MiB set, that holds a 160 MiB block and then takes a second
# one (the pieces of lra/bench/interleaved.py). What an earlier piece left: "mapped", 160 MiB mapped,
# touched and handed back to the kernel; "heap", a 400 MiB hole in the heap, its pages handed back
# by malloc_trim, which serves big blocks without a new mapping. Prints which block ran out of
# memory and how: "none", or "<block> allocation|check <vm_size_growth_mib>".
CAP = """
import mmap, sys, torch
from lra.bench.measure import ResidentCap, is_oom, proc_status_mb
from lra.machine import allocator
mib = 2**20
left = sys.argv[1]
if left == "mapped":
    earlier = mmap.mmap(-1, 160 * mib)
    for offset in range(0, 160 * mib, mib):
        earlier[offset:offset + mib] = b"\\1" * mib
    earlier.madvise(mmap.MADV_DONTNEED)
else:
    assert allocator.keep_all_freed_memory()
    earlier, after = torch.ones(400 * mib // 4), torch.ones(mib // 4)  # the block after keeps the hole off the top
    del earlier
    assert allocator.return_freed_memory()
cap = ResidentCap(0.25)
blocks = []
for number in (1, 2):
    cap.renew()
    size = proc_status_mb("VmSize")
    try:
        blocks.append(torch.ones(160 * mib // 4))
    except RuntimeError as err:
        assert is_oom(err)
        print(number, "allocation", round(proc_status_mb("VmSize") - size))
        sys.exit()
    try:
        cap.check(f"block {number}")
    except MemoryError as err:
        assert is_oom(err) and "past the memory cap of 0.25 GiB" in str(err), err
        print(number, "check", round(proc_status_mb("VmSize") - size))
        sys.exit()
print("none")
"""


@pytest.mark.parametrize("left, caught_by", [("mapped", "allocation"), ("heap", "check")])
def test_the_memory_cap_counts_what_is_resident_not_what_an_earlier_backend_left(left: str, caught_by: str) -> None:
    if not reset_peak_rss():
        pytest.skip("needs Linux's /proc/self (the cap reads the resident set there)")
    if left == "heap" and not (sys.platform.startswith("linux") and allocator._libc() is not None):
        pytest.skip("needs glibc's mallopt (the heap's holes come from keeping every block on it)")
    out = subprocess.run([sys.executable, "-c", CAP, left], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LRA_MALLOC_TUNING": "1"})
    assert out.returncode == 0, out.stderr
    # the first block fits: what the earlier piece left is not resident; the second passes the cap,
    # seen by the address-space limit when it needs a new mapping, by the check when the heap's hole
    # serves it (no new mapping)
    caught = out.stdout.split()
    assert caught[:2] == ["2", caught_by], out.stdout
    if left == "heap":
        assert int(caught[2]) < 160  # served from the hole: no new mapping for the address-space limit to refuse


def small_spec(tmp_path: Path, halve: bool) -> Dict[str, Any]:
    settings = Settings(
        level="model", backends=["full", "linear"], lengths=[128], device="cpu", dtype="float32",
        batch=4, heads=2, head_dim=16, layers=1, width=32, ffn_dim=32, dropout=0.0, budget_s=60.0, max_mem_gb=None,
        warmup=1, repeats=2, estimate="never", slice_queries=128, threads=1, gemm_size=0, max_batch=4, min_gain=0.0,
        interleaved=True,
    )
    return {**bench_sweep.child_spec(settings, "", 128, 4), "backends": ["full", "linear"],
            "memory_order": ["linear", "full"], "attn_options": {}, "halve_on_oom": halve,
            "result_path": str(tmp_path / "result.json")}


@pytest.mark.parametrize("halve", [True, False], ids=["batch-left-to-halve", "batch-1"])
def test_a_step_out_of_memory_in_the_rounds_halves_the_batch_for_every_backend(
        halve: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = interleaved.train_step

    def train_step(model: Any, point: Dict[str, Any], *args: Any) -> Any:
        step = real(model, point, *args)
        if point["backend"] != "linear" or point["batch"] != 4:
            return step
        taken: List[int] = []

        def first_fits_then_out_of_memory() -> None:
            # linear's first step fits; its steps in the rounds, with full's model held too, do not
            taken.append(1)
            if len(taken) > 1:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 67141632 bytes")
            step()
        return first_fits_then_out_of_memory

    monkeypatch.setattr(interleaved, "train_step", train_step)
    result = run_interleaved(small_spec(tmp_path, halve))
    assert result == json.loads((tmp_path / "result.json").read_text())
    points = result["points"]
    assert points["linear"]["status"] == "oom" and "can't allocate memory" in points["linear"]["message"]
    if halve:  # the process ends; the sweep tries every backend again at half the batch
        assert (result["status"], result["halve"]) == ("oom", "linear")
    else:  # at batch 1 the backend is recorded as out of memory and the others are timed
        assert result["status"] == "ok" and points["full"]["status"] == "ok"
        assert len(points["full"]["train"]["times_s"]) == 2


def test_task_settings_are_the_task_configurations() -> None:
    got = task_settings("text", "official", ["full", "local", "synthesizer", "none"], {"local": {"block_size": 32}})
    assert (got["layers"], got["width"], got["heads"], got["head_dim"], got["ffn_dim"]) == (4, 256, 4, 64, 1024)
    assert (got["model"]["pooling"], got["model"]["positions"], got["vocab_size"], got["num_classes"]) == ("cls", "sinusoidal", 257, 2)
    # the official optimizer at its schedule's peak rate (rsqrt: 0.05 / sqrt(8000))
    assert got["train"] == {"optimizer": "lra", "weight_decay": 0.1, "grad_clip": 0.0, "lr": pytest.approx(0.05 / math.sqrt(8000))}
    # each backend's options for the task, --attn-opt over them; none has none
    assert got["attn_options"]["local"] == {"block_size": 32} and got["attn_options"]["none"] == {}
    assert got["attn_options"]["synthesizer"]["mode"] == "factorized_random"


@pytest.mark.parametrize("argv,says", [
    (["model", "--task", "text", "--layers", "2"], "--layers: with --task text the model is its configuration's"),
    (["model", "--interleaved", "--attn", "full"], "--interleaved needs --batch"),
    (["model", "--task", "retrieval", "--attn", "full"], "pairs of sequences"),
    (["model", "--task", "nosuch", "--attn", "full"], "unknown task 'nosuch'"),
], ids=["layers-with-task", "interleaved-without-batch", "dual-task", "unknown-task"])
def test_bad_task_flags_are_one_line_exit_2(argv: List[str], says: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    assert guarded("lra-bench", lambda: bench_main([*argv, "--out", str(tmp_path / "out")])) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not (tmp_path / "out").exists()
