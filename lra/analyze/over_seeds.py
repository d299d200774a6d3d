"""Budget analyses of several runs, over seeds: the ``budget.csv`` files ``lra-analyze budget`` wrote,
one table per (task, backend, preset), a row per grid cell, a column per level.

    python -m lra.analyze.over_seeds BUDGET_DIR --out DIR

BUDGET_DIR holds the analyses (``<run>/budget.csv``, found at any depth). A level is the run's task
levels (``data.*`` columns of the CSV: MQAR's pairs, N, ...); a column per level that differs between
the runs. A cell is the test accuracy at that setting, mean ± sample std over the seeds analysed, and
in brackets the mean change from each seed's trained setting. Writes ``<task>_<attn>_<preset>.{md,csv,tex}``
under --out. Bad input is one line on stderr, exit status 2, nothing written.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import UserError
from ..format import MISSING, Table, write_tables
from ..tables.summary import Summary

# the CSV's columns that are not options of the grid
FIXED = ("cost_per_query", "test_acc", "test_loss", "trained", "examples", "run", "task", "attn", "preset", "seed")


def number(text: str) -> Any:
    """A CSV value as the number it spells where it spells one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_analyses(root: Path) -> List[Dict[str, Any]]:
    """Every row of every ``budget.csv`` under ``root`` that names its run's backend and seed."""
    rows = []
    for path in sorted(root.rglob("budget.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if not {"attn", "seed", "test_acc", "trained"} <= set(row):
                    raise UserError(f"{path} has no attn, seed, test_acc and trained columns; re-run lra-analyze budget "
                                    "on that run to write them")
                rows.append({k: number(v) for k, v in row.items()} | {"trained": row["trained"] == "True"})
    if not rows:
        raise UserError(f"{root}: no budget.csv below it; run lra-analyze budget --out {root}/<run> on each run first")
    return rows


def group_tables(rows: List[Dict[str, Any]]) -> List[Tuple[str, Table]]:
    """(file stem, table) per (task, backend, preset)."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["attn"], row["preset"])].append(row)
    return [(f"{task}_{attn}_{preset}", table_of(task, attn, preset, found)) for (task, attn, preset), found in groups.items()]


def table_of(task: str, attn: str, preset: str, rows: List[Dict[str, Any]]) -> Table:
    level_keys = [k for k in rows[0] if k.startswith("data.")]
    varying = [k for k in level_keys if len({r.get(k) for r in rows}) > 1]
    options = [k for k in rows[0] if k not in FIXED and not k.startswith("data.")]
    level_of = lambda r: tuple(r.get(k) for k in varying)
    option_of = lambda r: tuple(r[k] for k in options)
    levels = sorted({level_of(r) for r in rows})
    settings = sorted({option_of(r) for r in rows})
    # each (run) -> its trained accuracy, for the change column
    trained = {r["run"]: r["test_acc"] for r in rows if r["trained"]}
    trained_settings = {option_of(r) for r in rows if r["trained"]}
    cells: Dict[Tuple[tuple, tuple], List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(option_of(r), level_of(r))].append(r)
    cost = {option_of(r): r["cost_per_query"] for r in rows}
    level_name = lambda lv: ", ".join(f"{k[len('data.'):]} {v}" for k, v in zip(varying, lv)) or "all runs"
    body, records = [], []
    for setting in settings:
        line = [*map(str, setting), str(cost[setting]) + (" (trained)" if setting in trained_settings else "")]
        for lv in levels:
            found = cells.get((setting, lv), [])
            if not found:
                line.append(MISSING)
                continue
            acc = Summary(values=[100 * r["test_acc"] for r in found])
            changes = [100 * (r["test_acc"] - trained[r["run"]]) for r in found if r["run"] in trained]
            change = f" ({statistics.fmean(changes):+.1f})" if changes and setting not in trained_settings else ""
            line.append(acc.text("{:.1f}") + change)
            records.append({**dict(zip(options, setting)), **dict(zip(varying, lv)), "cost_per_query": cost[setting],
                            "seeds": len(found), "test_acc_mean": round(acc.mean, 4),
                            "test_acc_std": None if acc.std is None else round(acc.std, 4),
                            "change_vs_trained_mean": round(statistics.fmean(changes), 4) if changes else None})
        body.append(line)
    seeds = sorted({r["seed"] for r in rows})
    return Table(
        f"{attn} on {task} ({preset} preset): test accuracy (%) with attention options changed at inference",
        [*options, "cost per query", *map(level_name, levels)], body,
        notes=[f"lra-analyze budget on each trained run (seeds {', '.join(map(str, seeds))}), the best weights unchanged; "
               "mean ± sample std over the seeds, and in brackets the mean change in points from each run's trained "
               "setting. Cost per query: the keys one query attends to (the backend's budget())."],
        records=records)


def build(root: Path, out: Path) -> List[Path]:
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; give the folder that holds the lra-analyze budget outputs")
    written: List[Path] = []
    for stem, table in group_tables(read_analyses(root)):
        written += write_tables(out, stem, [table])
    return written


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lra.analyze.over_seeds", description=__doc__.split("\n\n")[0])
    p.add_argument("budget_dir", metavar="BUDGET_DIR", help="the folder holding <run>/budget.csv analyses")
    p.add_argument("--out", help="where the tables go (default BUDGET_DIR)")
    args = p.parse_args(argv)
    root = Path(args.budget_dir)
    try:
        written = build(root, Path(args.out) if args.out else root)
    except UserError as err:
        print(f"lra.analyze.over_seeds: {err}", file=sys.stderr)
        return 2
    for path in written:
        if path.suffix == ".md":
            print(path.read_text())
    print(f"wrote {len(written)} files to {Path(args.out) if args.out else root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
