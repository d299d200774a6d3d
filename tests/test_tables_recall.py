"""lra-table on real MQAR runs: the recall table's cells, budgets and selection, the recall plot, and
the LRA tables left as they are (records with and without MQAR runs beside them)."""
from __future__ import annotations

import csv
import json
import shutil
import statistics
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lra.tables.recall import keys_per_query
from table_records import RECORDS, row, write_runs

# two backends, two seeds, two levels (2 and 8 pairs at N = 32, vocabulary 32), 4 steps each
TINY = ["--task", "mqar", "--preset", "smoke", "--quiet", "--set", "model.dim=16", "model.ffn_dim=32", "train.steps=4",
        "train.eval_every=2", "data.max_len=32", "data.vocab=32", "data.size=32"]
BACKENDS = {"full": [], "topk": ["attn.topk=8"]}
PAIRS, SEEDS = (2, 8), (0, 1)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def mqar_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the eight tiny MQAR runs (lra-run in-process), trained once per session."""
    from lra.cli import call, run as lra_run

    root = tmp_path_factory.mktemp("mqar_runs")
    (root / "data").mkdir()
    for attn, extra in BACKENDS.items():
        for pairs in PAIRS:
            for seed in SEEDS:
                argv = [*TINY, f"data.pairs={pairs}", *extra, "--attn", attn, "--seed", str(seed),
                        "--data-dir", str(root / "data"), "--out", str(root / "runs")]
                assert call("lra-run", lra_run.main, argv) == 0
    return root / "runs"


def records_of(runs: Path) -> List[Dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*/record.json"))]


def table(tmp_path: Path, *runs: Path, extra: tuple = ()) -> Path:
    from lra.tables import cli as tables

    out = tmp_path / "tables"
    argv = [a for r in runs for a in ("--runs", str(r))]
    assert tables.main([*argv, "--include-smoke", "--out", str(out), *extra]) == 0
    return out


def test_recall_cells_are_the_seeds_mean_and_std(mqar_runs: Path, tmp_path: Path) -> None:
    out = table(tmp_path, mqar_runs)
    md = (out / "recall.md").read_text()
    header = row(md, "Model", "Protocol")
    assert header[-2:] == ["2 pairs", "8 pairs"]
    by_cell: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in records_of(mqar_runs):
        by_cell.setdefault((r["attn"], r["config"]["data"]["pairs"]), []).append(r)
    csv_rows = {(r["model"], int(r["pairs"])): r for r in csv.DictReader(open(out / "recall.csv"))}
    for attn in BACKENDS:
        cells = dict(zip(header, row(md, attn, "preset smoke")))
        assert (cells["Form"], cells["Vocab"], cells["N"], cells["Seeds"]) == ("two-token", "32", "32", "2")
        for pairs in PAIRS:
            # the two seeds of this level, and only they: the other level's records of the same seeds are another cell
            accs = [100.0 * r["test_acc"] for r in by_cell[(attn, pairs)]]
            assert len(accs) == len(SEEDS)
            mean, std = statistics.fmean(accs), statistics.stdev(accs)
            assert cells[f"{pairs} pairs"] == f"{mean:.2f} ± {std:.2f}"
            got = csv_rows[(attn, pairs)]
            assert float(got["acc_mean"]) == pytest.approx(mean) and float(got["acc_std"]) == pytest.approx(std)
            assert (float(got["acc_min"]), float(got["acc_max"])) == pytest.approx((min(accs), max(accs)))
            assert got["seeds"] == "2" and got["diverged"] == "0" and got["max_len"] == "32"
    # the budget column: full attention's "N" reaches all 32 keys, Top-k's k = 8 is 8 of them
    full, topk = (dict(zip(header, row(md, a, "preset smoke"))) for a in BACKENDS)
    assert (full["Budget"], full["Keys/query"]) == ("N", "32 (all)")
    assert (topk["Budget"], topk["Keys/query"]) == ("k = 8", "8")
    assert csv_rows[("topk", 2)]["keys_per_query"] == "8" and csv_rows[("full", 8)]["keys_per_query"] == "32"
    assert "Runs used (8)" in md and "Left out" not in md
    assert (out / "recall_vs_pairs.png").read_bytes()[:8] == PNG
    assert (out / "recall_by_family.png").read_bytes()[:8] == PNG
    assert r"\pm" in (out / "recall.tex").read_text()
    # MQAR records alone: no LRA accuracy or efficiency table, no LRA plot
    assert not any((out / f).exists() for f in ("accuracy.md", "efficiency.md", "accuracy_by_task.png"))


def test_a_newer_run_of_the_same_level_replaces_the_older(mqar_runs: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(mqar_runs, runs)
    source = next(p.parent for p in runs.glob("*/record.json")
                  if json.loads(p.read_text())["attn"] == "topk" and json.loads(p.read_text())["config"]["data"]["pairs"] == 8)
    again = runs / "a_rerun"
    shutil.copytree(source, again)
    record = json.loads((again / "record.json").read_text())
    record.update(finished_at="2999-01-01T00:00:00+00:00", test_acc=1.0)
    (again / "record.json").write_text(json.dumps(record))
    md = (table(tmp_path, runs, extra=("--no-plots",)) / "recall.md").read_text()
    header = row(md, "Model", "Protocol")
    others = [100.0 * r["test_acc"] for r in records_of(mqar_runs)
              if r["attn"] == "topk" and r["config"]["data"]["pairs"] == 8 and r["seed"] != record["seed"]]
    accs = [100.0, *others]
    assert dict(zip(header, row(md, "topk", "preset smoke")))["8 pairs"] == f"{statistics.fmean(accs):.2f} ± {statistics.stdev(accs):.2f}"
    assert f"{source.name}/record.json (older run of the same backend, preset, task, seed and level as" in md


def test_lra_tables_are_the_same_with_mqar_runs_beside_them(mqar_runs: Path, tmp_path: Path) -> None:
    lra = write_runs(tmp_path / "lra", RECORDS)
    alone = table(tmp_path / "alone", lra)
    both = table(tmp_path / "both", lra, mqar_runs)
    # without MQAR records nothing recall-related is written
    assert not list(alone.glob("recall*"))
    assert sorted(p.name for p in both.iterdir()) == sorted(
        [p.name for p in alone.iterdir()] + ["recall.md", "recall.csv", "recall.tex", "recall_vs_pairs.png", "recall_by_family.png"])
    for stem in ("accuracy", "efficiency"):
        for ext in ("md", "csv", "tex"):
            assert (both / f"{stem}.{ext}").read_bytes() == (alone / f"{stem}.{ext}").read_bytes(), f"{stem}.{ext}"
    recall = (both / "recall.md").read_text()
    assert "Runs used (8)" in recall and "listops" not in recall


@pytest.mark.parametrize("budget, keys", [
    ("N", 64), ("N (all keys, through a 32 x 32 kernel state)", 64), ("k = 8", 8), ("m + k = 48", 48),
    ("topk x block_size = 128", 64), ("n = 16 agents", 16), ("a learned mixture", None),
], ids=["full", "linear", "topk", "mita", "moba-over-N", "agent", "no-count"])
def test_keys_per_query_reads_the_budget_text(budget: str, keys: Any) -> None:
    assert keys_per_query(budget, 64) == keys


def test_every_backend_budget_gives_a_count() -> None:
    from attentions import build_attention, list_attentions

    for name in list_attentions():
        text = build_attention(name, num_heads=2, head_dim=16, max_len=4096).budget()
        assert isinstance(keys_per_query(text, 4096), int), (name, text)


def test_the_family_plot_groups_every_backend_by_its_taxonomy() -> None:
    """recall_by_family.png's sections: each registered backend under its taxonomy's scaling strategy, the
    families in the plot's order, a backend the registry lacks in a section of its own, never dropped."""
    from attentions import get_attention, list_attentions
    from lra.tables.plots import FAMILIES, by_family
    from lra.tables.recall import Row

    names = [*list_attentions(), "retired_backend"]
    rows = [Row("cpu", "one-token", 256, 128, name, "N") for name in names]
    grouped = by_family(rows)
    assert [row.attn for _, members in grouped for row in members] == sorted(
        names, key=lambda n: [f for f, _ in grouped].index(
            get_attention(n).taxonomy.scaling if n != "retired_backend" else "unregistered"))
    families = [f for f, _ in grouped]
    assert families == [f for f, _ in FAMILIES if f in families] + ["unregistered"]
    for family, members in grouped[:-1]:
        assert {get_attention(r.attn).taxonomy.scaling for r in members} == {family}
    assert dict(grouped)["both"][0].attn == "mita" and dict(grouped)["unregistered"][0].attn == "retired_backend"
