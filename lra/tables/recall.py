"""The recall table: multi-query associative recall (MQAR, ``lra/tasks/mqar.py``), test accuracy over
the query positions per backend and level, beside the keys each query of the backend sees.

One row per (preset, formulation, vocabulary, N, backend, budget), one column per number of
key-value pairs, the axis zoology's figures sweep; ``recall_vs_pairs.png`` (``plots.py``) draws the
same cells. The level of a record is its task's ``levels`` (``records.levels``), so two runs that
differ in ``--set data.pairs=...`` are two cells, never one.
"""
from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..format import MISSING, Table, backend_order, model
from .records import levels
from .summary import seeds_text, summarize

# the task this table reads; the LRA accuracy and efficiency tables leave its records out
TASK = "mqar"


@dataclass(frozen=True)
class Row:
    """What one row of the table holds fixed: the protocol, the level but the pairs, the backend and its budget."""

    preset: str
    form: str
    vocab: int
    n: int
    attn: str
    budget: str

    @property
    def keys(self) -> Optional[int]:
        return keys_per_query(self.budget, self.n)


# rows -> number of pairs -> the records of that cell (one per seed)
Cells = Dict[Row, Dict[int, List[Dict[str, Any]]]]


def keys_per_query(budget: str, n: int) -> Optional[int]:
    """The keys one query attends to at sequence length ``n``, read from a record's ``attn_budget`` field:
    the text the backend's ``budget()`` gives at the run's options, "N ..." when a query reaches every
    key, else a formula whose last "= <count>" is the count ("k = 8", "m + k = 128", "n = 128 agents").
    At most ``n`` (a top-k of 128 over 64 keys takes all 64); None when the text holds no count."""
    if budget.split(" ", 1)[0] == "N":
        return n
    counts = re.findall(r"=\s*(\d+)", budget)
    return min(int(counts[-1]), n) if counts else None


def recall_cells(records: List[Dict[str, Any]]) -> Cells:
    """The MQAR records by row and number of pairs, rows in table order: protocol, formulation,
    vocabulary and N, then backends in registry order, then budgets from the fewest keys."""
    cells: Cells = defaultdict(lambda: defaultdict(list))
    for record in records:
        if record["task"] != TASK:
            continue
        level = levels(record)
        row = Row(record["preset"], level["level"], level["vocab"], level["max_len"], model(record), record["attn_budget"])
        cells[row][level["pairs"]].append(record)
    order = backend_order(row.attn for row in cells)
    rows = sorted(cells, key=lambda r: (r.preset, r.form, r.vocab, r.n, order.index(r.attn),
                                        r.keys if r.keys is not None else r.n + 1, r.budget))
    return {row: dict(sorted(cells[row].items())) for row in rows}


def recall_table(cells: Cells, tuned: Sequence[Any] = ()) -> Table:
    """The recall table; with tuned cells among the records (lra/tables/tuning.py), a column of each
    row's chosen values, one per level."""
    from .tuning import setting_text, tuned_keys

    pairs = sorted({p for per_pairs in cells.values() for p in per_pairs})
    keys = tuned_keys([c for c in tuned if c.key[2] == TASK])
    by_key = {c.key: c for c in tuned}
    chosen_column = [f"{', '.join(keys)} chosen ({' / '.join(map(str, pairs))} pairs)"] if keys else []
    table = Table("MQAR test accuracy (%) by number of key-value pairs",
                  ["Model", "Protocol", "Form", "Vocab", "N", "Keys/query", "Budget", "Seeds", *chosen_column,
                   *(f"{p} pairs" for p in pairs)])
    table.records = []
    group = None
    for row, per_pairs in cells.items():
        if (row.preset, row.form, row.vocab, row.n) != group:
            group = (row.preset, row.form, row.vocab, row.n)
            table.breaks.append(len(table.rows))
        summaries = {p: summarize(rs, "test_acc", 100.0) for p, rs in per_pairs.items()}
        keys_text = MISSING if row.keys is None else f"{row.keys}" + (" (all)" if row.keys == row.n else "")
        shown = [setting_text([per_pairs.get(p, []) for p in pairs], by_key, keys)] if keys else []
        table.rows.append([row.attn, f"preset {row.preset}", row.form, str(row.vocab), str(row.n), keys_text, row.budget,
                           seeds_text(summaries), *shown, *(summaries[p].text() if p in summaries else MISSING for p in pairs)])
        for p, s in summaries.items():
            times = [r["train_time_s"] for r in per_pairs[p] if r["status"] == "completed" and r["train_time_s"] is not None]
            table.records.append({
                "model": row.attn, "preset": row.preset, "form": row.form, "vocab": row.vocab, "max_len": row.n,
                "pairs": p, "attn_budget": row.budget, "keys_per_query": row.keys,
                "acc_mean": s.mean, "acc_std": s.std, "acc_min": min(s.values, default=None),
                "acc_max": max(s.values, default=None), "seeds": len(s.values), "diverged": s.diverged,
                "train_time_s": statistics.fmean(times) if times else None,
                **({"tuned": setting_text([per_pairs[p]], by_key, keys)} if keys else {}),
            })
    table.notes = [
        "Test accuracy over the query positions of the best-validation checkpoint (every key of a sequence is "
        "asked once); mean ± sample std over seeds where several. Form: data.level (two-token, zoology's, or "
        "one-token); Vocab: data.vocab; N: data.max_len; one column per data.pairs.",
        "Keys/query: the keys one query attends to, read from the record's attn_budget (the backend's budget() at "
        "the run's options; Budget shows it), at most N; (all) where a query reaches every key, as full attention "
        "does and linear attention does through its fixed-size state. Naming one of the sequence's P values at "
        "random scores 100/P %.",
    ]
    return table
