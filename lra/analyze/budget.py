"""lra-analyze budget: a finished run's test accuracy with attention options changed at inference.

MiTA's first finding: with the trained parameters fixed, more experts m or wider experts k at
inference can raise accuracy further. The options vary over a grid (``--set attn.landmarks=16,32,64
attn.topk=16,32,64``); only options that leave every trained parameter as it is may vary (MiTA's
landmarks and topk, MoBA's block_size and topk, Top-k's topk), which is checked by building the
model with each value and comparing its tensors' names and shapes with the checkpoint's. Each cell
is the test accuracy of the best weights, beside its cost per query (the backend's ``budget()``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from tqdm import tqdm

from attentions import AttentionError, build_config

from ..config import parse_set
from ..run.distributed import Dist
from ..errors import UserError
from ..format import Table
from ..tables.records import levels
from ..run.loop import evaluate
from .loaded import Loaded, parameter_change

EXAMPLE = "attn.landmarks=16,32,64,128 attn.topk=16,32,64,128"
Grid = Dict[str, List[Any]]


@dataclass
class Cell:
    options: Dict[str, Any]
    # keys one query attends to, from the backend (e.g. "m + k = 128")
    budget: str
    acc: float
    loss: float
    # the setting the run was trained at
    trained: bool = False


def parse_grid(items: List[str]) -> Grid:
    """``attn.OPTION=V1,V2,...`` items -> {option: [values]}; each value parsed as lra-run's --set parses it."""
    if not items:
        raise UserError(f"--set is required: the attention options to vary and their values, e.g. --set {EXAMPLE}")
    grid: Grid = {}
    for item in items:
        head, _, raw = item.partition("=")
        if not raw or not head.startswith("attn.") or head == "attn.":
            raise UserError(f"--set {item!r} must look like attn.OPTION=V1,V2,... (attention options only: the "
                            f"weights are fixed), e.g. --set {EXAMPLE}")
        key = head[len("attn."):]
        if key in grid:
            raise UserError(f"--set names attn.{key} twice; give each option once with all its values, e.g. attn.{key}=16,32,64")
        parts = [p.strip() for p in raw.split(",")]
        if not all(parts):
            raise UserError(f"--set {item!r} has an empty value; separate the values by commas, e.g. attn.{key}=16,32,64")
        values = [parse_set(f"attn.{key}={p}")[2] for p in parts]
        grid[key] = list(dict.fromkeys(values))
    return grid


def cells_of(grid: Grid) -> List[Dict[str, Any]]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def label(options: Dict[str, Any]) -> str:
    return " ".join(f"attn.{k}={v}" for k, v in options.items())


def check_grid(loaded: Loaded, grid: Grid) -> Dict[str, Any]:
    """Refuse, before any evaluation, an option that is unknown, invalid or would change the trained
    parameters (each value alone, then every cell); return the trained values of the grid's options."""
    attn = loaded.cfg.attn
    trained_cfg = build_config(attn, loaded.cfg.attn_options)
    singles = [{key: value} for key, values in grid.items() for value in values]
    for options in singles + cells_of(grid):
        try:
            model = loaded.model(options)
        except AttentionError as err:
            raise UserError(f"{label(options)}: {err}") from err
        clamped = model.encoder.blocks[0].attn.notices
        if clamped:
            # the setting the run computes is the clamped one: a column of its own would repeat it
            raise UserError(f"{label(options)}: {clamped[0]}; give budgets within the run's sequence")
        change = parameter_change(model, loaded.weights)
        if change:
            raise UserError(f"{label(options)} changes the trained parameters of {attn!r} ({change}); budget varies only "
                            f"options that keep every parameter's name and shape, e.g. --set {EXAMPLE} for mita")
    return {key: getattr(trained_cfg, key) for key in grid}


def evaluate_grid(loaded: Loaded, grid: Grid, batch: int, quiet: bool) -> Tuple[List[Cell], Cell]:
    """Every cell of the grid, and the trained setting (one of them, or evaluated beside them)."""
    trained = check_grid(loaded, grid)
    settings = cells_of(grid)
    extra = [] if trained in settings else [trained]
    cells = []
    for options in tqdm(settings + extra, desc=f"budget {loaded.run.name}", disable=quiet):
        model = loaded.model(options)
        model.load_state_dict(loaded.weights)
        acc, loss = evaluate(model, loaded.test, batch, 0, loaded.device, Dist(), loaded.bf16)
        cells.append(Cell(options, model.encoder.blocks[0].attn.budget(), acc, loss, options == trained))
    base = next(c for c in cells if c.trained)
    return cells[: len(settings)], base


def tables(loaded: Loaded, grid: Grid, cells: List[Cell], base: Cell) -> List[Table]:
    """The cells one per row (the CSV), then the grid laid out as rows x columns (two options)."""
    keys = list(grid)
    record = loaded.run.record
    rows, records = [], []
    in_grid = any(c is base for c in cells)
    # the run's level (MQAR's pairs, N, ...) by data field name, so analyses of several runs can be grouped
    level = {f"data.{k}": v for k, v in levels(loaded.run.record).items()}
    for cell in cells + ([] if in_grid else [base]):
        delta = "trained" if cell.trained else f"{100 * (cell.acc - base.acc):+.1f} pt"
        shown = [str(cell.options[k]) for k in keys]
        if not in_grid and cell is base:
            shown[0] += " (trained, not in the grid)"
        rows.append([*shown, cell.budget, f"{100 * cell.acc:.2f}%", f"{cell.loss:.4f}", delta])
        records.append({**cell.options, "cost_per_query": cell.budget, "test_acc": round(cell.acc, 6),
                        "test_loss": round(cell.loss, 6), "trained": cell.trained, "examples": len(loaded.test),
                        "run": loaded.run.name, "task": loaded.cfg.task, "attn": loaded.cfg.attn,
                        "preset": loaded.cfg.preset, "seed": loaded.cfg.seed, **level})
    trained_at = ", ".join(f"{k}={v}" for k, v in base.options.items())
    recorded = "—" if record["test_acc"] is None else f"{100 * record['test_acc']:.2f}%"
    notes = [
        f"Run {loaded.run.folder} ({loaded.cfg.task}, {loaded.cfg.attn}), trained at {trained_at}; its best weights, "
        f"unchanged, on the first {len(loaded.test)} test examples (its record: {recorded} on {record['test_examples']}).",
        f"Cost per query: the keys one query attends to at that setting ({loaded.cfg.attn}'s budget()); test loss: mean "
        "cross-entropy on the same rows, which moves where the accuracy (each answer right or wrong) does not.",
    ]
    first = Table(f"Test accuracy with attention options changed at inference: {loaded.run.name}",
                  [*keys, "cost per query", "test acc", "test loss", "vs trained"], rows, notes=notes, records=records)
    if len(keys) != 2:
        return [first]
    by = {tuple(c.options[k] for k in keys): c for c in cells}
    grid_rows = []
    for v1 in grid[keys[0]]:
        row = [str(v1)]
        for v2 in grid[keys[1]]:
            cell = by[(v1, v2)]
            row.append(f"{100 * cell.acc:.1f}% ({cell.budget})" + (" trained" if cell.trained else ""))
        grid_rows.append(row)
    second = Table(f"The same, {keys[0]} down, {keys[1]} across", [f"{keys[0]} \\ {keys[1]}", *map(str, grid[keys[1]])],
                   grid_rows)
    return [first, second]
