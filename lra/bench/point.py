"""One benchmark point, measured in a process of its own (forked by lra.bench.sweep).

The spec (written by lra.bench.sweep) names the level (attention, model or gemm), the backend, the
length, batch and sizes, the time budget and the memory cap; the result (status, timings, memory)
is written as JSON to the spec's ``result_path``. Running out of memory is caught here (the cap is
an RLIMIT_AS on the CPU) and recorded as ``oom``; a budget too small for one timed run of each
mode is recorded as ``timeout``; the parent kills a child that overruns and records that too.
A spec that names ``backends`` runs them all at one length in this one process, interleaved
(lra/bench/interleaved.py). By hand: ``python -m lra.bench.point SPEC.json`` (the spec names
result_path and log_path).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from attentions import build_attention

from ..machine.allocator import keep_freed_memory
from ..files import write_atomic
from .estimate import add_stats, scale_stats, slice_fn
from .measure import OverBudget, PeakMemory, cap_address_space, is_oom, measure, timed
from .workloads import (
    Modes,
    attention_modes,
    attention_module,
    build_model,
    gemm_modes,
    kernel_of,
    model_modes,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# a point runs whole only when its predicted cost fits this many times in the budget left
HEADROOM = 2.0


def estimated(forward: Dict[str, Any], train: Dict[str, Any], slice_info: Dict[str, Any]) -> Dict[str, Any]:
    return {"status": "estimated", "estimated": True, "forward": forward, "train": train, "slice": slice_info}


def run_whole(
    estimate_of: Optional[Callable[[Optional[PeakMemory]], Dict[str, Any]]], modes: Callable[[], Modes],
    spec: Dict[str, Any], deadline: float, device: torch.device, memory: PeakMemory,
) -> Dict[str, Any]:
    """Time the whole point, unless the estimate says it cannot fit; an overrun falls back on the estimate.

    The estimate (``estimate_of``, from a slice) is measured first with big blocks mapped per use
    (no ``memory``), so that the whole point's warm-up after it still shows its own peak memory; when
    the estimate is the result, it is timed again as whole points are, with every freed block kept.
    (An overrun of the whole falls back on the first estimate: its timings name their allocator setting.)
    """
    estimate = None if estimate_of is None else estimate_of(None)
    if estimate is not None:
        per_run = float(estimate["forward"]["median_s"]) + float(estimate["train"]["median_s"])
        fits = HEADROOM * per_run * (spec["warmup"] + 1) <= deadline - time.perf_counter()
        if spec["estimate"] == "always" or not fits:
            return estimate_of(memory)
    try:
        stats = measure(modes(), spec["warmup"], spec["repeats"], deadline, device, memory)
    except OverBudget as err:
        if estimate is None:
            raise
        return {**estimate, "message": f"the whole point overran its budget ({err})"}
    return {"status": "ok", "estimated": False, **stats}


def attention_point(
    spec: Dict[str, Any], device: torch.device, dtype: torch.dtype, deadline: float, memory: PeakMemory,
) -> Dict[str, Any]:
    attn = attention_module(spec, device, dtype)
    n, queries = spec["length"], spec["slice_queries"]
    slicer = slice_fn(attn)

    def estimate_of(slice_memory: Optional[PeakMemory]) -> Dict[str, Any]:
        raw = measure(attention_modes(attn, slicer, spec, queries, device, dtype), spec["warmup"],
                      min(spec["repeats"], 3), deadline, device, slice_memory)
        scale = n / queries
        info = {"queries": queries, "scale": scale, "forward": raw["forward"], "train": raw["train"]}
        return estimated(scale_stats(raw["forward"], scale), scale_stats(raw["train"], scale), info)

    sliced = slicer is not None and spec["estimate"] != "never" and queries < n
    whole = lambda: attention_modes(attn, attn, spec, n, device, dtype)  # noqa: E731
    return run_whole(estimate_of if sliced else None, whole, spec, deadline, device, memory)


def model_point(
    spec: Dict[str, Any], device: torch.device, dtype: torch.dtype, deadline: float, memory: PeakMemory,
) -> Dict[str, Any]:
    model = build_model(spec, device)
    n, queries, layers = spec["length"], spec["slice_queries"], spec["layers"]
    blocks = list(model.encoder.blocks)
    attn = blocks[0].attn
    slicer = slice_fn(attn)

    def estimate_of(slice_memory: Optional[PeakMemory]) -> Dict[str, Any]:
        sizes = {**spec, "head_dim": spec["width"] // spec["heads"]}
        raw = measure(attention_modes(attn, slicer, sizes, queries, device, dtype), spec["warmup"],
                      min(spec["repeats"], 3), deadline, device, slice_memory)
        scale = n / queries
        # the rest of the model timed for real, the attention replaced by none (out = v)
        originals = [block.attn for block in blocks]
        for block in blocks:
            block.attn = build_attention("none", num_heads=spec["heads"], head_dim=sizes["head_dim"], max_len=n)
        rest = measure(model_modes(model, spec, device, dtype), spec["warmup"], spec["repeats"], deadline, device,
                       slice_memory)
        for block, original in zip(blocks, originals):
            block.attn = original
        forward = add_stats(rest["forward"], scale_stats(raw["forward"], scale), layers)
        train = add_stats(rest["train"], scale_stats(raw["train"], scale), layers)
        info = {"queries": queries, "scale": scale, "layers": layers, "attention": raw, "rest": rest}
        return estimated(forward, train, info)

    sliced = slicer is not None and spec["estimate"] != "never" and queries < n
    whole = lambda: model_modes(model, spec, device, dtype)  # noqa: E731
    return run_whole(estimate_of if sliced else None, whole, spec, deadline, device, memory)


def gemm_point(
    spec: Dict[str, Any], device: torch.device, dtype: torch.dtype, deadline: float, memory: PeakMemory,
) -> Dict[str, Any]:
    modes, flops = gemm_modes(spec["gemm_size"], device, dtype)
    # the operands are allocated once, so the allocator's setting does not matter: no memory phases
    stats = measure(modes, spec["warmup"], spec["repeats"], deadline, device)["matmul"]
    return {
        "status": "ok", "size": spec["gemm_size"], "flops": flops, "matmul": stats,
        "flops_per_s": flops / stats["median_s"], "best_flops_per_s": flops / stats["min_s"],
    }


LEVELS = {"attention": attention_point, "model": model_point, "gemm": gemm_point}


def prepare(spec: Dict[str, Any]) -> Tuple[torch.device, torch.dtype]:
    """The point's process set up: threads, allocator, seed, the thread pool (and CUDA) started, then
    the memory cap; its device and dtype."""
    device = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    keep_freed_memory()
    torch.manual_seed(spec["seed"])
    # start the thread pool (and CUDA) before the memory cap and the baseline are taken
    timed(lambda: torch.ones(256, 256, device=device) @ torch.ones(256, 256, device=device), device)
    if spec["max_mem_gb"]:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["max_mem_gb"] * 2**30 / total), device)
        else:
            cap_address_space(spec["max_mem_gb"])
    return device, dtype


def run_point(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Measure the point described by ``spec``; every outcome is a result with a status."""
    device, dtype = prepare(spec)
    memory = PeakMemory(device)
    start = time.perf_counter()
    kernel = kernel_of(spec["backend"], device, spec["attn_options"]) if spec["level"] != "gemm" else "torch.mm"
    try:
        result = LEVELS[spec["level"]](spec, device, dtype, start + spec["budget_s"], memory)
    except OverBudget as err:
        result = {"status": "timeout", "message": str(err)}
    except Exception as err:  # noqa: BLE001 - any failure becomes the point's status
        if not is_oom(err):
            raise
        result = {"status": "oom", "message": str(err).strip().splitlines()[0][:300]}
    peak = memory.result()
    if result.get("estimated"):
        # the slice's memory is not the point's: keep it, but report no peak for the point
        result["slice"]["peak_mem_mb"] = peak.pop("peak_mem_mb")
        peak["peak_mem_mb"] = None
    return {**result, **peak, "kernel": kernel, "measure_s": time.perf_counter() - start}


def child(spec_path: str) -> None:
    """Entry of the point's process: read the spec, measure, write the result (stderr to the log).
    A spec that names ``backends`` is every backend at one length, interleaved (lra/bench/interleaved.py)."""
    with open(spec_path) as f:
        spec = json.load(f)
    log = open(spec["log_path"], "w")
    os.dup2(log.fileno(), 2)
    try:
        if "backends" in spec:
            from .interleaved import run_interleaved

            result = run_interleaved(spec)
        else:
            result = run_point(spec)
    except Exception as err:  # noqa: BLE001 - reported to the parent as the point's error
        traceback.print_exc()
        result = {"status": "error", "message": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
    # atomic: the sweep reads it once this process has ended, and a kill must not leave half of it
    write_atomic(Path(spec["result_path"]), json.dumps(result).encode())


if __name__ == "__main__":
    child(sys.argv[1])
