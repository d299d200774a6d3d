"""The LRA paper's efficiency table (Tay et al. 2021, Table 2) regenerated: training steps per second
and peak memory on byte-level Text at 1K-4K, each relative to full attention, from an interleaved
``lra-bench model --preset lra-table2`` record, beside the published rows of the same mechanism.

Each backend's row (this suite) comes first, then the published row of its mechanism (the backend's
``published_as`` names it) from ``published_efficiency.csv`` (source ``tay2021_lra_table2``: one
row of steps/s and one of GB per model, the four lengths separated by ``/``), with the notes of
``published_notes.csv`` for that source: a mechanism the paper did not time keeps a row with its
note. Ratios: ours over full attention's in the same rounds of the same process; the published
speed-ups as the paper prints them (in brackets, from its unrounded rates), the published memory
ratios computed from the printed GB.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from attentions import is_timing_reference, list_attentions

from ..bench.record import read_record
from ..bench.report import fmt_length, model_text
from ..errors import UserError
from ..format import MISSING, Table, backend_order
from ..machine import describe
from .published import NoteMarks, claims, note_for
from .summary import SOURCES

SOURCE = "tay2021_lra_table2"
# the paper's four lengths, as its columns name them; a record's lengths are matched by that name
PAPER_LENGTHS = ("1K", "2K", "3K", "4K")
# the units of its rows: steps per second, GB per TPU device, the printed speed-up over the Transformer
SPEED, MEMORY, PRINTED = "steps/s", "GB", "x"
# the statuses of a point with a time
TIMED = ("ok", "estimated")


def table2_records(folder: Path) -> List[Tuple[Path, Dict[str, Any]]]:
    """The interleaved lra-bench records of the Text model under ``folder``, in path order."""
    found = []
    for path in sorted(folder.glob("**/*.json")) if folder.is_dir() else []:
        try:
            record = read_record(path)
        except UserError:
            continue
        settings = record["settings"]
        if settings.get("interleaved") and settings.get("task") == "text":
            found.append((path, record))
    return found


def published_rows(rows: List[Dict[str, str]]) -> Dict[str, Dict[str, List[Optional[float]]]]:
    """Model -> {"steps/s": [4 values], "GB": [4 values], "x": [4 printed speed-ups]} of the published
    Table 2 rows (the Transformer has no speed-ups)."""
    out: Dict[str, Dict[str, List[Optional[float]]]] = {}
    for row in rows:
        if row.get("source") != SOURCE or row.get("unit") not in (SPEED, MEMORY, PRINTED):
            continue
        values = [float(v) if v.strip() else None for v in row["value"].split("/")]
        if len(values) != len(PAPER_LENGTHS):
            raise UserError(f"published_efficiency.csv: {row['model']}'s {row['unit']} row holds {len(values)} values; "
                            f"Table 2 has {len(PAPER_LENGTHS)} ({', '.join(PAPER_LENGTHS)}) separated by /")
        out.setdefault(row["model"], {})[row["unit"]] = values
    return out


def ratio_text(value: float, reference: Optional[float]) -> str:
    return f" ({value / reference:.2g}x)" if reference else ""


def our_cells(record: Dict[str, Any], backend: str, lengths: List[int]) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Steps/s and memory cells of one backend (each with its ratio to full), and its CSV rows."""
    index = {(p["backend"], p["length"]): p for p in record["points"]}
    speed, memory, rows = [], [], []
    for n in lengths:
        point, full = index.get((backend, n)), index.get(("full", n))
        row: Dict[str, Any] = {"length": n, "batch": None, "status": "not run", "steps_per_s": None,
                               "steps_vs_full": None, "peak_memory_gb": None, "memory_vs_full": None}
        if point is None or point["status"] not in TIMED:
            status = MISSING if point is None else (f"({point['status']})" if point.get("skipped") else point["status"])
            speed.append(status)
            memory.append(status)
            rows.append({**row, "status": "not run" if point is None else point["status"]})
            continue
        rate = 1.0 / point["train"]["median_s"]
        full_rate = 1.0 / full["train"]["median_s"] if full and full["status"] in TIMED else None
        gb = point["peak_mem_mb"] / 1024 if point.get("peak_mem_mb") is not None else None
        full_gb = full["peak_mem_mb"] / 1024 if full_rate and full.get("peak_mem_mb") is not None else None
        speed.append(f"{rate:.3g}" + ratio_text(rate, full_rate))
        memory.append(MISSING if gb is None else f"{gb:.3g}" + ratio_text(gb, full_gb))
        rows.append({**row, "batch": point["batch"], "status": point["status"], "steps_per_s": rate,
                     "steps_vs_full": rate / full_rate if full_rate else None, "peak_memory_gb": gb,
                     "memory_vs_full": gb / full_gb if gb is not None and full_gb else None})
    return speed + memory, rows


