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


def drawn(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures the plots make, kept instead of written."""
    from lra.tables import plot_style

    figures: list = []
    monkeypatch.setattr(plot_style, "save", lambda fig, path: figures.append(fig) or path)
    return figures


def test_accuracy_vs_time_shows_the_seed_spread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.container import ErrorbarContainer

    from lra.tables import plots

    figures = drawn(monkeypatch)
    records = [make_record("listops", "full", 0, 0.30, train_time_s=100.0),
               make_record("listops", "full", 1, 0.40, train_time_s=140.0),
               make_record("listops", "mita", 0, 0.50, train_time_s=40.0)]
    plots.accuracy_vs_time(plots.by_series(records, ["full", "mita"]), tmp_path / "plot.png")
    # one panel: full's family (MiTA, alone in its family, is drawn in every panel)
    (ax,) = [a for a in figures[0].axes if a.get_visible()]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    # one point of two seeds (full) has bars, the single seed (mita) none
    assert len(bars) == 1
    _, _, (x_bar, y_bar) = bars[0]
    (x_span,), (y_span,) = x_bar.get_segments(), y_bar.get_segments()
    assert [round(x) for x, _ in x_span] == [100, 140]  # the range of the train times
    std = statistics.stdev([30.0, 40.0])
    assert [round(y, 6) for _, y in y_span] == [round(35.0 - std, 6), round(35.0 + std, 6)]
    assert "std of the accuracy and range of the time over seeds" in figures[0]._suptitle.get_text()
    # the axes hold the bars
    assert ax.get_ylim()[0] < 35.0 - std and ax.get_ylim()[1] > 50.0


def test_every_backend_in_its_familys_panel_and_mita_in_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """22 backends: one panel per family (MiTA alone in its family: no panel of its own), each naming its
    own backends only, and MiTA drawn in red in every one of them, and in red in the bars' plot."""
    from attentions import list_attentions, scaling_of
    from matplotlib.colors import to_hex

    from lra.tables import plots
    from lra.tables.plot_style import FOCUS_STYLE

    figures = drawn(monkeypatch)
    names = list_attentions()
    records = [make_record("listops", name, 0, 0.2 + 0.01 * i, train_time_s=100.0 + 10 * i) for i, name in enumerate(names)]
    series = plots.by_series(records, names)
    plots.accuracy_vs_time(series, tmp_path / "time.png")
    panels = [a for a in figures[0].axes if a.get_visible()]
    families = {scaling_of(n) for n in names} - {"both"}
    assert len(panels) == len(families)
    red = to_hex(FOCUS_STYLE["color"])
    for ax in panels:
        labelled = {t.get_text() for t in ax.texts}
        family = {scaling_of(n) for n in labelled} - {"both"}
        assert len(family) == 1 and labelled - {"mita"} == {n for n in names if scaling_of(n) in family}
        assert any(to_hex(c.get_facecolors()[0]) == red for c in ax.collections if len(c.get_facecolors()))
    plots.accuracy_bars(series, tmp_path / "bars.png")
    (ax,) = figures[1].axes
    assert [t.get_text() for t in ax.get_yticklabels()] == [n for f, _ in plots.FAMILIES for n in names if scaling_of(n) == f]
    # each row's bar, found at its tick
    bars = {t.get_text(): next(b for b in ax.patches if abs(b.get_y() + b.get_height() / 2 - y) < 1e-6)
            for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    assert to_hex(bars["mita"].get_facecolor()) == red
    assert {to_hex(b.get_facecolor()) for n, b in bars.items() if n != "mita"}.isdisjoint({red})


def test_the_recall_plot_has_a_panel_per_family_with_mita_and_full_in_each(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from attentions import list_attentions, scaling_of

    from lra.tables.plots_recall import recall_vs_pairs
    from lra.tables.recall import Row

    figures = drawn(monkeypatch)
    names = list_attentions()
    cells = {Row("cpu", "one-token", 256, 128, name, "N"): {p: [{"status": "completed", "test_acc": 0.5}] for p in (8, 16)}
             for name in names}
    recall_vs_pairs(cells, tmp_path / "recall.png")
    panels = [a for a in figures[0].axes if a.lines]
    assert len(panels) == len({scaling_of(n) for n in names} - {"both"})
    for ax in panels:
        shown = [line.get_label().split(" ")[0] for line in ax.lines]
        assert "mita" in shown and "full" in shown
        # at most ten backends of one family besides them: each its own colour and marker
        own = [(line.get_color(), line.get_marker()) for line in ax.lines if line.get_label().split(" ")[0] not in ("mita", "full")]
        assert len(set(own)) == len(own) <= 10


def test_point_labels_cover_no_other_label_and_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """22 backends crowded on one plateau (as ListOps's cpu runs are): in every panel each label sits
    inside the panel and clear of every other label and of every marker."""
    from attentions import list_attentions
    from matplotlib.collections import PathCollection
    from matplotlib.text import Text

    from lra.tables import plots

    figures = drawn(monkeypatch)
    names = list_attentions()
    records = [make_record("listops", name, seed, 0.33 + 0.002 * (i % 4) + 0.001 * seed,
                           train_time_s=200.0 + 15.0 * (i % 5) + seed)
               for i, name in enumerate(names) for seed in (0, 1)]
    plots.accuracy_vs_time(plots.by_series(records, names), tmp_path / "time.png")
    figure = figures[0]
    figure.canvas.draw()  # sets each annotation's transform from its offset
    renderer = figure.canvas.get_renderer()
    for ax in [a for a in figure.axes if a.get_visible()]:
        labels = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text alone, not its leader
        assert len(labels) >= 4
        panel = ax.get_window_extent(renderer)
        for n, box in enumerate(labels):
            assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
            assert not any(box.overlaps(other) for other in labels[n + 1:]), ax.texts[n].get_text()
        scale = figure.dpi / 72.0
        for collection in [c for c in ax.collections if isinstance(c, PathCollection)]:
            for x, y in collection.get_offsets():
                px, py = ax.transData.transform((x, y))
                r = collection.get_sizes()[0] ** 0.5 / 2 * scale
                for box, text in zip(labels, ax.texts):
                    assert not (box.x0 < px + r and px - r < box.x1 and box.y0 < py + r and py - r < box.y1), text.get_text()


def test_the_titles_say_when_backends_are_tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lra.tables import plots

    figures = drawn(monkeypatch)
    plain = [make_record("listops", "full", 0, 0.3), make_record("listops", "mita", 0, 0.4)]
    tuned = make_record("listops", "mita", 0, 0.4)
    tuned["config"] = {**(tuned.get("config") or {}), "tuning": {"grid": {"train.lr": [1e-3, 3e-3]}, "seed": 0}}
    for records in (plain, [plain[0], tuned]):
        series = plots.by_series(records, ["full", "mita"])
        plots.accuracy_bars(series, tmp_path / "bars.png")
        plots.accuracy_vs_time(series, tmp_path / "time.png")
    titles = [f._suptitle.get_text() for f in figures]
    assert not any("tuned" in t for t in titles[:2])
    assert all("train.lr tuned where the table says" in t for t in titles[2:])
