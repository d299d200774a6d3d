"""Plots of result records (matplotlib, Agg backend, PNG): accuracy by task, accuracy against training
time, MQAR's recall against the number of key-value pairs, and every backend's recall grouped by family.

Only completed runs are drawn; a diverged (backend, task) has no bar and no point. The two LRA plots
carry the majority-class accuracy of each task, the bar plot the published full-attention numbers
beside it; error bars appear only where a bar or point has several seeds; legends sit outside the axes.
"""
from __future__ import annotations

import io
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: E402

from ..files import write_atomic  # noqa: E402
from ..format import model  # noqa: E402
from .recall import Cells  # noqa: E402
from .summary import TASKS, TITLES  # noqa: E402

# rows of reference/published_lra.csv that are full (softmax) attention: (source, model)
PUBLISHED_FULL = {("tay2021_lra", "Transformer"), ("nystromformer2021", "Standard"),
                  ("skyformer2021", "Self-attention"), ("xformers_lra", "Standard")}
Series = Dict[str, Dict[str, List[Dict[str, Any]]]]


def save(fig: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path


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
    presets = sorted({r["preset"] for s in series.values() for rs in s.values() for r in rs})
    return f"preset {', '.join(presets)}"


def accuracy_bars(series: Series, path: Path, published: Optional[List[Dict[str, str]]] = None) -> Path:
    """Grouped bars: tasks on the x axis, one bar per backend with its value on top; error bars (sample
    std) only on bars of several seeds; per task a dashed majority-class line and a grey stroke spanning
    the published full-attention accuracies."""
    tasks = task_order(series)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 * len(tasks) + 0.35 * len(series) * len(tasks)), 4.2))
    top = 0.0
    several = False
    # one seed count for every bar: said once in the title, not above each bar (narrow bars' labels collide)
    counts_seen = {len(runs) for per_task in series.values() for runs in per_task.values() if runs}
    uniform = counts_seen.pop() if len(counts_seen) == 1 else None
    for i, (label, per_task) in enumerate(series.items()):
        xs, means, stds, counts = [], [], [], []
        for j, task in enumerate(tasks):
            values = [100.0 * r["test_acc"] for r in per_task.get(task, [])]
            if values:
                xs.append(j - 0.4 + width * (i + 0.5))
                means.append(statistics.fmean(values))
                stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
                counts.append(len(values))
        several = several or any(stds)
        ax.bar(xs, means, width * 0.9, label=label, color=f"C{i % 10}")
        spread = [(x, m, s) for x, m, s, n in zip(xs, means, stds, counts) if n > 1]
        if spread:
            ax.errorbar([x for x, _, _ in spread], [m for _, m, _ in spread], yerr=[s for _, _, s in spread],
                        fmt="none", ecolor="black", capsize=3, linewidth=1)
        for x, mean, std, count in zip(xs, means, stds, counts):
            text = f"{mean:.1f}" if uniform else f"{mean:.1f}\n{count} seed{'s' if count > 1 else ''}"
            ax.text(x, mean + std + 0.8, text, ha="center",
                    va="bottom", fontsize=7, zorder=4, bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1})
        top = max([top, *(m + s for m, s in zip(means, stds))])
    for j, task in enumerate(tasks):
        if task in majority(series):
            value = majority(series)[task]
            ax.hlines(value, j - 0.45, j + 0.45, colors="black", linestyles="--", linewidth=1.2,
                      label="majority class (test split)" if j == tasks.index(next(t for t in tasks if t in majority(series))) else None)
            top = max(top, value)
    reference = published_full(published or [])
    first = True
    for j, task in enumerate(tasks):
        if task in reference:
            low, high, count = reference[task]
            # a grey stroke at the right edge of the task's group, from the lowest to the highest value
            ax.vlines(j + 0.47, low - 0.2, high + 0.2, colors="0.45", linewidth=5,
                      label="published full attention, paper protocols (range)" if first else None)
            first = False
            top = max(top, high)
    ax.set_xticks(range(len(tasks)), [TITLES.get(t, t) for t in tasks])
    ax.set_xlim(-0.6, len(tasks) - 0.35)
    ax.set_ylim(0, min(100.0, top * 1.15 + 5))
    ax.set_ylabel("test accuracy (%)")
    if uniform and uniform > 1:
        seeds = f"{uniform} seeds per bar, error bars: their std"
    else:
        seeds = "error bars: std over seeds, where 2 or more" if several else "one seed per bar, so no error bars"
    ax.set_title(f"Test accuracy by task ({presets_text(series)}; {seeds})", fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


# tick marks of the time axis, in seconds: round numbers of seconds, minutes and hours
TIME_TICKS = [1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 18000, 36000, 86400, 172800, 432000]


def duration_label(seconds: float, _pos: Any = None) -> str:
    """A tick label in plain units: 30 s, 10 min, 2 h, 1 d."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def accuracy_vs_time(series: Series, path: Path) -> Path:
    """One labelled point per (backend, task): mean training time (log x) against mean test accuracy,
    with each task's majority class as a dashed line. A point of several seeds carries their spread:
    the sample std of the accuracy (as the accuracy table's ±) and the range of the train times. Axes
    span at least a factor of 10 in time and 10 points in accuracy, so close runs are not stretched
    over the whole plot."""
    markers = dict(zip(TASKS, "osD^vP"))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    times: List[float] = []
    accs: List[float] = []
    points: List[Tuple[str, str, float, float]] = []  # label, colour, time, accuracy
    several = False
    for i, (label, per_task) in enumerate(series.items()):
        color = f"C{i % 10}"
        for task, records in per_task.items():
            seed_times = [r["train_time_s"] for r in records]
            seed_accs = [100.0 * r["test_acc"] for r in records]
            time, acc = statistics.fmean(seed_times), statistics.fmean(seed_accs)
            ax.scatter(time, acc, color=color, marker=markers.get(task, "x"), s=40, zorder=3)
            points.append((label, color, time, acc))
            times += [min(seed_times), max(seed_times)]
            accs.append(acc)
            if len(records) > 1:
                several = True
                std = statistics.stdev(seed_accs)
                ax.errorbar(time, acc, yerr=std, xerr=[[time - min(seed_times)], [max(seed_times) - time]],
                            fmt="none", ecolor=color, alpha=0.6, capsize=2, linewidth=1, zorder=2)
                accs += [acc - std, acc + std]
        ax.scatter([], [], color=color, marker="o", label=label)
    tasks = task_order(series)
    for task in tasks:
        if len(tasks) > 1:
            ax.scatter([], [], color="gray", marker=markers.get(task, "x"), label=TITLES.get(task, task))
    for n, (task, value) in enumerate(sorted(majority(series).items())):
        accs.append(value)
        name = f" ({TITLES.get(task, task)})" if len(tasks) > 1 else ""
        ax.axhline(value, color="black", linestyle="--", linewidth=1, dashes=(4, 2 + 2 * n),
                   label=f"majority class{name}")
    ax.set_xscale("log")
    low, high = min(times), max(times)
    # at least a decade, centred on the runs
    spread = max(high / low, 10.0)
    centre = math.sqrt(low * high)
    ax.set_xlim(centre / math.sqrt(spread) / 1.2, centre * math.sqrt(spread) * 1.2)
    ax.xaxis.set_major_locator(FixedLocator(TIME_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(duration_label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    low_acc, high_acc = min(accs), max(accs)
    pad = max(0.0, 10.0 - (high_acc - low_acc)) / 2 + 2.0
    ax.set_ylim(max(0.0, low_acc - pad), min(100.0, high_acc + pad))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    label_points(ax, points)
    ax.set_xlabel("training time (wall-clock of the training steps, log scale)")
    ax.set_ylabel("test accuracy (%)")
    bars = "\nbars: std of the accuracy and range of the time over seeds" if several else ""
    ax.set_title(f"Test accuracy against training time ({presets_text(series)}){bars}", fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return save(fig, path)


def label_points(ax: Any, points: List[Tuple[str, str, float, float]]) -> None:
    """Name every point beside it; a label that would overlap one already placed moves up in steps of
    a line, with a thin leader back to its point, so close runs (several backends on the same
    plateau) stay readable without the legend."""
    to_points = 72.0 / ax.figure.dpi
    placed: List[Tuple[float, float, float]] = []  # x, y (points), width of the label (points)
    for label, color, time, acc in sorted(points, key=lambda p: (p[3], p[2])):
        px, py = (c * to_points for c in ax.transData.transform((time, acc)))
        width = 4.2 * len(label) + 6
        dy = 4.0
        while any(abs(px - qx) < max(width, w) and abs(py + dy - qy) < 8 for qx, qy, w in placed):
            dy += 8.0
        placed.append((px, py + dy, width))
        arrow = {"arrowstyle": "-", "color": color, "linewidth": 0.5} if dy > 4.0 else None
        ax.annotate(label, (time, acc), textcoords="offset points", xytext=(5, dy), fontsize=7, color=color,
                    arrowprops=arrow)


def plot_all(records: List[Dict[str, Any]], out: Path, order: List[str],
             published: Optional[List[Dict[str, str]]] = None) -> List[Path]:
    """Both plots under ``out``; none when no run completed."""
    series = by_series(records, order)
    if not series:
        return []
    return [accuracy_bars(series, out / "accuracy_by_task.png", published),
            accuracy_vs_time(series, out / "accuracy_vs_time.png")]


def panels(cells: Cells) -> Dict[Tuple[str, str, int, int], Cells]:
    """The recall cells by panel: one per protocol, formulation, vocabulary and N."""
    groups: Dict[Tuple[str, str, int, int], Cells] = defaultdict(dict)
    for row, per_pairs in cells.items():
        groups[(row.preset, row.form, row.vocab, row.n)][row] = per_pairs
    return groups


def finish(fig: Any, title: str, handles: Dict[str, Any], path: Path) -> Path:
    """The figure's title and its legend outside the axes, saved to ``path``."""
    fig.suptitle(title, fontsize=10)
    fig.legend(list(handles.values()), list(handles), fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 0.9),
               frameon=False)
    fig.tight_layout()
    return save(fig, path)


def recall_vs_pairs(cells: Cells, path: Path) -> Path:
    """Zoology's plot: test accuracy against the number of key-value pairs, one line per backend (and
    budget) through its mean over seeds, a band from the lowest to the highest seed where several;
    one panel per protocol, formulation, vocabulary and N. A backend keeps its colour in every panel."""
    groups = panels(cells)
    colours = {attn: f"C{i % 10}" for i, attn in enumerate(dict.fromkeys(row.attn for row in cells))}
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.0), squeeze=False, sharey=True)
    handles: Dict[str, Any] = {}
    several = False
    for ax, ((preset, form, vocab, n), rows) in zip(axes[0], groups.items()):
        shown_pairs: List[int] = []
        # a backend run at several budgets: one line style per budget
        budgets_drawn: Dict[str, int] = defaultdict(int)
        for row, per_pairs in rows.items():
            values = {p: [100.0 * r["test_acc"] for r in rs if r["status"] == "completed" and r["test_acc"] is not None]
                      for p, rs in per_pairs.items()}
            pairs = [p for p, v in values.items() if v]
            if not pairs:
                continue
            shown_pairs += pairs
            keys = f"{row.keys} of {n} keys" if row.keys is not None else row.budget
            label = f"{row.attn} ({keys})"
            line, = ax.plot(pairs, [statistics.fmean(values[p]) for p in pairs], marker="o", color=colours[row.attn],
                            linestyle=("-", "--", ":", "-.")[budgets_drawn[row.attn] % 4], label=label)
            budgets_drawn[row.attn] += 1
            handles.setdefault(label, line)
            if any(len(values[p]) > 1 for p in pairs):
                several = True
                ax.fill_between(pairs, [min(values[p]) for p in pairs], [max(values[p]) for p in pairs],
                                color=colours[row.attn], alpha=0.2, linewidth=0)
        ticks = sorted(set(shown_pairs))
        if ticks and ticks[-1] >= 4 * ticks[0]:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(-2, 102)
        ax.set_xlabel("key-value pairs")
        ax.set_title(f"N = {n}, vocab {vocab}, {form} (preset {preset})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy over the queries (%)")
    band = "line: mean over seeds; band: lowest to highest seed" if several else "one seed per point"
    return finish(fig, f"MQAR recall against the number of key-value pairs\n({band})", handles, path)


