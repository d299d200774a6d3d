"""What the tables share: the tasks and their titles, the published sources' names, records grouped
by (preset, backend and form, task) and one number summarised over a group's seeds."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..errors import UserError
from ..format import MISSING, model

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
# the LRA average leaves Path-X out, as the papers do
AVG_TASKS = TASKS[:5]
TITLES = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
          "pathfinder": "Pathfinder", "pathx": "Path-X"}
SOURCES = {"tay2021_lra": "Tay et al. 2021", "nystromformer2021": "Xiong et al. 2021", "skyformer2021": "Chen et al. 2021",
           "xformers_lra": "xformers LRA page", "cosformer2022": "Qin et al. 2022", "mita2026": "Wen et al. 2026",
           "mega2023": "Ma et al. 2023", "tay2021_lra_table2": "Tay et al. 2021, Table 2"}


@dataclass
class Summary:
    """One number over the seeds of a (backend, preset, task): completed values and diverged runs."""

    values: List[float] = field(default_factory=list)
    diverged: int = 0

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def text(self, fmt: str = "{:.2f}") -> str:
        if not self.values:
            return "diverged" if self.diverged else MISSING
        out = fmt.format(self.mean) + (f" ± {fmt.format(self.std)}" if self.std is not None else "")
        if self.diverged:
            out += f" ({self.diverged} of {self.diverged + len(self.values)} diverged)"
        return out


def summarize(records: Iterable[Dict[str, Any]], key: str, scale: float = 1.0) -> Summary:
    summary = Summary()
    for record in records:
        if record["status"] == "diverged":
            summary.diverged += 1
        elif record.get(key) is not None:
            summary.values.append(float(record[key]) * scale)
    return summary


def seeds_text(cells: Dict[Any, Summary]) -> str:
    """Seeds per cell of one row: "3", or "1–3" when cells differ."""
    counts = sorted({len(s.values) + s.diverged for s in cells.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def grouped(records: List[Dict[str, Any]]) -> Dict[Tuple[str, str, str], List[Dict[str, Any]]]:
    """Records by (preset, row, task), the row being the backend and its form (``format.model``)."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(record["preset"], model(record), record["task"])].append(record)
    return groups


def task_list(records: List[Dict[str, Any]]) -> List[str]:
    """The six LRA tasks, then any other task named in records."""
    return list(TASKS) + sorted({r["task"] for r in records} - set(TASKS))


def average(summaries: Dict[str, Summary]) -> Optional[float]:
    means = [summaries[t].mean if t in summaries else None for t in AVG_TASKS]
    return None if any(m is None for m in means) else statistics.fmean(means)  # type: ignore[arg-type]


def published_value(row: Dict[str, str], column: str) -> Optional[float]:
    # the CSV names Path-X's column path_x
    text = (row.get("path_x" if column == "pathx" else column) or "").strip()
    try:
        return float(text) if text else None
    except ValueError:
        raise UserError(f"published_lra.csv: {column} of {row.get('model')!r} is {text!r}, not a number")
