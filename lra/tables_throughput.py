"""Throughput tables from lra-bench sweep records: train tokens/s by backend and length."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .table_format import MISSING, Table, backend_order, fmt_count

def throughput_table(path: Path, data: Dict[str, Any]) -> Optional[Table]:
    """Train tokens/s by backend and length from one lra-bench sweep record; None if it holds no points."""
    cells: Dict[Tuple[str, int], str] = {}
    for p in data.get("points") or []:
        if not isinstance(p, dict):
            continue
        backend, length = p.get("backend", p.get("attn")), p.get("length", p.get("n"))
        if backend is None or not isinstance(length, int):
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
    return table


def throughput_tables(folder: Path) -> List[Table]:
    """One table per sweep record under ``folder`` (any ``*.json`` holding a "points" list)."""
    tables = []
    for path in sorted(folder.glob("**/*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        table = throughput_table(path, data) if isinstance(data, dict) and isinstance(data.get("points"), list) else None
        if table is not None:
            tables.append(table)
    return tables
