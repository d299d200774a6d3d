"""Plots of result records (matplotlib, Agg backend, PNG): accuracy by task, accuracy against training
time, and MQAR's two plots (plots_recall.py); every one scales to 22 backends and more by drawing one
panel per task or per family, with MiTA drawn apart (plot_style.py).

Only completed runs are drawn; a diverged (backend, task) has no bar and no point. The two LRA plots
carry the majority-class accuracy of each task, the bar plot the published full-attention numbers
beside it; error bars appear only where a bar or point has several seeds.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib.pyplot as plt
from matplotlib.collections import PathCollection
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from ..format import model
from . import plot_style
from .plot_style import (FAMILIES, FAMILY_COLOURS, FOCUS, FOCUS_STYLE, bold_focus, by_family, family_of, family_title,
                         finish, line_styles, save, tuned_keys)
from .plots_recall import recall_by_family, recall_vs_pairs
from .summary import TASKS, TITLES

# lra/analyze/plots.py writes its figures with the same save
__all__ = ["FAMILIES", "by_family", "plot_all", "recall_by_family", "recall_vs_pairs", "save"]

# rows of reference/published_lra.csv that are full (softmax) attention: (source, model)
PUBLISHED_FULL = {("tay2021_lra", "Transformer"), ("nystromformer2021", "Standard"),
                  ("skyformer2021", "Self-attention"), ("xformers_lra", "Standard")}
Series = Dict[str, Dict[str, List[Dict[str, Any]]]]


def by_series(records: List[Dict[str, Any]], order: List[str]) -> Series:
    """Completed records by series label (the row, ``format.model``, or "row (preset)" when several
    presets) and task."""
    presets = {r["preset"] for r in records}
    series: Series = defaultdict(lambda: defaultdict(list))
    for record in sorted(records, key=lambda r: (order.index(model(r)) if model(r) in order else len(order), r["preset"])):
        if record["status"] == "completed" and record["test_acc"] is not None:
            label = model(record) if len(presets) == 1 else f"{model(record)} ({record['preset']})"
            series[label][record["task"]].append(record)
    return series


def task_order(series: Series) -> List[str]:
    tasks = [t for t in TASKS if any(t in s for s in series.values())]
    return tasks + sorted({t for s in series.values() for t in s} - set(tasks))


def majority(series: Series) -> Dict[str, float]:
    """Majority-class test accuracy (%) of each task (it depends on the test split only)."""
    return {t: 100.0 * rs[0]["majority_acc"] for s in series.values() for t, rs in s.items()
            if rs and rs[0].get("majority_acc") is not None}


def published_full(published: List[Dict[str, str]]) -> Dict[str, Tuple[float, float, int]]:
    """Per task, the (lowest, highest, count) of the published full-attention accuracies (%)."""
    values: Dict[str, List[float]] = defaultdict(list)
    for row in published:
        if (row.get("source"), row.get("model")) not in PUBLISHED_FULL:
            continue
        for task in TASKS:
            text = (row.get("path_x" if task == "pathx" else task) or "").strip()
            try:
                values[task].append(float(text))
            except ValueError:
                continue
    return {t: (min(v), max(v), len(v)) for t, v in values.items() if v}


def presets_text(series: Series) -> str:
    """The presets drawn, and what was tuned where some backends' runs come from a tuning grid (those
    are drawn at their chosen values, the others at the preset's)."""
    records = [r for s in series.values() for rs in s.values() for r in rs]
    presets = sorted({r["preset"] for r in records})
    keys = tuned_keys(records)
    note = f"; {', '.join(keys)} tuned where the table says" if keys else ""
    return f"preset {', '.join(presets)}{note}"


def attn_of(series: Series) -> Dict[str, str]:
    """The backend of each series label ("attn" or "attn (preset)")."""
    return {label: next(r["attn"] for rs in per_task.values() for r in rs) for label, per_task in series.items()}


def rows_by_family(series: Series) -> Tuple[Dict[str, float], List[Tuple[str, float]], float]:
    """The y position of each series, its family's rows together under the family's name, top to bottom:
    (label -> y, [(family, y of its name)], the height of it all)."""
    backends = attn_of(series)
    ys: Dict[str, float] = {}
    headers: List[Tuple[str, float]] = []
    y = 0.0
    for family, members in by_family(list(series), name=backends.__getitem__):
        headers.append((family, y))
        y += 0.9
        for label in members:
            ys[label] = y
            y += 1.0
        y += 0.3
    return ys, headers, y


