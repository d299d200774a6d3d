"""lra-table's efficiency table: train time against full attention's where the runs compare, totals,
each seed's time, machine speed and load."""
from __future__ import annotations

from pathlib import Path

import pytest

from lra.run.record import validate_record
from lra.tables import cli as tables
from table_records import RECORDS, make_record, row, run_table, write_runs


def test_efficiency_ratio_totals_and_diverged(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    md = (run_table(tmp_path, "--no-plots") / "efficiency.md").read_text()
    header = row(md, "Task", "Model")
    mita = dict(zip(header, row(md, "ListOps", "mita")))
    assert mita["Train time"] == "40.0 s" and mita["vs full"] == "0.40×" and mita["Seeds"] == "2"
    # one completed seed (the other diverged): no per-seed times beside the mean
    assert mita["Per seed (s)"] == "—"
    assert dict(zip(header, row(md, "Retrieval", "mita")))["Train time"] == "diverged"
    # full has all five tasks: its LRA total is the sum of the per-task means; mita has no total
    assert dict(zip(header, row(md, "LRA total (5 tasks)", "full")))["Train time"] == "8.3 min"
    assert "| LRA total (5 tasks) | mita" not in md
    assert "Published training time" in md and "10.6 hours" in md


def test_efficiency_table_carries_each_runs_load_average(tmp_path: Path) -> None:
    loaded = [make_record("listops", "full", seed, 0.3) for seed in (0, 1)]
    loaded[0]["load_average"] = [2.0, 1.5, 1.25]
    loaded[1]["train_time_s"] = 250.0
    loaded[0]["matmul_gflops"] = 61.9
    # the second record predates the field: still readable, shown as not recorded
    write_runs(tmp_path / "runs", loaded)
    md = (run_table(tmp_path, "--no-plots") / "efficiency.md").read_text()
    full = dict(zip(row(md, "Task", "Model"), row(md, "ListOps", "full")))
    assert full["Load (1/5/15 min)"] == "2.00 / 1.50 / 1.25; —" and full["Budget"] == "N"
    # each seed's train time beside the mean (machines of different speed show up here)
    assert full["Train time"] == "2.9 min" and full["Per seed (s)"] == "100 / 250"
    # and each seed's machine speed (the second record predates the field)
    assert full["Matmul GFLOP/s"] == "62 / —"
    # no "vs full" between runs on machines whose speed differs by more than 1.2x
    mita = [make_record("listops", "mita", seed, 0.3, train_time_s=50.0) for seed in (0, 1)]
    for record, rate in zip(loaded + mita, (62.0, 60.0, 58.0, 120.0)):
        record["matmul_gflops"] = rate

    def efficiency(name: str) -> str:
        write_runs(tmp_path / name, loaded + mita)
        assert tables.main(["--runs", str(tmp_path / name), "--out", str(tmp_path / f"{name}-tables"), "--no-plots"]) == 0
        return (tmp_path / f"{name}-tables" / "efficiency.md").read_text()

    mixed = efficiency("mixed")
    assert dict(zip(row(mixed, "Task", "Model"), row(mixed, "ListOps", "mita")))["vs full"] == "—"
    # stamps 2x apart on one machine in one boot (two runs sharing its cores): the ratio is shown
    for record in loaded + mita:
        record["boot_id"] = "boot-a"
    one_boot = efficiency("one-boot")
    assert dict(zip(row(one_boot, "Task", "Model"), row(one_boot, "ListOps", "mita")))["vs full"] == f"{50 / 175:.2f}×"
    # another boot among them (or a record without the field): the stamps decide again
    mita[1]["boot_id"] = "boot-b"
    two_boots = efficiency("two-boots")
    assert dict(zip(row(two_boots, "Task", "Model"), row(two_boots, "ListOps", "mita")))["vs full"] == "—"
    mita[1]["matmul_gflops"] = 61.0
    alike = efficiency("alike")
    assert dict(zip(row(alike, "Task", "Model"), row(alike, "ListOps", "mita")))["vs full"] == f"{50 / 175:.2f}×"
    with pytest.raises(ValueError, match="matmul_gflops"):
        validate_record({**loaded[0], "matmul_gflops": "fast"})
    bad = {**loaded[0], "load_average": [2.0, "high", 1.0]}
    with pytest.raises(ValueError, match="load_average"):
        validate_record(bad)
