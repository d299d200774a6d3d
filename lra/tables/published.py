"""Published beside measured, mechanism by mechanism: each published LRA row set under the suite's
backend of the same mechanism (the backend's ``published_as`` names its rows; the backend's runs of
each form its options choose, ``format.model``, in rows of their own), with the protocol of every row
and a note where the published row's code did something that moves its numbers.

A published mechanism that no backend claims keeps its rows, under "(no backend)", never dropped.
The notes come from ``published_notes.csv`` beside ``published_lra.csv``: ``source, model, note``,
where ``model`` is ``*`` for a note on every row of that source (its protocol).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from attentions import get_attention, list_attentions

from ..format import MISSING, Table, backend_order, fmt_number, mechanism, model
from .summary import SOURCES, TITLES, average, grouped, published_value, seeds_text, summarize, task_list

NO_BACKEND = "(no backend)"


def claims() -> Dict[str, str]:
    """Published model name -> the backend whose mechanism it is (the first to claim it, in list order)."""
    owner: Dict[str, str] = {}
    for name in list_attentions():
        for model in get_attention(name).published_as:
            owner.setdefault(model, name)
    return owner


def note_for(notes: List[Dict[str, str]], source: str, model: str) -> List[str]:
    """The notes on a published row: its own, then its source's (``model`` = ``*``)."""
    own = [n["note"] for n in notes if n.get("source") == source and n.get("model") == model]
    return own + [n["note"] for n in notes if n.get("source") == source and n.get("model") == "*"]


class NoteMarks:
    """Numbered marks of notes, in the order they are first used: ``marks(texts)`` -> "[1] [2]";
    ``lines()`` the notes under the table, "[1] text"."""

    def __init__(self) -> None:
        self.numbers: Dict[str, int] = {}

    def __call__(self, texts: List[str]) -> str:
        for text in texts:
            self.numbers.setdefault(text, len(self.numbers) + 1)
        return " ".join(f"[{self.numbers[t]}]" for t in texts)

    def lines(self) -> List[str]:
        return [f"[{i}] {text}" for text, i in self.numbers.items()]


def published_table(records: List[Dict[str, Any]], published: List[Dict[str, str]], notes: List[Dict[str, str]],
                    reference: str) -> Table:
    tasks = task_list(records)
    table = Table("Published beside measured, by mechanism: test accuracy (%)",
                  ["Mechanism", "Row", "Source", "Protocol", "Seeds", *(TITLES.get(t, t) for t in tasks), "Avg", "Note"])
    owner = claims()
    groups = grouped(records)
    ours = backend_order(model(r) for r in records)
    mechanisms = [n for n in list_attentions()
                  if any(mechanism(o) == n for o in ours) or any(owner.get(r["model"]) == n for r in published)]
    mechanisms += list(dict.fromkeys(mechanism(o) for o in ours if mechanism(o) not in mechanisms))
    mark = NoteMarks()
    long: List[Dict[str, Any]] = []

    def add(mechanism: str, label: str, source: str, protocol: str, seeds: str, cells: Dict[str, Tuple[Optional[float], str]],
            avg: Optional[float], texts: List[str]) -> None:
        table.rows.append([mechanism, label, SOURCES.get(source, source), protocol, seeds,
                           *(cells[t][1] if t in cells else MISSING for t in tasks), fmt_number(avg), mark(texts)])
        for t in [*tasks, "avg"]:
            mean = avg if t == "avg" else (cells[t][0] if t in cells else None)
            long.append({"mechanism": mechanism, "source": source, "protocol": protocol, "model": label, "task": t,
                         "acc_mean": mean, "note": " ".join(texts)})

    for name in [*mechanisms, NO_BACKEND]:
        table.breaks.append(len(table.rows))
        for form in (o for o in ours if mechanism(o) == name):
            # "this suite", or "this suite (chunked)" for another form of the backend
            label = "this suite" + form[len(name):]
            for preset in sorted({p for p, a, _ in groups if a == form}):
                summaries = {t: summarize(groups[(preset, form, t)], "test_acc", 100.0)
                             for t in tasks if groups.get((preset, form, t))}
                add(name, label, "this suite", f"preset {preset}", seeds_text(summaries),
                    {t: (s.mean, s.text()) for t, s in summaries.items()}, average(summaries), [])
        for row in published:
            if owner.get(row["model"], NO_BACKEND) != name:
                continue
            values = {t: published_value(row, t) for t in tasks}
            add(name, row["model"], row["source"], row["protocol"], MISSING,
                {t: (v, fmt_number(v)) for t, v in values.items() if v is not None}, published_value(row, "avg"),
                note_for(notes, row["source"], row["model"]))
    if table.breaks and table.breaks[-1] == len(table.rows):
        table.breaks.pop()
    table.records = long
    table.notes = [
        "Each backend's rows: ours (mean ± std over seeds, per preset), then the published rows of the same mechanism "
        "(the backend's published_as); a published mechanism no backend claims is listed under "
        f"{NO_BACKEND}. Published rows: {reference}; {MISSING} = not run or not reported.",
        *mark.lines(),
    ]
    return table
