"""The plot of the regenerated LRA Table 2 (lra/tables/table2.py): each backend's training speed and
peak memory relative to full attention against N, from an interleaved Text record.

Four panels: speed (top) and memory (bottom) over full attention's; on the left the mechanisms the
paper timed, ours solid and the published ratios (over the published Transformer's) dashed in the
same colour; on the right every other backend. A dotted line marks 1 (as full attention)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from attentions import is_timing_reference, list_attentions  # noqa: E402

from ..bench.report import fmt_length  # noqa: E402
from ..machine import describe  # noqa: E402
from .plots import save  # noqa: E402
from .published import claims  # noqa: E402
from .table2 import MEMORY, PAPER_LENGTHS, PRINTED, SPEED, TIMED  # noqa: E402


def minor_label(value: float, _pos: int) -> str:
    """A log axis's minor tick label (2x, 0.3x, ...), none for 7-9 of a decade: those crowd the next
    decade's label (0.9x under 1x)."""
    mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0.0
    return f"{value:g}x" if 0 < mantissa < 6.5 else ""


def our_ratios(record: Dict[str, Any], backend: str, key: str) -> List[tuple]:
    """(N, ratio to full) of one backend where both were measured: speed (steps/s) or memory."""
    index = {(p["backend"], p["length"]): p for p in record["points"]}
    out = []
    for n in record["settings"]["lengths"]:
        point, full = index.get((backend, n)), index.get(("full", n))
        if point is None or full is None or point["status"] not in TIMED or full["status"] not in TIMED:
            continue
        if key == SPEED:
            out.append((n, full["train"]["median_s"] / point["train"]["median_s"]))
        elif point.get("peak_mem_mb") is not None and full.get("peak_mem_mb"):
            out.append((n, point["peak_mem_mb"] / full["peak_mem_mb"]))
    return out


def paper_ratios(values: Dict[str, List[Optional[float]]], reference: Dict[str, List[Optional[float]]],
                 key: str) -> List[tuple]:
    """(N, published ratio to the published Transformer) at 1K-4K (1K = 1,024 on the plot's axis): the
    printed speed-ups, the memory ratios computed from the printed GB."""
    if key == SPEED and values.get(PRINTED):
        return [(1024 * (i + 1), x) for i, x in enumerate(values[PRINTED]) if x is not None]
    mine, full = values.get(key) or [], reference.get(key) or []
    return [(1024 * (i + 1), m / f) for i, (m, f) in enumerate(zip(mine, full)) if m is not None and f]


def table2_plot(record: Dict[str, Any], published: Dict[str, Dict[str, List[Optional[float]]]], path: Path) -> Path:
    """Draw the record beside the published ratios into ``path`` (PNG)."""
    owner = claims()
    reference = published.get(next((m for m, b in owner.items() if b == "full" and m in published), ""), {})
    timed_by_paper = {b: m for m, b in owner.items() if m in published and b != "full"}
    backends = [b for b in list_attentions() if b in record["settings"]["backends"] and not is_timing_reference(b)
                and b != "full"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    lengths = record["settings"]["lengths"]
    for row, (key, label) in enumerate(((SPEED, "training steps/s over full attention's"),
                                        (MEMORY, "peak memory over full attention's"))):
        left, right = axes[row]
        others = [b for b in backends if b not in timed_by_paper]
        for column, (ax, names) in enumerate(((left, [b for b in backends if b in timed_by_paper]), (right, others))):
            for i, backend in enumerate(names):
                colour = plt.get_cmap("tab20")(i % 20) if len(names) > 10 else f"C{i}"
                points = our_ratios(record, backend, key)
                if points:
                    ax.plot(*zip(*points), "o-", color=colour, lw=1.5, ms=4, label=backend)
                if column == 0:
                    paper = paper_ratios(published[timed_by_paper[backend]], reference, key)
                    if paper:
                        ax.plot(*zip(*paper), "s--", color=colour, lw=1, ms=3, alpha=0.8,
                                label=f"{timed_by_paper[backend]} (published)")
            ax.axhline(1.0, color="grey", ls=":", lw=1)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}x"))
            ax.yaxis.set_minor_formatter(FuncFormatter(minor_label))
            ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_xticks(lengths, [fmt_length(n) for n in lengths])
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylabel(label if column == 0 else "")
            # one legend a column, under its lower panel (the upper one draws the same backends)
            if row == 1 and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, ncol=2 if column == 0 else 3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        left.set_title("mechanisms the paper timed: ours solid, published dashed" if row == 0 else "", fontsize=9)
        right.set_title("the suite's other backends" if row == 0 else "", fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("sequence length N (published: " + ", ".join(PAPER_LENGTHS) + ")")
    fig.suptitle(f"LRA Table 2 regenerated: Text model, each backend over full attention in the same process, "
                 f"{describe(record['hardware'])}; published: 4x4 TPU V3, batch 32", fontsize=10)
    fig.tight_layout()
    return save(fig, path)
