"""Tuning as the field reports it: a grid of config values run at one seed, for each cell the grid
point with the best validation accuracy (ties: the smaller value), then the other seeds at that point.

A *cell* is what a run is but its seed and the tuned values: task, backend, preset and the other
config values (a task's level, such as MQAR's number of pairs). lra-sweep runs the grid and the seeds
(``lra/sweep/tune.py``); lra-table reports each tuned cell at its chosen point and every grid point
beside it (``lra/tables/tuning.py``). Both choose with :func:`choose`, so the table can recompute the
sweep's choice from the records alone.

A run of a tuned sweep carries the tuning in its config (``RunConfig.tuning``, written to config.json
and the record; not part of the run's identity, so a run made outside the sweep with the same values
counts as the grid point)::

    {"grid": {"train.lr": [0.0003, 0.001, 0.003, 0.01]}, "select": "val_acc", "seed": 0}
    # and, for the runs at the chosen point on the other seeds:
    "chosen": {"train.lr": 0.003}, "scores": [[{"train.lr": 0.0003}, 0.41], ...]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import UserError

# what a grid point is chosen by: the record field, and that the largest wins
SELECT = {"val_acc": "the best validation accuracy of the run (its record's val_acc)"}
# the seed the grid runs at when the spec names none: the first of the sweep's seeds
Point = Tuple[Any, ...]


@dataclass(frozen=True)
class Grid:
    """The tuned keys (``section.key``) and their values, in the order given; ``select`` and the seed
    the grid runs at."""

    keys: Tuple[str, ...]
    values: Tuple[Tuple[Any, ...], ...]
    select: str = "val_acc"
    seed: int = 0

    def points(self) -> List[Point]:
        """Every combination of the keys' values, the first key varying slowest."""
        out: List[Point] = [()]
        for values in self.values:
            out = [p + (v,) for p in out for v in values]
        return out

    def point_of_sets(self, sets: Sequence[str]) -> Point:
        """The point a run's ``--set`` items (made by :meth:`sets`) name."""
        given = dict(item.split("=", 1) for item in sets)
        return tuple(next(v for v in values if text(v) == given[key]) for key, values in zip(self.keys, self.values))

    def mapping(self, point: Point) -> Dict[str, Any]:
        return dict(zip(self.keys, point))

    def sets(self, point: Point) -> List[str]:
        """``--set`` items of a point, e.g. ["train.lr=0.003"]."""
        return [f"{k}={text(v)}" for k, v in zip(self.keys, point)]

    def describe(self) -> str:
        """"train.lr over 0.0003, 0.001, 0.003, 0.01 at seed 0, by val_acc"."""
        axes = "; ".join(f"{k} over {', '.join(text(v) for v in vs)}" for k, vs in zip(self.keys, self.values))
        return f"{axes} at seed {self.seed}, by {self.select} (ties: the smaller value)"

    def block(self, chosen: Optional[Point] = None, scores: Optional[Dict[Point, Optional[float]]] = None) -> Dict[str, Any]:
        """What a run's config holds of the tuning (RunConfig.tuning)."""
        out: Dict[str, Any] = {"grid": {k: list(vs) for k, vs in zip(self.keys, self.values)},
                               "select": self.select, "seed": self.seed}
        if chosen is not None:
            out["chosen"] = self.mapping(chosen)
            out["scores"] = [[self.mapping(p), s] for p, s in (scores or {}).items()]
        return out

    @classmethod
    def from_block(cls, block: Dict[str, Any]) -> "Grid":
        """The grid a run's ``tuning`` block names; ValueError when the block is not one."""
        grid = block.get("grid")
        if not isinstance(grid, dict) or not grid or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError("tuning.grid must map section.key to a non-empty list of values")
        select, seed = block.get("select", "val_acc"), block.get("seed", 0)
        if select not in SELECT or not isinstance(seed, int):
            raise ValueError(f"tuning.select must be one of {', '.join(SELECT)} and tuning.seed a whole number")
        return cls(tuple(grid), tuple(tuple(v) for v in grid.values()), select, seed)