# the taxonomy's scaling strategies (attentions.base.Taxonomy.scaling) in the order the families are drawn
FAMILIES = (("routing", "routing"), ("compression", "compression"), ("both", "both"), ("none", "neither"))


def by_family(rows: List[Any], name: Callable[[Any], str] = lambda row: row.attn) -> List[Tuple[str, List[Any]]]:
    """The rows grouped by their backend's family (``attentions.scaling_of``), families in ``FAMILIES``
    order (then any other), rows in their given order within a family; a family with no row is left out."""
    from attentions import scaling_of

    groups: Dict[str, List[Any]] = defaultdict(list)
    for row in rows:
        groups[scaling_of(name(row))].append(row)
    order = [f for f, _ in FAMILIES] + sorted(set(groups) - {f for f, _ in FAMILIES})
    return [(f, groups[f]) for f in order if groups.get(f)]


def recall_by_family(cells: Cells, path: Path) -> Path:
    """Every backend's MQAR recall in one figure, grouped by family (the taxonomy's scaling strategy:
    routing, compression, both, neither): one bar per number of key-value pairs, its height the mean over
    seeds, its whisker from the lowest to the highest seed where several. One panel per protocol,
    formulation, vocabulary and N."""
    groups = panels(cells)
    pairs_all = sorted({p for per_pairs in cells.values() for p in per_pairs})
    colours = {p: f"C{i % 10}" for i, p in enumerate(pairs_all)}
    labels = dict(FAMILIES)
    widest = max(len(rows) for rows in groups.values())
    fig, axes = plt.subplots(len(groups), 1, figsize=(max(7.0, 0.45 * widest + 2.0), 3.6 * len(groups)), squeeze=False)
    bar = 0.8 / max(len(pairs_all), 1)
    several = False
    for ax, ((preset, form, vocab, n), rows) in zip(axes[:, 0], groups.items()):
        x, ticks, names = 0.0, [], []
        for family, members in by_family(list(rows)):
            start = x
            for row in members:
                multi = sum(r.attn == row.attn for r in rows) > 1
                names.append(f"{row.attn} ({row.keys} keys)" if multi and row.keys is not None else row.attn)
                ticks.append(x)
                for i, p in enumerate(pairs_all):
                    values = [100.0 * r["test_acc"] for r in rows[row].get(p, [])
                              if r["status"] == "completed" and r["test_acc"] is not None]
                    if not values:
                        continue
                    at = x + (i - (len(pairs_all) - 1) / 2) * bar
                    mean = statistics.fmean(values)
                    ax.bar(at, mean, width=bar, color=colours[p], label=f"{p} pairs")
                    if len(values) > 1:
                        several = True
                        ax.errorbar(at, mean, yerr=[[mean - min(values)], [max(values) - mean]], fmt="none",
                                    ecolor="black", elinewidth=0.7, capsize=1.5)
                x += 1.0
            ax.text((start + x - 1.0) / 2, 104, labels.get(family, family), ha="center", va="bottom", fontsize=8)
            ax.axvline(x - 0.5, color="grey", linewidth=0.6)
            x += 0.3
        ax.set_xticks(ticks)
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_xlim(-0.6, x - 0.5)
        ax.set_ylim(0, 112)
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"N = {n}, vocab {vocab}, {form} (preset {preset})", fontsize=9, pad=16)
        ax.grid(axis="y", alpha=0.3)
    handles, names_ = axes[0][0].get_legend_handles_labels()
    legend = dict(zip(names_, handles))
    whisker = "bar: mean over seeds; whisker: lowest to highest seed" if several else "one seed per bar"
    return finish(fig, f"MQAR recall of every backend, by family ({whisker})", legend, path)
