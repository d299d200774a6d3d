"""A tuned sweep's choices, read from its run folders: for each cell (task x backend x preset x the
other values), the grid's runs at the tuning seed, and the point lra.tuning.choose picks once every
one of them has finished (completed or diverged). The sweep then runs the cell's other seeds there.

A grid run that failed leaves its cell waiting: the next ``lra-sweep run`` submits it again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..format import MISSING, plural
from ..tuning import Choice, Point, text
from .folder import SweepFolder
from .progress import read_json, run_progress
from .spec import Decided, RunSpec, SweepSpec


@dataclass
class Cell:
    """One cell of a tuned sweep: its grid runs (point -> run) and what they have given so far."""

    key: str
    label: str
    runs: Dict[Point, RunSpec]
    choice: Choice
    # each grid run's state in a word, for lra-sweep status: its score, "running", "pending", "diverged"
    states: Dict[Point, str]


def cells(folder: SweepFolder, spec: SweepSpec) -> List[Cell]:
    """Every cell of ``spec``'s grid, in the spec's order, with what its grid runs have given."""
    from .cli import run_argv

    assert spec.tune is not None
    found: Dict[str, Cell] = {}
    for run in spec.runs():
        if run.seed != spec.tune.seed or not run.tuning:
            continue
        point = spec.tune.point_of_sets(run.sets)
        key = spec.cell(run)
        cell = found.setdefault(key, Cell(key, label(spec, run), {}, Choice(spec.tune), {}))
        cell.runs[point] = run
        progress = run_progress(folder, {"argv": run_argv(str(folder.out), run, spec)})
        record = read_json(progress.run_dir / "record.json") if progress.done and progress.run_dir else None
        cell.choice.records[point] = record
        cell.states[point] = state_word(progress.kind, record, spec.tune.select)
    return list(found.values())


def label(spec: SweepSpec, run: RunSpec) -> str:
    """A cell as status prints it: ``mqar_agent_cpu [data.pairs=8]``."""
    tuned = set(spec.tune.keys) if spec.tune is not None else set()
    kept = [item for item in run.sets if item.split("=", 1)[0] not in tuned]
    return f"{run.task}_{run.attn}_{run.preset}" + (f" [{' '.join(kept)}]" if kept else "")


def state_word(kind: str, record: Optional[Dict], select: str) -> str:
    if record is not None and record.get("status") == "diverged":
        return "diverged"
    if record is not None:
        value = record.get(select)
        return f"{value:.4f}" if isinstance(value, (int, float)) else MISSING
    return "running" if kind == "running" else "pending"


def decided(folder: SweepFolder, spec: SweepSpec) -> Decided:
    """The cells whose grid has finished: cell -> (chosen point, each point's score)."""
    if spec.tune is None or not folder.out.is_dir():
        return {}
    out: Decided = {}
    for cell in cells(folder, spec):
        if cell.choice.chosen is not None:
            out[cell.key] = (cell.choice.chosen, cell.choice.scores)
    return out


def report_lines(folder: SweepFolder, spec: SweepSpec) -> List[str]:
    """lra-sweep status's tuning section: the grid, each cell's score at every point, and its choice."""
    assert spec.tune is not None
    grid = spec.tune
    found = cells(folder, spec)
    points = grid.points()
    heads = [" ".join(text(v) for v in p) for p in points]
    width = max((len(c.label) for c in found), default=0)
    cols = [max(len(h), 9) for h in heads]
    lines = [f"tuning: {grid.describe()}",
             f"  {'cell':<{width}}  " + "  ".join(h.rjust(w) for h, w in zip(heads, cols)) + "  chosen"]
    waiting = 0
    for cell in found:
        chosen = cell.choice.chosen
        if chosen is None:
            waiting += 1
        what = "waiting for the grid" if chosen is None else ", ".join(grid.sets(chosen))
        lines.append(f"  {cell.label:<{width}}  " + "  ".join(cell.states[p].rjust(w) for p, w in zip(points, cols))
                     + f"  {what}")
    others = [s for s in spec.seeds if s != grid.seed]
    seeds = ("seed " if len(others) == 1 else "seeds ") + ", ".join(map(str, others))
    lines.append(f"  {len(found) - waiting} of {len(found)} cells chosen"
                 + (f"; {seeds} run at each cell's choice once its grid has finished "
                    f"({plural(len(others) * waiting, 'run')} waiting)" if others else ""))
    return lines
