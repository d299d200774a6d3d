"""MQAR's plots: recall against the number of key-value pairs, one panel per family, and every backend's
recall in one figure of bars grouped by family (plot_style.py says how backends are drawn)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from .plot_style import (FOCUS, FOCUS_STYLE, REFERENCE, bold_focus, by_family, family_title, finish, line_styles, save,
                         tuned_keys)
from .recall import Cells, Row

Panel = Tuple[str, str, int, int]


def panels(cells: Cells) -> Dict[Panel, Cells]:
    """The recall cells by panel: one per protocol, formulation, vocabulary and N."""
    groups: Dict[Panel, Cells] = defaultdict(dict)
    for row, per_pairs in cells.items():
        groups[(row.preset, row.form, row.vocab, row.n)][row] = per_pairs
    return groups


def accuracies(per_pairs: Dict[int, List[Dict[str, Any]]]) -> Dict[int, List[float]]:
    """Test accuracy (%) of the completed runs, per number of pairs that has one."""
    values = {p: [100.0 * r["test_acc"] for r in rs if r["status"] == "completed" and r["test_acc"] is not None]
              for p, rs in per_pairs.items()}
    return {p: v for p, v in sorted(values.items()) if v}


def tuned_note(cells: Cells) -> str:
    """"; tuned: ..." naming what was tuned where a cell's runs come from a tuning grid (lra-sweep tune;
    the cells are then at their chosen values), else ""."""
    keys = tuned_keys(r for per_pairs in cells.values() for rs in per_pairs.values() for r in rs)
    return f"; tuned cells at their best {', '.join(keys)}" if keys else ""


def label_of(row: Row) -> str:
    return f"{row.attn} ({row.keys} of {row.n} keys)" if row.keys is not None else f"{row.attn} ({row.budget})"


def draw_line(ax: Any, values: Dict[int, List[float]], style: Dict[str, Any], label: str) -> bool:
    """One backend's line through its mean over seeds, a band from the lowest to the highest seed where
    several; whether there was a band."""
    pairs = list(values)
    ax.plot(pairs, [statistics.fmean(values[p]) for p in pairs], label=label, **style)
    if not any(len(values[p]) > 1 for p in pairs):
        return False
    ax.fill_between(pairs, [min(values[p]) for p in pairs], [max(values[p]) for p in pairs], color=style["color"],
                    alpha=0.15, linewidth=0)
    return True


def pairs_axis(ax: Any, ticks: List[int]) -> None:
    if ticks and ticks[-1] >= 4 * ticks[0]:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)


def recall_vs_pairs(cells: Cells, path: Path) -> Path:
    """Zoology's plot as small multiples: test accuracy against the number of key-value pairs, one panel
    per family (columns) and per protocol, formulation, vocabulary and N (rows). In a panel, each of the
    family's backends (and budgets) is a line of its own colour and marker through its mean over seeds,
    with a band from the lowest to the highest seed where several; MiTA and full attention are drawn in
    every panel as the references (red stars, black dashes, behind the family's lines), each panel's
    legend under it."""
    groups = panels(cells)
    # a family of MiTA alone has no panel of its own: MiTA is in every panel
    families = [f for f, members in by_family(list(cells)) if {r.attn for r in members} != {FOCUS}]
    # a panel's lines: its family's backends and the references drawn in every panel
    entries = max(len(members) + 2 for rows in groups.values() for _, members in by_family(list(rows)))
    legend_h = 0.16 * entries + 0.2
    fig = plt.figure(figsize=(3.9 * len(families), (3.4 + legend_h) * len(groups)))
    grid = fig.add_gridspec(2 * len(groups), len(families), height_ratios=[3.4, legend_h] * len(groups))
    several = False
    first = None
    for g, ((preset, form, vocab, n), rows) in enumerate(groups.items()):
        members = dict(by_family(list(rows)))
        references = [r for r in rows if r.attn in (FOCUS, REFERENCE)]
        ticks = sorted({p for row in rows for p in accuracies(rows[row])})
        for c, family in enumerate(families):
            ax = fig.add_subplot(grid[2 * g, c], sharey=first)
            first = first or ax
            shown = members.get(family, [])
            drawn = shown + [r for r in references if r not in shown]
            styles = line_styles([label_of(r) for r in drawn])
            for row in drawn:
                values = accuracies(rows[row])
                if values:
                    reference = row not in shown
                    label = f"{label_of(row)}, reference" if reference else label_of(row)
                    # a reference is drawn behind the family's lines, which may lie on it
                    style = {**styles[label_of(row)], **({"alpha": 0.55, "zorder": 2} if reference else {})}
                    several = draw_line(ax, values, style, label) or several
            pairs_axis(ax, ticks)
            ax.set_title(f"{family_title(family)}: {len(shown)} backend{'s' if len(shown) != 1 else ''}", fontsize=9)
            ax.set_xlabel("key-value pairs")
            if c == 0:
                ax.set_ylabel(f"N = {n}, vocab {vocab}, {form}, preset {preset}\ntest accuracy over the queries (%)",
                              fontsize=9)
            else:
                ax.tick_params(labelleft=False)
            below = fig.add_subplot(grid[2 * g + 1, c])
            below.axis("off")
            legend = below.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="upper center", frameon=False)
            bold_focus(legend.get_texts())
    band = "line: mean over seeds; band: lowest to highest seed" if several else "one seed per point"
    return finish(fig, f"MQAR recall against the number of key-value pairs, by family ({band}{tuned_note(cells)})",
                  {}, path)


def recall_by_family(cells: Cells, path: Path) -> Path:
    """Every backend's MQAR recall in one figure, grouped by family (the taxonomy's scaling strategy:
    routing, compression, both, neither): one bar per number of key-value pairs, its height the mean over
    seeds, its whisker from the lowest to the highest seed where several; MiTA's bars framed in red
    and its name in bold red. One
    panel per protocol, formulation, vocabulary and N."""
    groups = panels(cells)
    pairs_all = sorted({p for per_pairs in cells.values() for p in per_pairs})
    colours = {p: f"C{i % 10}" for i, p in enumerate(pairs_all)}
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
                values = accuracies(rows[row])
                for i, p in enumerate(pairs_all):
                    if p not in values:
                        continue
                    at = x + (i - (len(pairs_all) - 1) / 2) * bar
                    mean = statistics.fmean(values[p])
                    # MiTA's bars framed in its colour
                    frame = {"edgecolor": FOCUS_STYLE["color"], "linewidth": 1.5} if row.attn == FOCUS else {}
                    ax.bar(at, mean, width=bar, color=colours[p], label=f"{p} pairs", **frame)
                    if len(values[p]) > 1:
                        several = True
                        ax.errorbar(at, mean, yerr=[[mean - min(values[p])], [max(values[p]) - mean]], fmt="none",
                                    ecolor="black", elinewidth=0.7, capsize=1.5)
                x += 1.0
            ax.text((start + x - 1.0) / 2, 104, family_title(family), ha="center", va="bottom", fontsize=8)
            ax.axvline(x - 0.5, color="grey", linewidth=0.6)
            x += 0.3
        ax.set_xticks(ticks)
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        bold_focus(ax.get_xticklabels())
        ax.set_xlim(-0.6, x - 0.5)
        ax.set_ylim(0, 112)
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"N = {n}, vocab {vocab}, {form} (preset {preset})", fontsize=9, pad=16)
        ax.grid(axis="y", alpha=0.3)
    handles, names_ = axes[0][0].get_legend_handles_labels()
    legend = dict(zip(names_, handles))
    whisker = "bar: mean over seeds; whisker: lowest to highest seed" if several else "one seed per bar"
    return finish(fig, f"MQAR recall of every backend, by family ({whisker}{tuned_note(cells)})", legend, path)