def paper_cells(values: Dict[str, List[Optional[float]]], reference: Dict[str, List[Optional[float]]],
                labels: List[str]) -> List[str]:
    """Published steps/s at the record's lengths (by name) with the printed speed-up (none for the
    Transformer itself, 1x), then GB with its ratio to the Transformer's computed from the printed GB."""
    cells = []
    for unit in (SPEED, MEMORY):
        for label in labels:
            if label not in PAPER_LENGTHS or unit not in values:
                cells.append(MISSING)
                continue
            i = PAPER_LENGTHS.index(label)
            value, full = values[unit][i], (reference.get(unit) or [None] * 4)[i]
            if value is None:
                cells.append(MISSING)
            elif unit == SPEED:
                printed = (values.get(PRINTED) or [None] * 4)[i]
                cells.append(f"{value:g}" + (f" ({printed:g}x)" if printed is not None else " (1x)" if value == full else ""))
            else:
                cells.append(f"{value:g}" + ratio_text(value, full))
    return cells


def record_notes(path: Path, record: Dict[str, Any]) -> List[str]:
    s, hw = record["settings"], record["hardware"]
    batches = ", ".join(f"{row['batch']} at {fmt_length(row['length'])}" for row in record.get("per_length") or [])
    load = record["load_average"]
    kind = ("torch.cuda.max_memory_allocated over the backend's build and first step, minus what was allocated before"
            if hw["device"] == "cuda" else "peak resident set over the backend's build and first step, minus the "
            "resident set before it (the heap trimmed and the peak reset before each backend)")
    return [
        f"This suite: {path.parent.name}/{path.name} ({describe(hw)}, {s['dtype']}, torch {record['versions']['torch']}, "
        f"commit {record['versions']['git_commit']}; load average (1 min) {load['start'][0]} at start, "
        f"{load.get('end', ['?'])[0]} at end): {model_text(s)}; padded rows (N/2..N real tokens). Every backend at one "
        f"length runs in one process on one batch: steps/s = 1 / the median of {s['repeats']} rounds of one training "
        f"step each, (x) = over full attention's in the same rounds. Batch: {batches or s['batch']} (the largest, from "
        f"{s['batch']} by halves, at which every backend's step fits in memory). Peak memory (GB = GiB): {kind}; "
        "(x) = over full attention's.",
        f"Published: {SOURCES.get(SOURCE, SOURCE)} (published_efficiency.csv): steps/s and peak memory per TPU device "
        "(GB) on 4x4 TPU V3 chips, batch 32; (x) = over the published Transformer's: the speed-ups as the paper "
        "prints them in brackets, the memory ratios computed from the printed GB. (status) = not run after a "
        "shorter length failed; "
        f"{MISSING} = not measured or not published.",
        "What differs from the paper's setting: the hardware (here a CPU or one GPU, there 16 TPU chips sharing the "
        "batch); each attention's implementation (full attention here is torch's fused scaled_dot_product_attention, "
        "which never holds the N x N weights, there a JAX softmax(QK^T)V that holds them); the batch where every "
        "backend does not fit 32; 1K = 1,024 tokens here; the paper does not state its benchmark model (its appendix "
        "describes 6 layers of width 512, its released text configuration, used here, 4 of width 256).",
    ]