def accuracy_bars(series: Series, path: Path, published: Optional[List[Dict[str, str]]] = None) -> Path:
    """One panel per task; in each, one horizontal bar per backend, the backends grouped by family (its
    name above its rows), the bar's length its mean test accuracy with the value at its end, an error
    bar (sample std) only where several seeds; bars coloured by family, MiTA's red and its name in bold;
    per task a dashed majority-class line and a grey band spanning the published full-attention
    accuracies. A new backend adds a row, a new task a panel: neither narrows the bars."""
    tasks = task_order(series)
    backends = attn_of(series)
    ys, headers, height = rows_by_family(series)
    fig, axes = plt.subplots(1, len(tasks), figsize=(2.2 + 3.0 * len(tasks), 0.9 + 0.26 * height), sharey=True,
                             squeeze=False)
    reference = published_full(published or [])
    counts_seen = {len(runs) for per_task in series.values() for runs in per_task.values() if runs}
    uniform = counts_seen.pop() if len(counts_seen) == 1 else None
    several = False
    for ax, task in zip(axes[0], tasks):
        top = 0.0
        for label, per_task in series.items():
            values = [100.0 * r["test_acc"] for r in per_task.get(task, [])]
            if not values:
                continue
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            several = several or len(values) > 1
            focus = backends[label] == FOCUS
            colour = FOCUS_STYLE["color"] if focus else FAMILY_COLOURS.get(family_of(backends[label]), "#bcbd22")
            ax.barh(ys[label], mean, height=0.72, color=colour, edgecolor="black" if focus else "none", linewidth=1.2)
            if len(values) > 1:
                ax.errorbar(mean, ys[label], xerr=std, fmt="none", ecolor="black", capsize=2, linewidth=0.8)
            seeds = "" if uniform else f" ({len(values)})"
            ax.text(mean + std + 0.6, ys[label], f"{mean:.1f}{seeds}", va="center", fontsize=7,
                    fontweight="bold" if focus else "normal")
            top = max(top, mean + std)
        if task in majority(series):
            ax.axvline(majority(series)[task], color="black", linestyle="--", linewidth=1.1,
                       label="majority class (test split)")
            top = max(top, majority(series)[task])
        if task in reference:
            low, high, _ = reference[task]
            ax.axvspan(low, high, color="0.82", zorder=0, label="published full attention, paper protocols (range)")
            top = max(top, high)
        ax.set_xlim(0, min(100.0, top * 1.12 + 6))
        ax.set_title(TITLES.get(task, task), fontsize=10)
        ax.set_xlabel("test accuracy (%)")
        ax.grid(axis="x", alpha=0.3)
    first = axes[0][0]
    order = sorted(series, key=ys.__getitem__)
    first.set_yticks([ys[label] for label in order], order, fontsize=8)
    bold_focus(first.get_yticklabels())
    first.set_ylim(height, -0.6)
    for family, y in headers:
        first.annotate(family_title(family), (0, y), xycoords=("axes fraction", "data"), xytext=(-4, 0),
                       textcoords="offset points", ha="right", va="center", fontsize=8, fontstyle="italic",
                       fontweight="bold")
    if uniform and uniform > 1:
        seeds = f"{uniform} seeds per bar, error bars: their std"
    else:
        seeds = "error bars: std over seeds, where 2 or more; (n): seeds" if several else "one seed per bar, so no error bars"
    handles, names = first.get_legend_handles_labels()
    for ax in axes[0][1:]:
        more, more_names = ax.get_legend_handles_labels()
        handles, names = handles + more, names + more_names
    legend = dict(zip(names, handles))
    fig.legend(list(legend.values()), list(legend), fontsize="small", loc="lower center",
               bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    fig.suptitle(f"Test accuracy by task and backend, backends by family ({presets_text(series)}; {seeds})", fontsize=10)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    return plot_style.save(fig, path)


# tick marks of the time axis, in seconds: round numbers of seconds, minutes and hours
TIME_TICKS = [1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 18000, 36000, 86400, 172800, 432000]


def duration_label(seconds: float, _pos: Any = None) -> str:
    """A tick label in plain units: 30 s, 10 min, 2 h, 1 d."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def accuracy_vs_time(series: Series, path: Path) -> Path:
    """Small multiples by family: in each family's panel, one labelled point per (backend, task) of that
    family, mean training time (log x) against mean test accuracy, each backend in a colour and marker of
    its own (a marker per task where there are several); MiTA (a red star) in every panel as the
    reference (its family has no panel of its own when it is alone there), every other backend a grey
    dot behind; each task's majority class a dashed line. A point
    of several seeds carries their spread: the sample std of the accuracy (as the accuracy table's ±)
    and the range of the train times. The panels share axes that span at least a factor of 10 in time
    and 10 points in accuracy, so close runs are not stretched over the whole plot."""
    tasks = task_order(series)
    backends = attn_of(series)
    task_markers = dict(zip(TASKS, "osD^vP"))
    # a family of MiTA alone has no panel of its own: MiTA is in every panel
    families = [(family, members) for family, members in by_family(list(series), name=backends.__getitem__)
                if {backends[label] for label in members} != {FOCUS}] or by_family(list(series), name=backends.__getitem__)
    columns = min(3, len(families))
    rows_ = math.ceil(len(families) / columns)
    fig, axes = plt.subplots(rows_, columns, figsize=(5.2 * columns, 4.4 * rows_), sharex=True, sharey=True,
                             squeeze=False)
    points = {(label, task): (statistics.fmean([r["train_time_s"] for r in rs]),
                              statistics.fmean([100.0 * r["test_acc"] for r in rs]), rs)
              for label, per_task in series.items() for task, rs in per_task.items()}
    times = [r["train_time_s"] for *_, rs in points.values() for r in rs]
    accs = [acc for _, acc, _ in points.values()] + list(majority(series).values())
    several = False
    labelled: List[Tuple[Any, List[Tuple[str, str, float, float]]]] = []
    for ax, (family, members) in zip(axes.flat, families):
        focus = [label for label in series if backends[label] == FOCUS]
        shown = members + [label for label in focus if label not in members]
        styles = line_styles(shown)
        for (label, task), (time, acc, _) in points.items():
            if label not in shown:
                ax.scatter(time, acc, color="0.75", s=14, zorder=1, marker=task_markers.get(task, "x"))
        placed: List[Tuple[str, str, float, float]] = []
        for label in shown:
            style = styles[label]
            for task in series[label]:
                time, acc, rs = points[(label, task)]
                marker = style["marker"] if len(tasks) == 1 else task_markers.get(task, "x")
                size = 150 if backends[label] == FOCUS else 40
                ax.scatter(time, acc, color=style["color"], marker=marker, s=size, zorder=style["zorder"],
                           edgecolors="black" if backends[label] == FOCUS else "none", linewidths=0.6)
                placed.append((label, style["color"], time, acc))
                if len(rs) > 1:
                    several = True
                    seed_times = [r["train_time_s"] for r in rs]
                    std = statistics.stdev([100.0 * r["test_acc"] for r in rs])
                    ax.errorbar(time, acc, yerr=std, xerr=[[time - min(seed_times)], [max(seed_times) - time]],
                                fmt="none", ecolor=style["color"], alpha=0.6, capsize=2, linewidth=1, zorder=2)
                    accs.extend([acc - std, acc + std])
        for n, (task, value) in enumerate(sorted(majority(series).items())):
            name = f" ({TITLES.get(task, task)})" if len(tasks) > 1 else ""
            ax.axhline(value, color="black", linestyle="--", linewidth=1, dashes=(4, 2 + 2 * n),
                       label=f"majority class{name}")
        ax.set_title(f"{family_title(family)}: {len(members)} backend{'s' if len(members) != 1 else ''}"
                     + (f" (and {FOCUS}, red)" if family_of(FOCUS) != family and focus else ""), fontsize=9)
        ax.set_xscale("log")
        labelled.append((ax, placed))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(families):]:
        ax.set_visible(False)
    time_axis(axes[0][0], times)
    low_acc, high_acc = min(accs), max(accs)
    pad = max(0.0, 10.0 - (high_acc - low_acc)) / 2 + 2.0
    axes[0][0].set_ylim(max(0.0, low_acc - pad), min(100.0, high_acc + pad))
    axes[0][0].yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    for ax in axes[-1]:
        ax.set_xlabel("training time (wall-clock of the training steps, log scale)")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    handles: Dict[str, Any] = {}
    if len(tasks) > 1:
        for task in tasks:
            handles[TITLES.get(task, task)] = axes[0][0].scatter([], [], color="gray", marker=task_markers.get(task, "x"))
    for handle, name in zip(*axes[0][0].get_legend_handles_labels()):
        handles.setdefault(name, handle)
    bars = "; bars: std of the accuracy and range of the time over seeds" if several else ""
    # the labels go on last, once the limits and the layout are final: they are placed in points
    return finish(fig, f"Test accuracy against training time, by family ({presets_text(series)}; grey: the other "
                  f"families{bars})", handles, path,
                  before_save=lambda: label_panels(labelled))


def time_axis(ax: Any, times: List[float]) -> None:
    """The shared log time axis: at least a decade, centred on the runs, ticks at round durations."""
    low, high = min(times), max(times)
    spread = max(high / low, 10.0)
    centre = math.sqrt(low * high)
    ax.set_xlim(centre / math.sqrt(spread) / 1.2, centre * math.sqrt(spread) * 1.2)
    ax.xaxis.set_major_locator(FixedLocator(TIME_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(duration_label))
    ax.xaxis.set_minor_formatter(NullFormatter())


def label_panels(labelled: List[Tuple[Any, List[Tuple[str, str, float, float]]]]) -> None:
    for ax, placed in labelled:
        label_points(ax, placed, markers_of(ax))


def markers_of(ax: Any) -> List[Tuple[float, float, float]]:
    """Every scatter marker drawn on ``ax``: x, y (display points) and half its width (points)."""
    to_points = 72.0 / ax.figure.dpi
    found = []
    for collection in ax.collections:
        if not isinstance(collection, PathCollection):  # error bars are line collections
            continue
        offsets, sizes = collection.get_offsets(), collection.get_sizes()
        for n, (x, y) in enumerate(offsets):
            px, py = (c * to_points for c in ax.transData.transform((x, y)))
            found.append((px, py, math.sqrt(sizes[n % len(sizes)]) / 2))
    return found


def label_points(ax: Any, points: List[Tuple[str, str, float, float]],
                 markers: Sequence[Tuple[float, float, float]] = ()) -> None:
    """Name every point beside it, in the first place near it where the label covers no label already
    placed, no marker and nothing outside the panel: right of the point, above then below, then left,
    then further up or down a line at a time, right or left, with a thin leader back to its point, so
    close runs (several backends on the same plateau) stay readable without the legend. Call it once
    the axes' limits and the figure's layout are final: the places are worked out in display points."""
    to_points = 72.0 / ax.figure.dpi
    (left, bottom), (right, top) = (c * to_points for c in ax.get_window_extent().get_points())
    boxes: List[Tuple[float, float, float, float]] = [(x - r, y - r, x + r, y + r) for x, y, r in markers]

    def free(box: Tuple[float, float, float, float], within: bool) -> bool:
        x0, y0, x1, y1 = box
        if within and not (left <= x0 and x1 <= right and bottom <= y0 and y1 <= top):
            return False
        return not any(x0 < b2 and b0 < x1 and y0 < b3 and b1 < y1 for b0, b1, b2, b3 in boxes)

    renderer = ax.figure.canvas.get_renderer()
    for label, color, time, acc in sorted(points, key=lambda p: (p[3], p[2])):
        px, py = (c * to_points for c in ax.transData.transform((time, acc)))
        probe = ax.text(0, 0, label, fontsize=7)  # the label's size as it will be drawn
        extent = probe.get_window_extent(renderer)
        probe.remove()
        width, height = extent.width * to_points + 1, extent.height * to_points + 1  # a point apart
        near = [(5.0, 3.0), (5.0, -3.0 - height), (-5.0 - width, 3.0), (-5.0 - width, -3.0 - height)]
        further = [(x, sign * (3.0 + step * height) - (height if sign < 0 else 0.0))
                   for step in range(1, 10) for sign in (1, -1) for x in (5.0, -5.0 - width)]
        candidates = near + further
        # inside the panel where there is room, else (a point at its edge) the first place clear of the rest
        dx, dy = next(((x, y) for within in (True, False) for x, y in candidates
                       if free((px + x, py + y, px + x + width, py + y + height), within)), near[0])
        boxes.append((px + dx, py + dy, px + dx + width, py + dy + height))
        arrow = {"arrowstyle": "-", "color": color, "linewidth": 0.5} if (dx, dy) not in near else None
        ax.annotate(label, (time, acc), textcoords="offset points", xytext=(dx, dy), fontsize=7, color=color,
                    va="bottom", arrowprops=arrow)


def plot_all(records: List[Dict[str, Any]], out: Path, order: List[str],
             published: Optional[List[Dict[str, str]]] = None) -> List[Path]:
    """Both plots under ``out``; none when no run completed."""
    series = by_series(records, order)
    if not series:
        return []
    return [accuracy_bars(series, out / "accuracy_by_task.png", published),
            accuracy_vs_time(series, out / "accuracy_vs_time.png")]
