"""Plots of result records (matplotlib, Agg backend, PNG): accuracy by task, accuracy against training time.

Only completed runs are drawn; a diverged (backend, task) has no bar and no point.
"""
from __future__ import annotations

import io
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .table_format import write_atomic  # noqa: E402

TASK_ORDER = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")


def save(fig: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path


def by_series(records: List[Dict[str, Any]], order: List[str]) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """Completed records by series label ("attn" or "attn (preset)" when several presets) and task."""
    presets = {r["preset"] for r in records}
    series: Dict[str, Dict[str, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in sorted(records, key=lambda r: (order.index(r["attn"]) if r["attn"] in order else len(order), r["preset"])):
        if record["status"] == "completed" and record["test_acc"] is not None:
            label = record["attn"] if len(presets) == 1 else f"{record['attn']} ({record['preset']})"
            series[label][record["task"]].append(record)
    return series


def mean_std(values: List[float]) -> Tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def accuracy_bars(series: Dict[str, Dict[str, List[Dict[str, Any]]]], path: Path) -> Path:
    """Grouped bars: tasks on the x axis, one bar per backend, error bars = std over seeds."""
    tasks = [t for t in TASK_ORDER if any(t in s for s in series.values())]
    tasks += sorted({t for s in series.values() for t in s} - set(tasks))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(tasks) + 0.3 * len(series)), 4.0))
    for i, (label, per_task) in enumerate(series.items()):
        xs, means, stds = [], [], []
        for j, task in enumerate(tasks):
            if per_task.get(task):
                mean, std = mean_std([100.0 * r["test_acc"] for r in per_task[task]])
                xs.append(j - 0.4 + width * (i + 0.5))
                means.append(mean)
                stds.append(std)
        ax.bar(xs, means, width, yerr=stds, label=label, capsize=2)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("LRA test accuracy by task")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def accuracy_vs_time(series: Dict[str, Dict[str, List[Dict[str, Any]]]], path: Path) -> Path:
    """One point per (backend, task): mean training time (log x) against mean test accuracy."""
    markers = dict(zip(TASK_ORDER, "osD^vP"))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, (label, per_task) in enumerate(series.items()):
        color = f"C{i % 10}"
        for task, records in per_task.items():
            time = statistics.fmean(r["train_time_s"] for r in records)
            acc = statistics.fmean(100.0 * r["test_acc"] for r in records)
            ax.scatter(time, acc, color=color, marker=markers.get(task, "x"))
        ax.scatter([], [], color=color, marker="o", label=label)
    for task, marker in markers.items():
        if any(task in s for s in series.values()):
            ax.scatter([], [], color="gray", marker=marker, label=task)
    ax.set_xscale("log")
    ax.set_xlabel("training time (s, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy against training time")
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_all(records: List[Dict[str, Any]], out: Path, order: List[str]) -> List[Path]:
    """Both plots under ``out``; none when no run completed."""
    series = by_series(records, order)
    if not series:
        return []
    return [accuracy_bars(series, out / "accuracy_by_task.png"), accuracy_vs_time(series, out / "accuracy_vs_time.png")]