def table2_table(path: Path, record: Dict[str, Any], published: Dict[str, Dict[str, List[Optional[float]]]],
                 notes: List[Dict[str, str]]) -> Table:
    """One record beside the published Table 2, mechanism by mechanism (its CSV rows in ``records``)."""
    lengths = record["settings"]["lengths"]
    labels = [fmt_length(n) for n in lengths]
    batch = {row["length"]: row["batch"] for row in record.get("per_length") or []}
    heads = [f"{label} (B={batch[n]})" if n in batch else label for n, label in zip(lengths, labels)]
    table = Table(f"LRA Table 2 regenerated: training steps/s and peak memory (GB) on byte-level Text, "
                  f"{describe(record['hardware'])}",
                  ["Mechanism", "Row", *(f"steps/s {h}" for h in heads), *(f"memory {h}" for h in heads), "Note"])
    owner = claims()
    ours = backend_order(b for b in record["settings"]["backends"] if not is_timing_reference(b))
    reference = published.get(next((m for m, b in owner.items() if b == "full" and m in published), ""), {})
    mark = NoteMarks()
    csv_rows: List[Dict[str, Any]] = []

    untimed = {n["model"] for n in notes if n.get("source") == SOURCE and n.get("model") != "*"}
    # every mechanism of the record or of Table 2 (a published one the record lacks: its published row alone)
    paper = {owner[m] for m in [*published, *untimed] if m in owner}
    for name in [n for n in list_attentions() if n in ours or n in paper] + [n for n in ours if n not in list_attentions()]:
        table.breaks.append(len(table.rows))
        if name in ours:
            cells, rows = our_cells(record, name, lengths)
            table.rows.append([name, "this suite", *cells, ""])
            csv_rows += [{"record": str(path), "mechanism": name, "row": "this suite", **row} for row in rows]
        for model in [m for m, b in owner.items() if b == name and (m in published or m in untimed)]:
            texts = [n for n in note_for(notes, SOURCE, model) if n not in note_for(notes, SOURCE, "*")]
            table.rows.append([name, f"{model} ({SOURCES.get(SOURCE, SOURCE)})",
                               *paper_cells(published.get(model, {}), reference, labels), mark(texts)])
            csv_rows += paper_rows(name, model, published.get(model, {}), reference)
    protocol = [n["note"] for n in notes if n.get("source") == SOURCE and n.get("model") == "*"]
    table.notes = record_notes(path, record) + protocol + mark.lines()
    table.records = csv_rows
    return table


def paper_rows(mechanism: str, model: str, values: Dict[str, List[Optional[float]]],
               reference: Dict[str, List[Optional[float]]]) -> List[Dict[str, Any]]:
    """The CSV rows of one published model, a length each."""
    rows = []
    for i, label in enumerate(PAPER_LENGTHS):
        speed, memory, printed = ((values.get(unit) or [None] * 4)[i] for unit in (SPEED, MEMORY, PRINTED))
        full_memory = (reference.get(MEMORY) or [None] * 4)[i]
        if printed is None and values is reference:  # the Transformer's own row
            printed = 1.0
        rows.append({"record": "", "mechanism": mechanism, "row": model, "length": label, "batch": 32,
                     "status": "published" if speed is not None else "not published", "steps_per_s": speed,
                     "steps_vs_full": printed,
                     "peak_memory_gb": memory,
                     "memory_vs_full": memory / full_memory if memory is not None and full_memory else None})
    return rows


def table2_tables(folder: Path, published_eff: List[Dict[str, str]], notes: List[Dict[str, str]]
                  ) -> List[Tuple[Path, Dict[str, Any], Table]]:
    """One table per interleaved Text record under ``folder`` (record path, record, table); the first
    table's CSV rows hold every record's."""
    published = published_rows(published_eff)
    found = [(path, record, table2_table(path, record, published, notes)) for path, record in table2_records(folder)]
    if found:
        found[0][2].records = [row for _, _, table in found for row in table.records or []]
    return found
