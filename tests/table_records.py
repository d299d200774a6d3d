"""Synthetic run records and the reading of lra-table's Markdown, shared by the table tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from lra.run.record import RECORD_KEYS, validate_record
from lra.tables import cli as tables


def make_record(task: str, attn: str, seed: int, test_acc: float, status: str = "completed",
                train_time_s: float = 100.0, finished_at: str = "2026-01-01T00:00:00+00:00",
                preset: str = "cpu") -> Dict[str, Any]:
    record: Dict[str, Any] = {key: None for key in RECORD_KEYS}
    record.update(
        schema=1, status=status, run_name=f"{task}_{attn}_{preset}_seed{seed}", task=task, attn=attn, preset=preset, seed=seed,
        config={}, attn_budget="N", steps=50, best_step=40, val_acc=test_acc, majority_acc=0.2,
        test_acc=test_acc if status == "completed" else None, train_time_s=train_time_s, eval_time_s=5.0,
        tokens_per_s=2000.0, peak_memory_mb=400.0, memory_kind="cpu_peak_rss", params=1000, device="cpu",
        device_name="x86_64 (2 CPUs visible)", world_size=1, precision="fp32", finished_at=finished_at,
        message="" if status == "completed" else "loss became nan at step 7", test_examples=416,
        final_train_loss=1.9, torch="2.13.0+cpu", python="3.11.7", git_commit="0" * 40, hostname="vm",
        started_at="2025-12-31T23:00:00+00:00",
    )
    validate_record(record)
    return record


def write_runs(folder: Path, records: List[Dict[str, Any]]) -> Path:
    for i, record in enumerate(records):
        run = folder / f"{record['run_name']}-{i}"
        run.mkdir(parents=True)
        (run / "record.json").write_text(json.dumps(record))
    return folder


# full: all five tasks, two seeds on ListOps; mita: ListOps with one diverged seed, Retrieval diverged only
FULL_ACC = {"listops": 0.30, "text": 0.60, "retrieval": 0.70, "image": 0.40, "pathfinder": 0.65}
RECORDS = [
    *(make_record(task, "full", 0, acc) for task, acc in FULL_ACC.items()),
    make_record("listops", "full", 1, 0.40),
    # an older record of a seed already run: left out
    make_record("text", "full", 0, 0.99, finished_at="2025-01-01T00:00:00+00:00"),
    make_record("listops", "mita", 0, 0.50, train_time_s=40.0),
    make_record("listops", "mita", 1, 0.0, status="diverged"),
    make_record("retrieval", "mita", 0, 0.0, status="diverged"),
]


def run_table(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "tables"
    assert tables.main(["--runs", str(tmp_path / "runs"), "--out", str(out), *args]) == 0
    return out


def row(markdown: str, *starts: str) -> List[str]:
    """The cells of the first Markdown table row whose leading cells are ``starts``."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[: len(starts)] == list(starts):
            return cells
    raise AssertionError(f"no row starting {starts}")
