"""Tuned results in the tables: each tuned cell at the point its grid chose, and every grid point beside it.

A cell (backend, preset, task, level: lra/tuning.py) is tuned when one of its records carries a
tuning block (``config.tuning``, written by lra-sweep). Its grid points are the records at the
tuning seed whose values lie on the grid, block or not (a run made outside the sweep with the same
values is the same run); the choice is recomputed from them with lra.tuning.choose, the rule the
sweep used. The accuracy, efficiency and recall tables then read the cell's records at the chosen
point (one per seed); ``tuning.{md,csv,tex}`` lists every grid point's validation and test accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..format import MISSING, Table, backend_order, model
from ..tuning import Choice, Grid, Point, choose, point_of, score
from .records import levels
from .summary import TITLES, summarize

# (backend and form (format.model), preset, task, level items): what a record is but its seed and its
# tuned values
CellKey = Tuple[Any, ...]


def cell_of(record: Dict[str, Any]) -> CellKey:
    return (model(record), record["preset"], record["task"], *sorted(levels(record).items()))


@dataclass
class TunedCell:
    """One tuned cell: its grid, the grid point records at the tuning seed, the chosen point and the
    records there (one per seed)."""

    key: CellKey
    grid: Grid
    choice: Choice
    chosen: Optional[Point] = None
    reported: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.choice.done

    @property
    def level(self) -> Dict[str, Any]:
        return dict(self.key[3:])

    def chosen_text(self) -> str:
        """"train.lr 0.003", with "(k of n points)" while the grid is incomplete."""
        if self.chosen is None:
            return MISSING
        values = ", ".join(f"{k} {value_text(v)}" for k, v in zip(self.grid.keys, self.chosen))
        done = sum(1 for r in self.choice.records.values() if r is not None)
        return values if self.complete else f"{values} ({done} of {len(self.grid.points())} points)"


def value_text(value: Any) -> str:
    """A tuned value as the tables print it: 3e-4, 1e-3, 0.05, 64."""
    if isinstance(value, float) and value != 0 and (abs(value) <= 1e-2 or abs(value) >= 1e4):
        mantissa, exponent = f"{value:.6e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def grids(records: List[Dict[str, Any]]) -> Dict[CellKey, Grid]:
    """The grid of each tuned cell, from its records' tuning blocks (the latest finished record's when
    they differ)."""
    found: Dict[CellKey, Tuple[str, Grid]] = {}
    for record in records:
        block = (record.get("config") or {}).get("tuning")
        if not block:
            continue
        try:
            grid = Grid.from_block(block)
        except ValueError:
            continue
        key = cell_of(record)
        stamp = str(record.get("finished_at") or "")
        if key not in found or stamp >= found[key][0]:
            found[key] = (stamp, grid)
    return {key: grid for key, (_, grid) in found.items()}


def grid_point(record: Dict[str, Any], tuned: Dict[CellKey, Grid]) -> Tuple[Optional[Point], bool]:
    """The grid point of a record of a tuned cell (None for an untuned cell), and whether it lies on the
    grid (a record of a tuned cell whose values are off it has no place in the tables)."""
    grid = tuned.get(cell_of(record))
    if grid is None:
        return None, True
    point = point_of(record["config"], grid)
    return point, point is not None


def choose_cells(records: List[Dict[str, Any]], tuned: Dict[CellKey, Grid]) -> Tuple[List[Dict[str, Any]], List[TunedCell],
                                                                                     List[Tuple[Dict[str, Any], str]]]:
    """Split deduplicated records into those the tables report (untuned cells whole, tuned cells at
    their chosen point), the tuned cells, and the records of tuned cells left out (at a point not
    chosen, on another seed than the grid's), each with the reason."""
    cells: Dict[CellKey, TunedCell] = {}
    for key, grid in tuned.items():
        cells[key] = TunedCell(key, grid, Choice(grid, {p: None for p in grid.points()}))
    for record in records:
        cell = cells.get(cell_of(record))
        if cell is not None and record["seed"] == cell.grid.seed:
            cell.choice.records[point_of(record["config"], cell.grid)] = record
    for cell in cells.values():
        # a grid still running: the best of its finished points, said as such in the tables
        finished = {p: score(r, cell.grid.select) for p, r in cell.choice.records.items() if r is not None}
        cell.chosen = choose(finished) if finished else None
    reported, left_out = [], []
    for record in records:
        cell = cells.get(cell_of(record))
        if cell is None:
            reported.append(record)
            continue
        point = point_of(record["config"], cell.grid)
        if point == cell.chosen:
            reported.append(record)
            cell.reported.append(record)
        elif record["seed"] != cell.grid.seed:
            chosen = ", ".join(f"{k}={value_text(v)}" for k, v in zip(cell.grid.keys, cell.chosen or ()))
            left_out.append((record, f"off its cell's chosen point ({chosen or 'none chosen yet'})"))
    order = backend_order(key[0] for key in cells)
    ranked = sorted(cells.values(), key=lambda c: (c.key[2], c.key[1], str(c.key[3:]), order.index(c.key[0])))
    return reported, ranked, left_out


def tuning_table(cells: List[TunedCell]) -> Table:
    """Every grid point of every tuned cell: validation accuracy (what chose) and test accuracy at the
    tuning seed, the chosen point, and the test accuracy there over the seeds."""
    points = sorted({(c.grid.keys, p) for c in cells for p in c.grid.points()}, key=lambda kp: (kp[0], kp[1]))
    heads = [" ".join(value_text(v) for v in p) for _, p in points]
    keys = sorted({", ".join(c.grid.keys) for c in cells})
    table = Table("Tuning: validation / test accuracy (%) at each grid point", [
        "Model", "Task", "Level", "Protocol", *heads, "Chosen", "Test at chosen, mean ± std", "Seeds"])
    table.records = []
    group = None
    for cell in cells:
        attn, preset, task = cell.key[:3]
        level = ", ".join(f"{k} {v}" for k, v in cell.level.items() if k in ("pairs",)) or MISSING
        if (task, preset) != group:
            group = (task, preset)
            table.breaks.append(len(table.rows))
        row = [attn, TITLES.get(task, task), level, f"preset {preset}"]
        for keys, point in points:
            record = cell.choice.records.get(point) if keys == cell.grid.keys else None
            row.append(point_text(record, keys == cell.grid.keys and point in cell.choice.records))
            table.records.append({
                "model": attn, "task": task, "preset": preset, **cell.level, "keys": ", ".join(keys),
                "point": " ".join(map(str, point)), "seed": cell.grid.seed,
                "val_acc": None if record is None else record.get("val_acc"),
                "test_acc": None if record is None else record.get("test_acc"),
                "status": "missing" if record is None else record["status"], "chosen": point == cell.chosen,
            })
        summary = summarize(cell.reported, "test_acc", 100.0)
        row += [cell.chosen_text(), summary.text(), str(len(summary.values) + summary.diverged)]
        table.rows.append(row)
    table.notes = [
        f"Tuned: {'; '.join(keys)}. Each cell (backend, protocol, task, level) ran its grid at one seed; the point "
        "with the best validation accuracy was chosen (ties: the smaller value) and the other seeds ran there. "
        "A grid cell shows validation / test accuracy of the tuning seed's run at that point; \"diverged\" where "
        f"the run diverged, {MISSING} where it has not run (the choice is then among the points that have).",
    ]
    return table


def point_text(record: Optional[Dict[str, Any]], on_grid: bool) -> str:
    if not on_grid:
        return ""
    if record is None:
        return MISSING
    if record["status"] == "diverged":
        return "diverged"
    val, test = record.get("val_acc"), record.get("test_acc")
    return f"{fmt(val)} / {fmt(test)}"


def fmt(value: Optional[float]) -> str:
    return MISSING if value is None else f"{100.0 * value:.1f}"


def tuned_keys(cells: List[TunedCell]) -> List[str]:
    """The keys any cell tuned, in first-seen order."""
    return list(dict.fromkeys(k for c in cells for k in c.grid.keys))


def setting_text(groups: List[List[Dict[str, Any]]], cells: Dict[CellKey, TunedCell], keys: List[str]) -> str:
    """The tuned keys' values of a row's cells (each a list of one cell's records), joined by " / ": a
    tuned cell's chosen point ("3e-3", or "3e-3 (2 of 4 points)" while its grid runs), an untuned
    cell's values, the row marked "(not tuned)" when none of its cells is."""
    from ..tuning import config_value

    texts, any_tuned = [], False
    for records in groups:
        cell = cells.get(cell_of(records[0])) if records else None
        if cell is not None and cell.chosen is not None:
            any_tuned = True
            chosen = cell.grid.mapping(cell.chosen)
            text = ", ".join(value_text(chosen[k]) if k in chosen else MISSING for k in keys)
            done = sum(1 for r in cell.choice.records.values() if r is not None)
            texts.append(text if cell.complete else f"{text} ({done} of {len(cell.grid.points())} points)")
        elif records:
            ran = {", ".join(value_text(config_value(r["config"], k)) for k in keys) for r in records}
            texts.append(ran.pop() if len(ran) == 1 else "mixed")
        else:
            texts.append(MISSING)
    return " / ".join(texts) + ("" if any_tuned else " (not tuned)")
