"""lra-table's published-beside-measured table: every published row once, under the backend whose
``published_as`` names it (or under "(no backend)"), with its protocol and notes."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List

import pytest

from attentions import get_attention, list_attentions
from lra.files import package_data
from table_records import RECORDS, row, run_table, write_runs

pytestmark = pytest.mark.usefixtures("isolated_registry")


def published_rows() -> List[Dict[str, str]]:
    with open(package_data("reference") / "published_lra.csv", newline="") as f:
        return list(csv.DictReader(f))


def owners() -> Dict[str, str]:
    return {model: name for name in reversed(list_attentions()) for model in get_attention(name).published_as}


def test_every_published_row_sits_once_under_its_mechanism(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    out = run_table(tmp_path, "--no-plots")
    long = list(csv.DictReader(open(out / "published.csv")))
    placed = {(r["source"], r["model"]): r["mechanism"] for r in long if r["task"] == "avg" and r["source"] != "this suite"}
    rows = published_rows()
    assert len(placed) == len(rows)
    claimed = owners()
    for r in rows:
        assert placed[(r["source"], r["model"])] == claimed.get(r["model"], "(no backend)"), r["model"]
    # a mechanism the suite lacks keeps its row; full attention's published names sit with our full runs
    assert placed[("mega2023", "Mega")] == "(no backend)"
    assert placed[("tay2021_lra", "Transformer")] == placed[("skyformer2021", "Self-attention")] == "full"
    assert placed[("xformers_lra", "Linformer-seq/4")] == "linformer"
    md = (out / "published.md").read_text()
    header = row(md, "Mechanism", "Row")
    ours = dict(zip(header, row(md, "full", "this suite")))
    assert ours["ListOps"] == "35.00 ± 7.07" and ours["Protocol"].startswith("preset ")


def test_published_rows_carry_their_protocol_and_the_notes_on_their_code(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    out = run_table(tmp_path, "--no-plots")
    md = (out / "published.md").read_text()
    header = row(md, "Mechanism", "Row")
    sky = dict(zip(header, row(md, "linformer", "Linformer", "Chen et al. 2021")))
    assert sky["Protocol"] == "pytorch-2layer-64d" and sky["ListOps"] == "37.45"
    marks = sky["Note"].split()
    notes = {line.split("] ", 1)[0].lstrip("["): line.split("] ", 1)[1] for line in md.splitlines() if line.startswith("[")}
    texts = [notes[m.strip("[]")] for m in marks]
    assert any("never trained" in t for t in texts) and any(t.startswith("pytorch-2layer-64d") for t in texts)
    # a row with no code note still names its protocol
    tay = dict(zip(header, row(md, "full", "Transformer", "Tay et al. 2021")))
    assert [notes[m.strip("[]")] for m in tay["Note"].split()][0].startswith("jax-official")


def test_without_runs_the_published_rows_are_still_grouped(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    out = run_table(tmp_path, "--no-plots")
    long = list(csv.DictReader(open(out / "published.csv")))
    assert long and all(r["source"] != "this suite" for r in long)
