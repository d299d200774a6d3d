"""lra-table's plots: written atomically, and the seed spread drawn where there are several seeds."""
from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from table_records import RECORDS, make_record, run_table, write_runs


def test_plots_written_atomically(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    out = run_table(tmp_path)
    for name in ("accuracy_by_task.png", "accuracy_vs_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_accuracy_vs_time_shows_the_seed_spread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.container import ErrorbarContainer

    from lra.tables import plots

    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or path)
    records = [make_record("listops", "full", 0, 0.30, train_time_s=100.0),
               make_record("listops", "full", 1, 0.40, train_time_s=140.0),
               make_record("listops", "mita", 0, 0.50, train_time_s=40.0)]
    plots.accuracy_vs_time(plots.by_series(records, ["full", "mita"]), tmp_path / "plot.png")
    (ax,) = figures[0].axes
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    # one point of two seeds (full) has bars, the single seed (mita) none
    assert len(bars) == 1
    _, _, (x_bar, y_bar) = bars[0]
    (x_span,), (y_span,) = x_bar.get_segments(), y_bar.get_segments()
    assert [round(x) for x, _ in x_span] == [100, 140]  # the range of the train times
    std = statistics.stdev([30.0, 40.0])
    assert [round(y, 6) for _, y in y_span] == [round(35.0 - std, 6), round(35.0 + std, 6)]
    assert "std of the accuracy and range of the time over seeds" in ax.get_title()
    # the axes hold the bars
    assert ax.get_ylim()[0] < 35.0 - std and ax.get_ylim()[1] > 50.0
