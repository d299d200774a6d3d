"""The plot of a throughput record (``lra-bench`` writes it as throughput.png): train throughput and
peak memory against N on log-log axes for a few backends; for many, one column per family.
"""
from __future__ import annotations

import io
from typing import Any, Callable, Dict, List

from ..machine import describe
from .report import TIMED, fmt_length

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


def batches(record: Dict[str, Any]) -> Dict[int, int]:
    """Each length's batch where an interleaved record's lengths ran at different batches (the sweep
    halves it for every backend of a length), else {}."""
    batch = {row["length"]: row["batch"] for row in record.get("per_length") or []}
    return batch if len(set(batch.values())) > 1 else {}


def axes_style(ax: Any, lengths: List[int], label: str, batch: Dict[int, int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [fmt_length(n) + (f"\nB={batch[n]}" if n in batch else "") for n in lengths])
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
        axes_style(ax, lengths, label, batches(record))
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
    batch = batches(record)

    def seconds(point: Dict[str, Any]) -> float:
        # where the batch differs between lengths, a step's time per sequence keeps the slopes readable
        return point["train"]["median_s"] / (point["batch"] if batch else 1)

    for column, family in enumerate(order):
        ax_t, ax_m = axes[0][column], axes[1][column]
        if reference:
            # guides through full attention's first point: the cost of a linear and of a quadratic method
            n0, t0 = reference[0]["length"], seconds(reference[0])
            ends = [n0, lengths[-1]]
            ax_t.plot(ends, [t0 * n / n0 for n in ends], ":", color="grey", lw=1, label="slope 1 (cost ~ N)")
            ax_t.plot(ends, [t0 * (n / n0) ** 2 for n in ends], "-.", color="grey", lw=1, label="slope 2 (cost ~ N^2)")
            if family != scaling_of("full"):
                draw(ax_t, reference, seconds, color="black", lw=1, label="full")
        others = [b for b in families[family] if b != "full"]
        for backend in families[family]:
            points = timed(record, backend)
            colour = "black" if backend == "full" else f"C{others.index(backend) % 10}"
            draw(ax_t, points, seconds, color=colour, label=backend)
            mem = [(p["length"], p["peak_mem_mb"]) for p in points if p.get("peak_mem_mb") is not None]
            if mem:
                ax_m.plot(*zip(*mem), "o-", ms=4, color=colour, label=backend)
        time_label = ("train time per call (s)" if record["level"] == "attention" else
                      "train time per step / batch (s)" if batch else "train time per step (s)")
        axes_style(ax_t, lengths, time_label if column == 0 else "", batch)
        axes_style(ax_m, lengths, ("peak memory per step (MB)" if batch else "peak memory (MB)") if column == 0 else "",
                   batch)
        ax_t.set_title(FAMILY_TITLES[family], fontsize=10)
        ax_t.legend(fontsize=7, loc="upper left")
        if ax_m.get_lines():
            ax_m.legend(fontsize=7, loc="upper left")
    what = "one attention call (forward + backward)" if record["level"] == "attention" else "one training step"
    fig.suptitle(f"{what}, {record['level']} level, {describe(record['hardware'])}: "
                 "time and memory against N by family (hollow, dashed: estimated from a slice of the queries)",
                 fontsize=9)
    return fig
