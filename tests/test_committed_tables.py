"""results/tables/ is what the committed records make: lra-table run over them as
scripts/reproduce_tables.sh runs it (results/runs, results/mqar, and results/throughput beside them)
writes every committed table file byte for byte, and no file more or less, so a record cannot land
without its tables (nor a table without its record). The plots are compared by name: their bytes
follow the matplotlib and font versions, not the records."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from conftest import ROOT

COMMITTED = ROOT / "results" / "tables"


def test_the_committed_tables_are_the_committed_records_tables(cli: Callable, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # the paths the tables name are as reproduce_tables.sh gives them, from the checkout's root
    monkeypatch.chdir(ROOT)
    ran = cli("lra-table", "--runs", "results/runs", "--runs", "results/mqar", "--out", tmp_path)
    assert ran.code == 0, ran.err
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == sorted(p.name for p in COMMITTED.iterdir() if not p.name.startswith(".")), (
        "results/tables/ holds other files than the committed records make: run scripts/reproduce_tables.sh")
    stale = [name for name in built if not name.endswith(".png")
             and (tmp_path / name).read_bytes() != (COMMITTED / name).read_bytes()]
    assert not stale, f"results/tables/ is not what the committed records make ({', '.join(stale)}): run " \
                      "scripts/reproduce_tables.sh and commit its tables with the records"
