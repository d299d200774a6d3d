"""The sweep: every (length, backend) point in its own child process, gathered into one record.

Points run shortest length first, every backend at one length before the next, so backends are
measured side by side. A child that runs out of memory or over its budget is recorded as ``oom``
or ``timeout``; longer lengths of that backend are then recorded with the same status, marked
``skipped``, instead of spending the budget again. At the model level the batch size is searched
per point: 1, 2, 4, ... until a batch fails, stops gaining ``min_gain`` throughput, reaches
``max_batch`` or is estimated (an estimate is linear in the batch); every trial is kept in
``batch_search`` and the best one is the point.

Interleaved (model level, ``--interleaved``): every backend at one length runs in one child
process instead (lra/bench/interleaved.py), their training steps timed in rounds, at one batch for
all: the given batch, halved for every backend while one of them runs out of memory.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from tqdm import tqdm

from . import point as bench_point
from ..files import write_atomic
from ..machine import allocator, hardware, load_average, versions
from .report import fmt_length
from .resume import Points, kept_points
from ..run.record import now


@dataclass
class Settings:
    level: str
    backends: List[str]
    lengths: List[int]
    device: str
    dtype: str
    # attention level: the batch; model level: a fixed batch, or None to search it
    batch: Optional[int]
    heads: int
    head_dim: int
    layers: int
    width: int
    ffn_dim: int
    dropout: float
    budget_s: float
    max_mem_gb: Optional[float]
    warmup: int
    repeats: int
    estimate: str
    slice_queries: int
    threads: int
    gemm_size: int
    max_batch: int
    min_gain: float
    seed: int = 0
    # model level: padded batches (row lengths N/2..N with the padding mask) instead of full rows
    padded: bool = False
    # seconds a child may run past its budget (to finish the run in flight) before it is killed
    slack_s: float = 60.0
    attn_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # model level: every backend at one length in one process, timed in rounds (lra/bench/interleaved.py)
    interleaved: bool = False
    # model level, --task: the model (ModelConfig), optimizer (TrainConfig values), vocabulary and
    # classes of a task's configuration under a preset; empty: the layer flags' encoder
    task: str = ""
    task_preset: str = ""
    model: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    num_classes: int = 0


def child_context() -> multiprocessing.context.BaseContext:
    """Processes forked from a server that imported torch once: fresh memory, no import per point."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lra.bench.point"])
    # the server is started once, with glibc's thread cache off (lra/machine/allocator.py); the
    # points forked from it inherit that
    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ.update(allocator.without_thread_cache(os.environ))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved
    return ctx


def run_child(spec: Dict[str, Any], workdir: Path) -> Dict[str, Any]:
    """Run one point in its own process; a kill or a crash becomes the point's status."""
    spec_path, result_path, log_path = workdir / "spec.json", workdir / "result.json", workdir / "point.log"
    for path in (result_path, log_path):
        path.unlink(missing_ok=True)
    write_atomic(spec_path, json.dumps({**spec, "result_path": str(result_path), "log_path": str(log_path)}).encode())
    proc = child_context().Process(target=bench_point.child, args=(str(spec_path),), daemon=True)
    proc.start()
    limit = spec.get("limit_s") or spec["budget_s"] + spec["slack_s"]
    proc.join(limit)
    if proc.is_alive():
        proc.kill()
        proc.join()
        killed = {"status": "timeout", "message": f"killed after {limit:.0f} s (budget {spec['budget_s']:.0f} s)"}
        # an interleaved child saves what it measured as it goes: keep that
        return {**json.loads(result_path.read_text()), **killed} if result_path.exists() else killed
    # an interleaved child that died part-way leaves a result still "running"
    saved = json.loads(result_path.read_text()) if result_path.exists() else {}
    if saved and saved.get("status") != "running":
        return saved
    if proc.exitcode == -signal.SIGKILL:
        return {**saved, "status": "oom",
                "message": "killed by SIGKILL (the kernel's OOM killer?); set --max-mem-gb lower"}
    log = log_path.read_text().strip().splitlines() if log_path.exists() else []
    tail = (log or ["no output"])[-1][:300]
    return {**saved, "status": "error", "message": f"exit status {proc.exitcode}: {tail}"}


def child_spec(settings: Settings, backend: str, length: int, batch: int) -> Dict[str, Any]:
    spec = dataclasses.asdict(settings)
    for key in ("backends", "lengths", "batch", "attn_options", "max_batch", "min_gain", "interleaved"):
        spec.pop(key)
    return {**spec, "backend": backend, "length": length, "batch": batch,
            "attn_options": settings.attn_options.get(backend, {})}