def make_grid(origin: str, values: Dict[str, Sequence[Any]], select: Any, seed: int) -> Grid:
    """A Grid from a spec's ``tune`` mapping (values as typed); every problem is a UserError starting
    with ``origin``."""
    from .config import parse_set

    if not isinstance(values, dict) or not values:
        raise UserError(f"{origin}: tune must map section.key to its values, e.g. {{train.lr: [3.0e-4, 1.0e-3]}}")
    if select not in SELECT:
        raise UserError(f"{origin}: select {select!r} is not a criterion; valid: {', '.join(SELECT)} "
                        "(the test split is never used to choose)")
    keys, parsed = [], []
    for key, items in values.items():
        if not isinstance(key, str) or "." not in key:
            raise UserError(f"{origin}: tune key {key!r} must look like section.key, e.g. train.lr")
        items = list(items) if isinstance(items, (list, tuple)) else [items]
        if not items or any(isinstance(v, (list, dict)) or v is None for v in items):
            raise UserError(f"{origin}: tune.{key} must be a non-empty list of values, e.g. [3.0e-4, 1.0e-3]")
        values_of_key = [parse_set(f"{key}={v}")[2] for v in items]
        if len(set(map(text, values_of_key))) != len(values_of_key):
            raise UserError(f"{origin}: tune.{key} names a value twice; give each value once")
        keys.append(key)
        parsed.append(tuple(values_of_key))
    return Grid(tuple(keys), tuple(parsed), select, seed)


def text(value: Any) -> str:
    """A value as ``--set`` writes it, one way for each value (1e-3, 1.0e-3 and 0.001 alike: 0.001)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def order(point: Point) -> Tuple[Any, ...]:
    """Sort key of a point: numbers by value, before any text (ties go to the smaller point)."""
    return tuple((0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))
                 for v in point)


def score(record: Optional[Dict[str, Any]], select: str) -> Optional[float]:
    """A finished run's score by ``select``: None for a diverged run or one without the value (it
    never wins while any grid point has a score)."""
    if record is None or record.get("status") != "completed":
        return None
    value = record.get(select)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def choose(scores: Dict[Point, Optional[float]]) -> Point:
    """The point with the highest score; ties, and a grid where no point has a score, go to the
    smallest point (:func:`order`)."""
    if not scores:
        raise ValueError("no grid point to choose from")
    best = max((s for s in scores.values() if s is not None), default=None)
    tied = [p for p, s in scores.items() if s == best]
    return min(tied, key=order)


def config_value(config: Dict[str, Any], key: str) -> Any:
    """The value of ``section.key`` in a saved config (``attn.*`` in its attn_options); None when absent."""
    section, name = key.split(".", 1)
    values = config.get("attn_options" if section == "attn" else section) or {}
    return values.get(name) if isinstance(values, dict) else None


def point_of(config: Dict[str, Any], grid: Grid) -> Optional[Point]:
    """The grid point a saved config ran at, or None when one of its values is off the grid."""
    point = []
    for key, values in zip(grid.keys, grid.values):
        value = config_value(config, key)
        match = next((v for v in values if text(v) == text(value) or (
            isinstance(v, float) and isinstance(value, (int, float)) and not isinstance(value, bool) and v == value)), None)
        if match is None:
            return None
        point.append(match)
    return tuple(point)


@dataclass
class Choice:
    """One cell's grid at its seed: each point's record (None: not finished) and score, and the
    chosen point once every point has finished."""

    grid: Grid
    records: Dict[Point, Optional[Dict[str, Any]]] = field(default_factory=dict)

    @property
    def scores(self) -> Dict[Point, Optional[float]]:
        return {p: score(r, self.grid.select) for p, r in self.records.items()}

    @property
    def done(self) -> bool:
        return all(self.records.get(p) is not None for p in self.grid.points())

    @property
    def chosen(self) -> Optional[Point]:
        return choose(self.scores) if self.done else None
