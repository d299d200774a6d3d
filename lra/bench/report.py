"""A throughput record -> slopes and markdown tables (its plot: lra/bench/plot.py).

The slope of time against N on log-log axes is the exponent of the cost: about 2 for full
attention, about 1 for a linear-cost method. It is fitted by least squares over every point that
has a time (measured or estimated), and also given between the two longest such lengths, where
fixed overheads weigh least.

A sweep that names ``none`` (the model without attention) has its ceiling: full's time over none's,
the largest speed-up any backend can reach, and each backend's share of it,
(t_full - t_backend) / (t_full - t_none): the fraction of the attention's time the backend removes.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from attentions import is_timing_reference

from ..machine import describe
from ..format import fmt_count
from .flops import efficiency

TIMED = ("ok", "estimated")
# a table cell's text from a point with a time and the index {(backend, length): point}
CellValue = Callable[[Dict[str, Any], Dict[Any, Dict[str, Any]]], str]


def loglog_slope(lengths: Sequence[float], times: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(time) against log(N); None with fewer than two lengths."""
    if len(set(lengths)) < 2:
        return None
    xs = [math.log(n) for n in lengths]
    ys = [math.log(t) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def modes_of(record: Dict[str, Any]) -> Tuple[str, ...]:
    """The modes a record's points timed: an interleaved sweep times the training step alone."""
    return ("train",) if record["settings"].get("interleaved") else ("forward", "train")


def slopes(record: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per backend and mode: the fitted slope, the slope over the two longest lengths, the points used."""
    out: Dict[str, Dict[str, Any]] = {}
    for backend in record["settings"]["backends"]:
        points = [p for p in record["points"] if p["backend"] == backend and p["status"] in TIMED]
        entry: Dict[str, Any] = {"lengths": [p["length"] for p in points],
                                 "estimated_lengths": [p["length"] for p in points if p["estimated"]]}
        for mode in modes_of(record):
            # time per token-sequence: divide by the batch, which the model level searches per point
            times = [p[mode]["median_s"] / p["batch"] for p in points]
            lengths = [p["length"] for p in points]
            entry[mode] = loglog_slope(lengths, times)
            entry[f"{mode}_last_two"] = loglog_slope(lengths[-2:], times[-2:])
        out[backend] = entry
    return out


def fmt_length(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}K"
    return str(n)


def fmt_time(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 100:
        return f"{s / 60:.3g} min"
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1000:.3g} ms"


def fmt_ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 1000 else f"{x:.3g}x"


def fmt_mem(mb: Optional[float]) -> str:
    if mb is None:
        return "n/a"
    return f"{mb / 1024:.3g} GB" if mb >= 1000 else f"{mb:.3g} MB"


def fmt_slope(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s:.2f}"


def cell(point: Optional[Dict[str, Any]], text: str) -> str:
    """A table cell: the value (``~`` when estimated), or the status of a point without one."""
    if point is None:
        return ""
    if point["status"] not in TIMED:
        return f"({point['status']})" if point.get("skipped") else point["status"]
    return f"~{text}" if point["estimated"] and text != "n/a" else text


def label(backend: str, ceiling: bool = False) -> str:
    """A table's name for ``backend``; the timing reference says what it is (in a speed-up table: the ceiling)."""
    if not is_timing_reference(backend):
        return backend
    return f"{backend} (without attention: the ceiling)" if ceiling else f"{backend} (without attention)"


def grid(record: Dict[str, Any], title: str, value: CellValue, backends: Optional[List[str]] = None,
         ceiling: bool = False) -> List[str]:
    """A markdown table: one row per backend (default: every backend of the sweep), one column per length;
    ``ceiling``: the timing reference's row is named the ceiling (a speed-up table)."""
    lengths = record["settings"]["lengths"]
    index = {(p["backend"], p["length"]): p for p in record["points"]}
    lines = [f"**{title}**", "", "| backend | " + " | ".join(fmt_length(n) for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for backend in record["settings"]["backends"] if backends is None else backends:
        cells = []
        for n in lengths:
            point = index.get((backend, n))
            timed = point is not None and point["status"] in TIMED
            cells.append(cell(point, value(point, index) if timed else ""))
        lines.append(f"| {label(backend, ceiling)} | " + " | ".join(cells) + " |")
    return lines + [""]


def speedup(mode: str) -> CellValue:
    """Time per sequence of full over that of the backend, at the same length."""
    def value(point: Dict[str, Any], index: Dict[Any, Dict[str, Any]]) -> str:
        if point["backend"] == "full":
            return "1x"
        full = index.get(("full", point["length"]))
        if full is None or full["status"] not in TIMED:
            return "n/a"
        ratio = (full[mode]["median_s"] / full["batch"]) / (point[mode]["median_s"] / point["batch"])
        marked = "~" if full["estimated"] and not point["estimated"] else ""
        return f"{marked}{fmt_ratio(ratio)}"
    return value


def ceiling_share(mode: str) -> CellValue:
    """(t_full - t_backend) / (t_full - t_none) per sequence, at the same length: the share of the
    attention's time (full's step minus the step without attention) that the backend removes."""
    def value(point: Dict[str, Any], index: Dict[Any, Dict[str, Any]]) -> str:
        full, none = index.get(("full", point["length"])), index.get((ceiling_of(index), point["length"]))
        if full is None or none is None or full["status"] not in TIMED or none["status"] not in TIMED:
            return "n/a"
        t_full, t_none, t_backend = (p[mode]["median_s"] / p["batch"] for p in (full, none, point))
        if t_full <= t_none:
            return "n/a"
        marked = "~" if (full["estimated"] or none["estimated"]) and not point["estimated"] else ""
        return f"{marked}{(t_full - t_backend) / (t_full - t_none):.0%}"
    return value


def ceiling_of(index: Dict[Any, Dict[str, Any]]) -> str:
    """The timing reference's name among the points (``none``)."""
    return next((b for b, _ in index if is_timing_reference(b)), "none")


def model_text(s: Dict[str, Any]) -> str:
    """The encoder of a model-level record in a few words."""
    if s.get("task"):
        m = s["model"]
        return (f"the {s['task']} model of its {s['task_preset']} configuration ({m['num_layers']} layers, width "
                f"{m['dim']}, {m['num_heads']} heads of {s['head_dim']}, FFN {m['ffn_dim']}, dropout {m['dropout']}, "
                f"{m['pooling']} pooling, {m['positions']} positions; optimizer {s['train']['optimizer']})")
    return f"{s['layers']}-layer encoder, width {s['width']}, {s['heads']} heads, FFN {s['ffn_dim']}"


def header(record: Dict[str, Any]) -> List[str]:
    s, hw = record["settings"], record["hardware"]
    if record["level"] == "attention":
        what = f"one attention call, B={s['batch']}, H={s['heads']}, D={s['head_dim']}"
        modes = "forward = one call in inference mode; train = forward + backward"
    else:
        batch = "searched per point" if s["batch"] is None else str(s["batch"])
        if s.get("interleaved"):
            batch = f"{batch}, halved for every backend while one runs out of memory"
        what = (f"{model_text(s)}, batch {batch}" + (", padded rows (lengths N/2..N, masked)" if s.get("padded") else ""))
        modes = "forward = one inference step; train = forward + backward + optimizer step"
    timing = (f"Median of up to {s['repeats']} timed runs after {s['warmup']} warm-up run(s); "
              f"budget {s['budget_s']:.0f} s a point")
    if s.get("interleaved"):
        modes = ("train = forward + backward + optimizer step; interleaved: every backend at one length in one "
                 "process, on the same batch, one step of each a round")
        timing = (f"Median of {s['repeats']} rounds after each backend's first step (its memory step) and "
                  f"{s['warmup'] - 1} untimed round(s); budget {s['budget_s']:.0f} s a backend and length")
    load = record["load_average"]
    resumed = "".join(f" Resumed at {r['at']} (commit {r['git_commit']}, load {r['load_average'][0]}; "
                      f"{r['points_kept']} points kept from before)." for r in record.get("resumed", []))
    without = "a call that returns v" if record["level"] == "attention" else "the model with out = v in place of attention"
    threads = s["threads"] or hw["torch_threads"]
    cap = f", memory cap {s['max_mem_gb']} GiB a point" if s.get("max_mem_gb") else ""
    return [
        f"## Throughput, {record['level']} level: {what}",
        "",
        f"{describe(hw)} ({threads} torch thread{'s' if threads != 1 else ''}); {s['dtype']}; torch {record['versions']['torch']}; "
        f"commit {record['versions']['git_commit']}; load average (1 min) {load['start'][0]} at start, "
        f"{load.get('end', ['?'])[0]} at end.{resumed}",
        f"{modes}. {timing}{cap}.",
        "`~` = estimated from a slice of the queries against all N keys (cost linear in the queries); "
        "`(status)` = not run, the backend already failed at a shorter length.",
    ] + ([
        f"`(without attention)`: {without}; full over it is the ceiling, the largest speed-up any backend can "
        "reach, and a backend's share of the ceiling is (t_full - t_backend) / (t_full - t_none), the fraction "
        "of the attention's time it removes."
    ] if any(is_timing_reference(b) for b in s["backends"]) else []) + ([] if record.get("complete", True) else [
        "**Incomplete sweep**: it was stopped before every point ran; an empty cell was not measured."
    ]) + [
        "",
    ]


def efficiency_lines(record: Dict[str, Any]) -> List[str]:
    eff = efficiency(record)
    gemm = record.get("gemm") or {}
    if eff["gemm_flops_per_s"] is None:
        return []
    modes = modes_of(record)
    lines = [f"**Fraction of the matmul rate** ({gemm['size']}x{gemm['size']} {gemm['dtype']} GEMM: "
             f"{eff['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s; FLOPs counted analytically, lra/bench/flops.py)", "",
             "| backend | N | " + " | ".join(f"{m} GFLOP/s | {m} fraction" for m in modes) + " |",
             "|---|---:|" + "---:|---:|" * len(modes)]
    for row in eff["points"]:
        mark = "~" if row["estimated"] else ""
        lines.append(f"| {row['backend']} | {fmt_length(row['length'])} | " + " | ".join(
            f"{mark}{row[f'{m}_flops_per_s'] / 1e9:.3g} | {mark}{row[f'{m}_fraction']:.1%}" for m in modes) + " |")
    return lines + [""]


def memory_ratio(point: Dict[str, Any], index: Dict[Any, Dict[str, Any]]) -> str:
    """Peak memory and its ratio to full attention's at the same length."""
    full = index.get(("full", point["length"]))
    mine, theirs = point.get("peak_mem_mb"), (full or {}).get("peak_mem_mb")
    if mine is None:
        return "n/a"
    return fmt_mem(mine) + (f" ({fmt_ratio(mine / theirs)})" if theirs and full["status"] in TIMED else "")


def steps_ratio(point: Dict[str, Any], index: Dict[Any, Dict[str, Any]]) -> str:
    """Training steps per second and their ratio to full attention's at the same length."""
    rate = 1.0 / point["train"]["median_s"]
    return f"{rate:.3g} ({speedup('train')(point, index)})"


def markdown(record: Dict[str, Any]) -> str:
    """The record as markdown tables: throughput, time, memory, speedup, slopes, efficiency."""
    lines = header(record)
    with_full = "full" in record["settings"]["backends"]
    if record["settings"].get("interleaved"):
        lines += grid(record, "Training steps per second (× full's, same rounds)", steps_ratio)
        lines += grid(record, f"Peak memory (× full's; {memory_kind(record)})", memory_ratio)
    lines += grid(record, "Train throughput (tokens/s)", lambda p, _: fmt_count(p["tokens_per_s"]["train"]))
    lines += grid(record, "Train speedup over full", speedup("train"), ceiling=True) if with_full else []
    others = [b for b in record["settings"]["backends"] if b != "full" and not is_timing_reference(b)]
    if with_full and others and any(is_timing_reference(b) for b in record["settings"]["backends"]):
        lines += grid(record, "Train share of the ceiling", ceiling_share("train"), others)
    lines += grid(record, "Train time (median, spread)",
                  lambda p, _: f"{fmt_time(p['train']['median_s'])} ±{p['train']['spread']:.0%}")
    if "forward" in modes_of(record):
        lines += grid(record, "Forward throughput (tokens/s)", lambda p, _: fmt_count(p["tokens_per_s"]["forward"]))
        lines += grid(record, "Forward speedup over full", speedup("forward"), ceiling=True) if with_full else []
        lines += grid(record, f"Peak memory ({memory_kind(record)})", lambda p, _: fmt_mem(p.get("peak_mem_mb")))
    if record["level"] == "model":
        lines += grid(record, "Batch size", lambda p, _: str(p["batch"]))
    lines += per_length_lines(record)
    modes = modes_of(record)
    lines += ["**Slope of time against N (log-log)**: fit over all lengths / over the two longest", "",
              "| backend | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for backend, entry in record["slopes"].items():
        est = " (with estimates)" if entry["estimated_lengths"] else ""
        lines.append(f"| {label(backend)}{est} | "
                     + " | ".join(f"{fmt_slope(entry[m])} / {fmt_slope(entry[f'{m}_last_two'])}" for m in modes) + " |")
    lines.append("")
    lines += efficiency_lines(record)
    return "\n".join(lines)


def per_length_lines(record: Dict[str, Any]) -> List[str]:
    """An interleaved sweep's processes: each length's batch, the batches that ran out of memory
    first, the allocator setting of its rounds and the load average around them."""
    rows = record.get("per_length") or []
    if not rows:
        return []
    lines = ["**Each length's process** (batches tried: the first backend that ran out of memory at each)", "",
             "| N | batch | batches tried | rounds timed with | load average (1 min) at start / end |",
             "|---:|---:|---|---|---|"]
    for row in rows:
        tried = "; ".join(f"{t['batch']}: {t['status']}" + (f" ({t['message'][:80]})" if t["status"] != "ok" else "")
                          for t in row["batches_tried"])
        load = row.get("load_average") or {}
        ends = " / ".join("?" if not load.get(k) else f"{load[k][0]}" for k in ("start", "end"))
        lines.append(f"| {fmt_length(row['length'])} | {row['batch']} | {tried} | {row.get('allocator') or 'n/a'} | {ends} |")
    return lines + [""]


def memory_kind(record: Dict[str, Any]) -> str:
    if record.get("settings", {}).get("interleaved"):
        if record["hardware"]["device"] == "cuda":
            return ("torch.cuda.max_memory_allocated during the backend's build and first step, minus what was "
                    "allocated before it")
        return ("peak RSS during the backend's build and first step, minus the RSS before it (heap trimmed and peak "
                "reset before each backend)")
    if record["hardware"]["device"] == "cuda":
        return "torch.cuda.max_memory_allocated"
    if "timed runs with every freed block kept" in record.get("versions", {}).get("allocator", ""):
        return "peak RSS of the point's process until its timed runs, minus its RSS before the point"
    return "peak RSS of the point's process minus its RSS before the point"
