"""Which run records the tables use: the finished ones under the run folders given, the latest per
backend (and its form, ``format.model``), preset, task and seed (and, for a task with levels such as
MQAR's number of pairs, per level), and every record or run left out with the reason (unreadable, unfinished, an older
duplicate, a smoke run, a run started from another's weights), which the tables print."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import DataConfig
from ..errors import UserError
from ..format import model
from ..run.record import validate_record
from ..tasks import get_task

# the checkout the package runs from (records and tables there are printed relative to it), and the
# package's own data (the published CSVs, printed as reference/<file>)
REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(__file__).resolve().parents[1]


@dataclass
class Selection:
    """Which records the tables use, and which they leave out and why (both printed with the tables)."""

    used: List[Path] = field(default_factory=list)
    # (path of the record or run folder, why it was left out)
    left_out: List[Tuple[Path, str]] = field(default_factory=list)
    # the task of each path above whose record could be read
    tasks: Dict[Path, str] = field(default_factory=dict)
    # the tuned cells (lra/tables/tuning.py): each at its chosen point, with its grid
    tuned: List[Any] = field(default_factory=list)

    def of_tasks(self, keep: Callable[[Optional[str]], bool]) -> "Selection":
        """The runs and left-out records whose task ``keep`` accepts (None: a record that could not be read)."""
        return Selection([p for p in self.used if keep(self.tasks.get(p))],
                         [(p, why) for p, why in self.left_out if keep(self.tasks.get(p))], self.tasks,
                         [c for c in self.tuned if keep(c.key[2])])

    def notes(self) -> List[str]:
        """The lines the accuracy and efficiency tables carry: every run used, every record or run left out."""
        used = ", ".join(shown(p) for p in self.used) or "none"
        notes = [f"Runs used ({len(self.used)}): {used}."]
        if self.left_out:
            notes.append(f"Left out ({len(self.left_out)}): " + "; ".join(f"{shown(p)} ({why})" for p, why in self.left_out) + ".")
        return notes


def run_folders(runs: Path) -> List[Path]:
    """Sub-folders of ``runs`` that hold a run: a record, or the config.json a run writes when it starts."""
    if not runs.is_dir():
        return []
    return sorted(p for p in runs.iterdir() if p.is_dir() and ((p / "record.json").exists() or (p / "config.json").exists()))


def read_record(path: Path) -> Dict[str, Any]:
    """A record.json, validated; ValueError (or OSError) says what is wrong with it."""
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    validate_record(record)
    return record


def levels(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record's level, by data field name: its task's ``levels`` of the data config it ran with
    ({} for a task without levels, or one this installation does not know)."""
    try:
        task = get_task(record["task"])
    except UserError:
        return {}
    data = record["config"].get("data") or {}
    known = DataConfig.__dataclass_fields__
    try:
        return task.levels(DataConfig(**{k: v for k, v in data.items() if k in known}))
    except UserError:
        return {}


def load_records(folders: List[Path], include_smoke: bool = False) -> Tuple[List[Dict[str, Any]], Selection]:
    """Finished records under the ``folders`` (the latest per backend and form, preset, task, seed and
    level, and in a tuned cell per grid point: the cell then reports its chosen point, lra/tables/tuning.py), and
    which records were used and left out: unreadable ones, unfinished runs, older duplicates, records
    of a tuned cell off its chosen point and, unless ``include_smoke``, smoke runs (a handful of
    steps: they show the pipeline runs, not what a backend learns). Reasons come in folder order."""
    from .tuning import choose_cells, grids, grid_point

    selection = Selection()
    # (folder index, record, its path): the finished records; (folder index, path, why): the reasons
    found: List[Tuple[int, Dict[str, Any], Path]] = []
    said: List[Tuple[int, Path, str]] = []
    for index, folder in enumerate(run_folders_of(folders)):
        path = folder / "record.json"
        if not path.exists():
            said.append((index, folder, "unfinished: no record.json yet; the same lra-run command resumes it"))
            continue
        try:
            record = read_record(path)
        except (OSError, ValueError) as err:
            said.append((index, path, f"unreadable: {err}"))
            continue
        selection.tasks[path] = selection.tasks[folder] = record["task"]
        if record["status"] not in ("completed", "diverged"):
            said.append((index, path, f"status {record['status']!r}: the run has not finished"))
        elif record["preset"] == "smoke" and not include_smoke:
            said.append((index, path, "smoke run; --include-smoke shows it"))
        elif record.get("init_from"):
            # a swap-in (lra-run --init-from): not a run of the backend trained on its own
            said.append((index, path, f"started from the weights of {record['init_from'].get('run', '?')} (--init-from)"))
        else:
            found.append((index, record, path))
    tuned = grids([record for _, record, _ in found])
    latest: Dict[Tuple[Any, ...], Tuple[int, Dict[str, Any], Path]] = {}
    for index, record, path in found:
        point, on_grid = grid_point(record, tuned)
        if not on_grid:
            said.append((index, path, "its tuned values lie off the tuning grid of its backend, task and level"))
            continue
        level = levels(record)
        key = (model(record), record["preset"], record["task"], record["seed"], *sorted(level.items()), point)
        same = "backend, preset, task, seed and level" if level else "backend, preset, task and seed"
        same += " and tuned values" if point is not None else ""
        if key in latest:
            _, kept, kept_path = latest[key]
            if str(record["finished_at"] or "") < str(kept["finished_at"] or ""):
                said.append((index, path, f"older run of the same {same} as {shown(kept_path)}"))
                continue
            said.append((index, kept_path, f"older run of the same {same} as {shown(path)}"))
        latest[key] = (index, record, path)
    reported, selection.tuned, off = choose_cells([record for _, record, _ in latest.values()], tuned)
    where = {id(record): (index, path) for index, record, path in latest.values()}
    said += [(where[id(record)][0], where[id(record)][1], why) for record, why in off]
    dropped = {id(record) for record, _ in off}
    selection.left_out = [(path, why) for _, path, why in sorted(said, key=lambda s: s[0])]
    selection.used = sorted(path.parent for _, record, path in latest.values() if id(record) not in dropped)
    return reported, selection


def run_folders_of(folders: List[Path]) -> List[Path]:
    """The run folders of every folder given, each once (a folder named twice is read once)."""
    seen: Dict[Path, Path] = {}
    for runs in folders:
        for folder in run_folders(runs):
            seen.setdefault(folder.resolve(), folder)
    return list(seen.values())


def shown(path: Optional[Path]) -> str:
    """A path as the tables print it: relative to the repo when inside it, so committed tables stay portable."""
    if path is None:
        return ""
    for root in (PACKAGE, REPO):
        try:
            return str(path.resolve().relative_to(root))
        except ValueError:
            pass
    return str(path)
