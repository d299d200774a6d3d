"""A throughput record -> slopes, a markdown table and a log-log plot.

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
from typing import Any, Callable, Dict, List, Optional, Sequence

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


def slopes(record: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per backend and mode: the fitted slope, the slope over the two longest lengths, the points used."""
    out: Dict[str, Dict[str, Any]] = {}
    for backend in record["settings"]["backends"]:
        points = [p for p in record["points"] if p["backend"] == backend and p["status"] in TIMED]
        entry: Dict[str, Any] = {"lengths": [p["length"] for p in points],
                                 "estimated_lengths": [p["length"] for p in points if p["estimated"]]}
        for mode in ("forward", "train"):
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


def header(record: Dict[str, Any]) -> List[str]:
    s, hw = record["settings"], record["hardware"]
    if record["level"] == "attention":
        what = f"one attention call, B={s['batch']}, H={s['heads']}, D={s['head_dim']}"
        modes = "forward = one call in inference mode; train = forward + backward"
    else:
        batch = "searched per point" if s["batch"] is None else str(s["batch"])
        what = (f"{s['layers']}-layer encoder, width {s['width']}, {s['heads']} heads, FFN {s['ffn_dim']}, "
                f"batch {batch}" + (", padded rows (lengths N/2..N, masked)" if s.get("padded") else ""))
        modes = "forward = one inference step; train = forward + backward + AdamW step"
    load = record["load_average"]
    without = "a call that returns v" if record["level"] == "attention" else "the model with out = v in place of attention"
    threads = s["threads"] or hw["torch_threads"]
    cap = f", memory cap {s['max_mem_gb']} GiB a point" if s.get("max_mem_gb") else ""
    return [
        f"## Throughput, {record['level']} level: {what}",
        "",
        f"{describe(hw)} ({threads} torch thread{'s' if threads != 1 else ''}); {s['dtype']}; torch {record['versions']['torch']}; "
        f"commit {record['versions']['git_commit']}; load average (1 min) {load['start'][0]} at start, "
        f"{load.get('end', ['?'])[0]} at end.",
        f"{modes}. Median of up to {s['repeats']} timed runs after {s['warmup']} warm-up run(s); "
        f"budget {s['budget_s']:.0f} s a point{cap}.",
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
    lines = [f"**Fraction of the matmul rate** ({gemm['size']}x{gemm['size']} {gemm['dtype']} GEMM: "
             f"{eff['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s; FLOPs counted analytically, lra/bench/flops.py)", "",
             "| backend | N | forward GFLOP/s | forward fraction | train GFLOP/s | train fraction |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in eff["points"]:
        mark = "~" if row["estimated"] else ""
        lines.append(
            f"| {row['backend']} | {fmt_length(row['length'])} | {mark}{row['forward_flops_per_s'] / 1e9:.3g} | "
            f"{mark}{row['forward_fraction']:.1%} | {mark}{row['train_flops_per_s'] / 1e9:.3g} | {mark}{row['train_fraction']:.1%} |"
        )
    return lines + [""]


def markdown(record: Dict[str, Any]) -> str:
    """The record as markdown tables: throughput, time, memory, speedup, slopes, efficiency."""
    lines = header(record)
    with_full = "full" in record["settings"]["backends"]
    lines += grid(record, "Train throughput (tokens/s)", lambda p, _: fmt_count(p["tokens_per_s"]["train"]))
    lines += grid(record, "Train speedup over full", speedup("train"), ceiling=True) if with_full else []
    others = [b for b in record["settings"]["backends"] if b != "full" and not is_timing_reference(b)]
    if with_full and others and any(is_timing_reference(b) for b in record["settings"]["backends"]):
        lines += grid(record, "Train share of the ceiling", ceiling_share("train"), others)
    lines += grid(record, "Train time (median, spread)",
                  lambda p, _: f"{fmt_time(p['train']['median_s'])} ±{p['train']['spread']:.0%}")
    lines += grid(record, "Forward throughput (tokens/s)", lambda p, _: fmt_count(p["tokens_per_s"]["forward"]))
    lines += grid(record, "Forward speedup over full", speedup("forward"), ceiling=True) if with_full else []
    lines += grid(record, f"Peak memory ({memory_kind(record)})", lambda p, _: fmt_mem(p.get("peak_mem_mb")))
    if record["level"] == "model":
        lines += grid(record, "Batch size", lambda p, _: str(p["batch"]))
    lines += ["**Slope of time against N (log-log)**: fit over all lengths / over the two longest", "",
              "| backend | forward | train |", "|---|---:|---:|"]
    for backend, entry in record["slopes"].items():
        est = " (with estimates)" if entry["estimated_lengths"] else ""
        lines.append(f"| {label(backend)}{est} | {fmt_slope(entry['forward'])} / {fmt_slope(entry['forward_last_two'])} | "
                     f"{fmt_slope(entry['train'])} / {fmt_slope(entry['train_last_two'])} |")
    lines.append("")
    lines += efficiency_lines(record)
    return "\n".join(lines)


def memory_kind(record: Dict[str, Any]) -> str:
    if record["hardware"]["device"] == "cuda":
        return "torch.cuda.max_memory_allocated"
    if "timed runs with every freed block kept" in record.get("versions", {}).get("allocator", ""):
        return "peak RSS of the point's process until its timed runs, minus its RSS before the point"
    return "peak RSS of the point's process minus its RSS before the point"


# more backends than this in a record: one panel per family instead of one for all
FAMILY_PANELS_FROM = 9
FAMILY_TITLES = {"routing": "routing", "compression": "compression", "both": "routing and compression",
                 "none": "neither: every key", "unregistered": "not registered"}


def timed(record: Dict[str, Any], backend: str) -> List[Dict[str, Any]]:
    return [p for p in record["points"] if p["backend"] == backend and p["status"] in TIMED]


def plot(record: Dict[str, Any]) -> bytes:
    """Log-log plot (PNG) against N: train throughput and peak memory for a few backends; for many, one
    column per family (the taxonomy's scaling strategy) of train time and peak memory, with full attention
    and guides of slope 1 and 2 in every time panel, so each backend's cost curve reads off its panel.
    Hollow markers and dashed lines are estimates."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b in record["settings"]["backends"] if timed(record, b)]
    fig = (family_panels(plt, record, backends) if len(backends) >= FAMILY_PANELS_FROM
           else two_panels(plt, record, backends))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def draw(ax: Any, points: List[Dict[str, Any]], value: Callable[[Dict[str, Any]], float], **style: Any) -> Any:
    """One backend's line through its points, dashed where any is an estimate, hollow markers on estimates."""
    dashed = "--" if any(p["estimated"] for p in points) else "-"
    line, = ax.plot([p["length"] for p in points], [value(p) for p in points], dashed, **style)
    for p in points:
        ax.plot(p["length"], value(p), "o", ms=4, mfc="none" if p["estimated"] else line.get_color(),
                color=line.get_color())
    return line


def axes_style(ax: Any, lengths: List[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [fmt_length(n) for n in lengths])
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)


def two_panels(plt: Any, record: Dict[str, Any], backends: List[str]) -> Any:
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for backend in backends:
        points = timed(record, backend)
        line = draw(ax_t, points, lambda p: p["tokens_per_s"]["train"], label=backend)
        mem = [(p["length"], p["peak_mem_mb"]) for p in points if p.get("peak_mem_mb") is not None]
        if mem:
            ax_m.plot(*zip(*mem), "o-", color=line.get_color(), label=backend)
    lengths = record["settings"]["lengths"]
    for ax, label in ((ax_t, "train tokens / s"), (ax_m, "peak memory (MB)")):
        axes_style(ax, lengths, label)
        if ax.get_lines():
            ax.legend(fontsize=8)
    ax_t.set_title(f"train throughput, {record['level']} level, {describe(record['hardware'])}", fontsize=9)
    ax_m.set_title("peak memory (estimated points have none: their lines are dashed)", fontsize=9)
    return fig


def family_panels(plt: Any, record: Dict[str, Any], backends: List[str]) -> Any:
    from attentions import scaling_of

    families: Dict[str, List[str]] = {}
    for backend in backends:
        families.setdefault(scaling_of(backend), []).append(backend)
    order = [f for f in FAMILY_TITLES if f in families]
    fig, axes = plt.subplots(2, len(order), figsize=(4.2 * len(order), 7.6), squeeze=False, sharey="row")
    lengths = record["settings"]["lengths"]
    reference = timed(record, "full")
    for column, family in enumerate(order):
        ax_t, ax_m = axes[0][column], axes[1][column]
        if reference:
            # guides through full attention's first point: the cost of a linear and of a quadratic method
            n0, t0 = reference[0]["length"], reference[0]["train"]["median_s"]
            ends = [n0, lengths[-1]]
            ax_t.plot(ends, [t0 * n / n0 for n in ends], ":", color="grey", lw=1, label="slope 1 (cost ~ N)")
            ax_t.plot(ends, [t0 * (n / n0) ** 2 for n in ends], "-.", color="grey", lw=1, label="slope 2 (cost ~ N^2)")
            if family != scaling_of("full"):
                draw(ax_t, reference, lambda p: p["train"]["median_s"], color="black", lw=1, label="full")
        others = [b for b in families[family] if b != "full"]
        for backend in families[family]:
            points = timed(record, backend)
            colour = "black" if backend == "full" else f"C{others.index(backend) % 10}"
            draw(ax_t, points, lambda p: p["train"]["median_s"], color=colour, label=backend)
            mem = [(p["length"], p["peak_mem_mb"]) for p in points if p.get("peak_mem_mb") is not None]
            if mem:
                ax_m.plot(*zip(*mem), "o-", ms=4, color=colour, label=backend)
        axes_style(ax_t, lengths, "train time per call (s)" if column == 0 else "")
        axes_style(ax_m, lengths, "peak memory (MB)" if column == 0 else "")
        ax_t.set_title(FAMILY_TITLES[family], fontsize=10)
        ax_t.legend(fontsize=7, loc="upper left")
        if ax_m.get_lines():
            ax_m.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"one attention call (forward + backward), {record['level']} level, {describe(record['hardware'])}: "
                 "time and memory against N by family (hollow, dashed: estimated from a slice of the queries)",
                 fontsize=9)
    return fig
