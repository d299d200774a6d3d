"""lra.analyze.over_seeds: budget analyses of several runs grouped per backend, a column per level,
mean ± std over seeds and the change from each run's trained setting, checked against numbers worked
by hand; and the analyses of real (tiny) runs read back."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List

import pytest

from lra.analyze import over_seeds

COLUMNS = ["topk", "cost_per_query", "test_acc", "test_loss", "trained", "examples", "run", "task", "attn",
           "preset", "seed", "data.max_len", "data.pairs"]


def write_analysis(root: Path, run: str, seed: int, pairs: int, accs: Dict[int, float], trained: int) -> None:
    folder = root / run
    folder.mkdir(parents=True)
    with (folder / "budget.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for k, acc in accs.items():
            w.writerow([k, f"k = {k}", acc, 1.0, k == trained, 100, run, "mqar", "topk", "cpu", seed, 128, pairs])


def read(path: Path) -> List[Dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_means_spreads_and_changes_by_hand(tmp_path: Path) -> None:
    # pairs 8: seed 0 trained (k 16) at 0.90, k 32 at 0.96; seed 1 trained at 0.80, k 32 at 0.90
    write_analysis(tmp_path, "p8_s0", 0, 8, {16: 0.90, 32: 0.96}, trained=16)
    write_analysis(tmp_path, "p8_s1", 1, 8, {16: 0.80, 32: 0.90}, trained=16)
    write_analysis(tmp_path, "p32_s0", 0, 32, {16: 0.50, 32: 0.40}, trained=16)
    written = over_seeds.build(tmp_path, tmp_path / "out")
    assert sorted(p.name for p in written) == ["mqar_topk_cpu.csv", "mqar_topk_cpu.md", "mqar_topk_cpu.tex"]
    md = (tmp_path / "out" / "mqar_topk_cpu.md").read_text()
    # one column per number of pairs (N is the same for every run: no column of its own)
    assert "| topk | cost per query | pairs 8 | pairs 32 |" in md
    # k 16: mean of 90 and 80 = 85.0, sample std 7.07; k 32: 93.0 ± 4.2, change (+6 and +10) / 2 = +8.0
    assert "| 16 | k = 16 (trained) | 85.0 ± 7.1 | 50.0 |" in md
    assert "| 32 | k = 32 | 93.0 ± 4.2 (+8.0) | 40.0 (-10.0) |" in md
    records = read(tmp_path / "out" / "mqar_topk_cpu.csv")
    cell = next(r for r in records if r["topk"] == "32" and r["data.pairs"] == "8")
    assert cell["seeds"] == "2" and float(cell["test_acc_mean"]) == 93.0 and float(cell["change_vs_trained_mean"]) == 8.0


def test_a_folder_without_analyses_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert over_seeds.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no budget.csv below it" in err
    assert list(tmp_path.iterdir()) == []


def test_reads_what_lra_analyze_budget_wrote(tiny_runs: dict, tmp_path: Path) -> None:
    from lra.analyze import cli as analyze
    from lra.cli import call

    dest = tmp_path / "budget" / tiny_runs["mita"].name
    assert call("lra-analyze", analyze.main, ["budget", str(tiny_runs["mita"]), "--set", "attn.topk=8,16",
                                              "--out", str(dest), "--quiet"]) == 0
    assert over_seeds.main([str(tmp_path / "budget"), "--out", str(tmp_path / "out")]) == 0
    records = read(tmp_path / "out" / "listops_mita_smoke.csv")
    assert [r["topk"] for r in records] == ["8", "16"] and {r["seeds"] for r in records} == {"1"}