def with_throughput(result: Dict[str, Any], batch: int, length: int) -> Dict[str, Any]:
    """Tokens per second of each timed mode: batch x length / median seconds."""
    result["tokens_per_s"] = {
        mode: batch * length / result[mode]["median_s"]
        for mode in ("forward", "train")
        if result.get(mode) and result[mode]["median_s"] > 0
    }
    return result


def search_batch(settings: Settings, backend: str, length: int, workdir: Path) -> Dict[str, Any]:
    """Double the batch while it fits in memory and the budget and still gains throughput."""
    trials: List[Dict[str, Any]] = []
    best: Optional[Dict[str, Any]] = None
    batch = 1
    while batch <= settings.max_batch:
        result = with_throughput(run_child(child_spec(settings, backend, length, batch), workdir), batch, length)
        trials.append({"batch": batch, "status": result["status"], "tokens_per_s": result.get("tokens_per_s", {}),
                       "peak_mem_mb": result.get("peak_mem_mb"), "message": result.get("message", "")})
        if result["status"] not in ("ok", "estimated"):
            break
        rate = result["tokens_per_s"]["train"]
        previous = best["tokens_per_s"]["train"] if best is not None else 0.0
        if rate > previous:
            best = {**result, "batch": batch}
        if previous and rate < (1 + settings.min_gain) * previous:
            break
        # an estimate is linear in the batch: a larger batch cannot show a gain
        if result["status"] == "estimated":
            break
        batch *= 2
    # when batch 1 already failed, that failure is the point
    point = best if best is not None else {**result, "batch": 1}
    point["batch_search"] = trials
    return point


def measure_point(settings: Settings, backend: str, length: int, workdir: Path) -> Dict[str, Any]:
    if settings.level == "model" and settings.batch is None:
        return search_batch(settings, backend, length, workdir)
    batch = settings.batch or 1
    result = run_child(child_spec(settings, backend, length, batch), workdir)
    return {**with_throughput(result, batch, length), "batch": batch}


def measure_gemm(settings: Settings, workdir: Path) -> Optional[Dict[str, Any]]:
    """The matmul rate of this machine in the benchmark's dtype, or None when --gemm-size is 0."""
    if settings.gemm_size <= 0:
        return None
    spec = {**child_spec(settings, "", 0, 1), "level": "gemm"}
    return {**run_child(spec, workdir), "dtype": settings.dtype}


# settings of --task, left out of a record without it
TASK_FIELDS = ("task", "task_preset", "model", "train", "vocab_size", "num_classes")
# settings that mean nothing at the other level, left out of its record
UNUSED = {"attention": ("layers", "width", "ffn_dim", "dropout", "max_batch", "min_gain", "padded", "interleaved",
                        *TASK_FIELDS), "model": ()}


def recorded_settings(settings: Settings) -> Dict[str, Any]:
    values = dataclasses.asdict(settings)
    unused = UNUSED[settings.level] + (() if settings.task else TASK_FIELDS)
    return {key: value for key, value in values.items() if key not in unused}


