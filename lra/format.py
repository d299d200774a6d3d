"""A table of display strings, rendered as Markdown, LaTeX (booktabs) and CSV, written atomically;
the number formats and the backend row order every table shares."""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from attentions import AttentionError, get_attention, list_attentions

from .files import write_atomic_set

MISSING = "—"


@dataclass
class Table:
    title: str
    columns: List[str]
    rows: List[List[str]] = field(default_factory=list)
    # indices of the rows that start a group (a \midrule above them in LaTeX)
    breaks: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # machine-readable rows for the CSV file (numbers, not display strings); None: the display rows
    records: Optional[List[Dict[str, Any]]] = None


def markdown(table: Table) -> str:
    def line(cells: List[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    out = [f"### {table.title}", "", line(table.columns), "|" + "|".join("---" for _ in table.columns) + "|"]
    out += [line(row) for row in table.rows]
    if table.notes:
        out += [""] + [f"{note}  " for note in table.notes]
    return "\n".join(out) + "\n"


LATEX_ESCAPES = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
    "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", MISSING: "--", "–": "--",
    "×": r"$\times$", "≤": r"$\leq$",
}


def latex_escape(text: str) -> str:
    return "".join(LATEX_ESCAPES.get(ch, ch) for ch in text)


def latex(table: Table) -> str:
    """A booktabs tabular with the title as a comment (the paper's caption is the author's to write)."""
    out = [f"% {table.title}", r"\begin{tabular}{" + "l" * len(table.columns) + "}", r"\toprule"]
    out.append(" & ".join(latex_escape(c) for c in table.columns) + r" \\")
    out.append(r"\midrule")
    for i, row in enumerate(table.rows):
        if i in table.breaks and i > 0:
            out.append(r"\midrule")
        out.append(" & ".join(latex_escape(c) for c in row) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    out += [f"% {note}" for note in table.notes]
    return "\n".join(out) + "\n"


def csv_text(table: Table) -> str:
    buffer = io.StringIO()
    if table.records is None:
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(table.columns)
        writer.writerows(table.rows)
    else:
        keys = list(dict.fromkeys(k for record in table.records for k in record))
        dict_writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
        dict_writer.writeheader()
        dict_writer.writerows(table.records)
    return buffer.getvalue()


def write_tables(out: Path, stem: str, tables: List[Table]) -> List[Path]:
    """``<stem>.md`` and ``<stem>.tex`` hold every table; ``<stem>.csv`` holds the first (our results).
    The three are replaced together: a full disk leaves all three as they were."""
    files = {
        out / f"{stem}.md": "\n".join(markdown(t) for t in tables),
        out / f"{stem}.tex": "\n".join(latex(t) for t in tables),
        out / f"{stem}.csv": csv_text(tables[0]),
    }
    write_atomic_set([(path, text.encode("utf-8")) for path, text in files.items()])
    return list(files)


def backend_order(names: Iterable[str]) -> List[str]:
    """Registered backends in registry order, each followed by its other forms ("reformer (chunked)"),
    then any others named in records."""
    registered = list_attentions()
    names = set(names)
    known = sorted((n for n in names if mechanism(n) in registered),
                   key=lambda n: (registered.index(mechanism(n)), n != mechanism(n), n))
    return known + sorted(n for n in names if mechanism(n) not in registered)


def model(record: Dict[str, Any]) -> str:
    """The row a run record is counted in: its backend, with the form after it where the run's options
    chose one that lets a query reach other keys than the backend's default (``Attention.variant``):
    "reformer (chunked)". A backend this process has not registered is named by itself."""
    try:
        cls = get_attention(record["attn"])
    except AttentionError:
        return record["attn"]
    form = cls.variant((record.get("config") or {}).get("attn_options") or {})
    return f"{record['attn']} ({form})" if form else record["attn"]


def mechanism(row: str) -> str:
    """The backend of a table row named by ``model``: "reformer (chunked)" -> "reformer"."""
    return row.split(" (", 1)[0]


def fmt_number(value: Optional[float]) -> str:
    return MISSING if value is None else f"{value:.2f}"


def fmt_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def fmt_count(value: float) -> str:
    """A count with an SI suffix and three significant digits: 51200 -> "51.2k", 3.9e6 -> "3.9M"."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def plural(count: int, noun: str, nouns: str = "") -> str:
    """``1 run``, ``2 runs``: the count and the noun it takes (``nouns``: an irregular plural)."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, cut at a word boundary with "..." when it is longer."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    # a cut inside a word goes back to the word's start (unless the word is the whole text)
    if text[limit - 3] != " " and " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + "..."
