"""Throughput tables from lra-bench sweep records: train tokens/s by backend and length, and the
speedup of each backend over full attention at model level beside the published speedups. A timing
reference in a record (``none``, the model without attention, which lra-bench times when named) is
left out: its ceiling is in the sweep's own table.md."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from attentions import is_timing_reference

from ..bench.record import read_record
from ..errors import UserError
from ..format import MISSING, Table, backend_order, fmt_count


def throughput_table(path: Path, data: Dict[str, Any]) -> Optional[Table]:
    """Train tokens/s by backend and length from one lra-bench sweep record; None if it holds no points."""
    cells: Dict[Tuple[str, int], str] = {}
    for p in data.get("points") or []:
        if not isinstance(p, dict):
            continue
        backend, length = p.get("backend", p.get("attn")), p.get("length", p.get("n"))
        if backend is None or not isinstance(length, int) or is_timing_reference(backend):
            continue
        rate = p.get("tokens_per_s")
        rate = rate.get("train") if isinstance(rate, dict) else rate
        status = str(p.get("status", "ok"))
        if isinstance(rate, (int, float)) and status in ("ok", "estimated"):
            cells[(backend, length)] = ("~" if p.get("estimated") else "") + fmt_count(rate)
        else:
            cells[(backend, length)] = f"({status})" if p.get("skipped") else status
    if not cells:
        return None
    lengths = sorted({n for _, n in cells})
    hw = data.get("hardware")
    device = (hw.get("gpu") or hw.get("cpu_model") or "") if isinstance(hw, dict) else ""
    level = f", {data['level']} level" if data.get("level") else ""
    table = Table(f"Train throughput (tokens/s): {path.parent.name}/{path.name}{level}" + (f", {device}" if device else ""),
                  ["Backend", *(f"N={n:,}" for n in lengths)])
    for backend in backend_order(b for b, _ in cells):
        table.rows.append([backend, *(cells.get((backend, n), MISSING) for n in lengths)])
    table.notes = ["~ = estimated; oom / timeout = the point did not fit; (status) = not run after a shorter length failed."]
    if data.get("complete") is False:
        table.notes.append("Incomplete sweep (stopped before every point ran): an empty cell was not measured.")
    return table


# published_efficiency.csv rows such as "throughput speedup over full attention at N=65536"
SPEEDUP_WHAT = re.compile(r"throughput speedup over full attention at N=(\d+)")


def published_speedups(rows: List[Dict[str, str]]) -> Dict[Tuple[str, int], Tuple[float, str]]:
    """(model name lower-cased, N) -> (speedup, source) from the published efficiency rows."""
    found = {}
    for row in rows:
        match = SPEEDUP_WHAT.fullmatch(row.get("what", "").strip())
        try:
            value = float(row.get("value", ""))
        except ValueError:
            continue
        if match:
            found[(row.get("model", "").strip().lower(), int(match.group(1)))] = (value, row.get("source", ""))
    return found


def rates_of(data: Dict[str, Any], mode: str) -> Dict[Tuple[str, int], Tuple[float, bool]]:
    """(backend, N) -> (tokens/s in ``mode``, estimated) of the measured points of one record."""
    rates = {}
    for p in data.get("points") or []:
        rate = p.get("tokens_per_s", {}).get(mode) if isinstance(p, dict) and isinstance(p.get("tokens_per_s"), dict) else None
        backend, length = p.get("backend", p.get("attn")), p.get("length", p.get("n"))
        if (isinstance(rate, (int, float)) and p.get("status", "ok") in ("ok", "estimated") and backend
                and isinstance(length, int) and not is_timing_reference(backend)):
            rates[(backend, length)] = (float(rate), bool(p.get("estimated")))
    return rates


def speedup_table(path: Path, data: Dict[str, Any], published: Dict[Tuple[str, int], Tuple[float, str]]) -> Optional[Table]:
    """Model level: each backend's throughput over full attention's (training step and inference step),
    with the published figure for the same backend and length where there is one; None without full
    attention or other backends."""
    rates = {mode: rates_of(data, mode) for mode in ("train", "forward")}
    lengths = sorted({n for b, n in rates["train"] if b == "full"})
    backends = [b for b in backend_order({b for b, _ in rates["train"]}) if b != "full"]
    if data.get("level") != "model" or not lengths or not backends:
        return None
    hw = data.get("hardware") or {}
    table = Table(f"Speedup over full attention, measured and published: {path.parent.name}, "
                  f"{hw.get('gpu') or hw.get('cpu_model') or ''}",
                  ["Backend", "Step", *(f"N={n:,}" for n in lengths)])
    for backend in backends:
        for mode, step in (("train", "training"), ("forward", "inference")):
            if not rates[mode]:  # an interleaved sweep times the training step alone
                continue
            cells = []
            for n in lengths:
                mine, full = rates[mode].get((backend, n)), rates[mode].get(("full", n))
                cells.append(MISSING if mine is None or full is None
                             else ("~" if mine[1] or full[1] else "") + f"{mine[0] / full[0]:.3g}x")
            table.rows.append([backend, step, *cells])
        paper = [published.get((backend, n)) for n in lengths]
        if any(paper):
            source = next(p[1] for p in paper if p)
            table.rows.append([backend, f"published ({source})", *(MISSING if p is None else f"{p[0]:g}x" for p in paper)])
    table.notes = ["tokens/s of the backend over full attention's, each at its own searched batch; ~ = one of the two "
                   "estimated from a slice of the queries; published: reference/published_efficiency.csv."]
    return table


def throughput_tables(folder: Path, published: Optional[List[Dict[str, str]]] = None) -> Tuple[List[Table], List[str]]:
    """One table per lra-bench sweep record under ``folder`` (its ``*.json`` files), and one of speedups
    over full attention per model-level record, beside the published speedups; and why each other
    ``*.json`` file there was left out (lra/bench/record.py's one-line reason)."""
    speedups = published_speedups(published or [])
    tables, left_out = [], []
    for path in sorted(folder.glob("**/*.json")) if folder.is_dir() else []:
        try:
            data = read_record(path)
        except UserError as err:
            left_out.append(str(err))
            continue
        table = throughput_table(path, data)
        if table is not None:
            tables.append(table)
            speedup = speedup_table(path, data, speedups)
            if speedup is not None:
                tables.append(speedup)
    return tables, left_out