def sweep(settings: Settings, quiet: bool = False, on_point: Optional[Callable[[Dict[str, Any]], None]] = None,
          resume: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run every point of ``settings``; returns the sweep's record (without the derived tables).
    ``resume``: an unfinished record of the same settings (lra/bench/resume.py) whose points are kept."""
    device = torch.device(settings.device)
    record: Dict[str, Any] = {
        "schema": 1,
        "kind": "lra-bench",
        "level": settings.level,
        "started_at": now(),
        "hardware": hardware(device),
        "versions": versions(),
        "settings": recorded_settings(settings),
        "load_average": {"start": load_average()},
        "points": [],
    }
    done, done_lengths = kept_points(resume, settings.interleaved) if resume else ({}, {})
    if resume:
        record["resumed"] = [*resume.get("resumed", []), {
            "at": record["started_at"], "git_commit": record["versions"]["git_commit"],
            "load_average": record["load_average"]["start"], "max_mem_gb": settings.max_mem_gb,
            "points_kept": len(done)}]
        record["started_at"], record["load_average"] = resume["started_at"], resume["load_average"]
    total = len(settings.lengths) * len(settings.backends) + (settings.gemm_size > 0)
    bar = tqdm(total=total, disable=quiet, unit="point", dynamic_ncols=True, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="lra-bench-") as tmp:
        workdir = Path(tmp)
        bar.set_description("gemm")
        record["gemm"] = resume["gemm"] if resume and "gemm" in resume else measure_gemm(settings, workdir)
        bar.update(settings.gemm_size > 0)
        if settings.interleaved:
            points = interleaved_points(settings, record, workdir, bar, done, done_lengths)
        else:
            points = separate_points(settings, record, workdir, bar, done)
        for point in points:
            record["points"].append(point)
            bar.update(1)
            bar.set_postfix_str(f"{point['backend']} N={point['length']}: {point['status']}")
            if on_point is not None:
                on_point(record)
    bar.close()
    record["load_average"]["end"] = load_average()
    record["finished_at"] = now()
    return record


def not_run(first: Dict[str, Any]) -> Dict[str, Any]:
    """A point of a backend that already failed at a shorter length, with that failure's status."""
    return {"status": first["status"], "skipped": True, "batch": first["batch"], "estimated": False,
            "message": f"not run: {first['status']} at N={fmt_length(first['length'])}"}


def separate_points(settings: Settings, record: Dict[str, Any], workdir: Path, bar: tqdm,
                    done: Points) -> Iterator[Dict[str, Any]]:
    """Every (length, backend) point in a process of its own, shortest length first; a point in
    ``done`` (of a resumed record) is kept as it was measured."""
    blocked: Dict[str, Dict[str, Any]] = {}
    for length in settings.lengths:
        for backend in settings.backends:
            bar.set_description(f"{backend} N={length}")
            if (backend, length) in done:
                point = dict(done[(backend, length)])
            elif backend in blocked:
                point = not_run(blocked[backend])
            else:
                point = measure_point(settings, backend, length, workdir)
                point.setdefault("skipped", False)
            point = {"backend": backend, "length": length, **point}
            point.setdefault("estimated", False)
            if point["status"] in ("oom", "timeout") and backend not in blocked:
                blocked[backend] = point
            yield point


def interleaved_length(settings: Settings, backends: List[str], length: int, batch: int, order: List[str],
                       workdir: Path) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Every backend at ``length`` in one process (lra/bench/interleaved.py), from ``batch`` down by
    halves until every backend's step fits in memory (or batch 1); the last process's result and
    every batch tried."""
    tried: List[Dict[str, Any]] = []
    while True:
        spec = {**child_spec(settings, "", length, batch), "backends": backends, "memory_order": order,
                "attn_options": {b: settings.attn_options.get(b, {}) for b in backends}, "halve_on_oom": batch > 1,
                "limit_s": len(backends) * settings.budget_s + settings.slack_s}
        result = run_child(spec, workdir)
        tried.append({"batch": batch, "status": result["status"], "message": result.get("message", "")})
        # out of memory: a backend's step at this batch (``halve``), or the process killed for it
        if result["status"] != "oom" or batch == 1:
            return result, tried
        batch //= 2


def interleaved_points(settings: Settings, record: Dict[str, Any], workdir: Path, bar: tqdm, done: Points,
                       done_lengths: Dict[int, Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
    """Every backend at one length in one process, shortest length first; each length starts at the
    batch the previous one ended at, its memory steps the hungriest backend there first. What each
    length's process did (batches tried, allocator, load) goes to ``record["per_length"]``. A length
    in ``done_lengths`` (of a resumed record) keeps its points and entry as they were measured."""
    blocked: Dict[str, Dict[str, Any]] = {}
    batch, order = settings.batch or 1, list(settings.backends)
    record["per_length"] = []
    for length in settings.lengths:
        if length in done_lengths:
            entry = done_lengths[length]
            record["per_length"].append(entry)
            batch = entry["batch"]
            kept = [done[(backend, length)] for backend in settings.backends]
            for point in kept:
                if point["status"] in ("oom", "timeout") and point["backend"] not in blocked:
                    blocked[point["backend"]] = point
                yield dict(point)
            measured = {p["backend"]: p for p in kept if not p.get("skipped")}
            order = sorted(measured, key=lambda b: -(measured[b].get("peak_mem_mb") or 0.0))
            continue
        here = [b for b in settings.backends if b not in blocked]
        bar.set_description(f"N={length}, {len(here)} backends interleaved")
        first = [b for b in order if b in here]
        result, tried = interleaved_length(settings, here, length, batch, first, workdir) if here else ({}, [])
        batch = result.get("batch", batch)
        measured = result.get("points") or {}
        record["per_length"].append({
            "length": length, "batch": batch, "batches_tried": tried, "allocator": result.get("allocator"),
            "load_average": {"start": result.get("load_average"), "end": result.get("load_average_end")}})
        for backend in settings.backends:
            if backend in blocked:
                yield {"backend": backend, "length": length, **not_run(blocked[backend])}
                continue
            point = dict(measured.get(backend) or {})
            if point.get("status") in (None, "pending", "running"):
                # the process ended (killed, out of memory, or an error) before this backend was measured
                status = result.get("status") if result.get("status") in ("timeout", "oom") else "error"
                point.update(status=status, message=result.get("message", "the length's process ended first"))
            point = {"backend": backend, "length": length, "batch": batch, "skipped": False, "estimated": False,
                     **with_throughput(point, batch, length)}
            if point["status"] in ("oom", "timeout"):
                blocked[backend] = point
            yield point
        order = sorted(here, key=lambda b: -((measured.get(b) or {}).get("peak_mem_mb") or 0.0))
