"""lra-table's published-beside-measured table: every published row once, under the backend whose
``published_as`` names it (or under "(no backend)"), with its protocol and notes."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List

import pytest

from attentions import get_attention, list_attentions
from lra.files import package_data
from table_records import RECORDS, make_record, row, run_table, write_runs

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


def test_each_form_of_a_backend_is_a_row_of_its_own(tmp_path: Path) -> None:
    """Runs of reformer's chunked form (attn.form=chunked) and of its bucket form, same task, preset and
    seed: both are used, each in its own row of the accuracy and published tables, in MQAR's rows too."""
    bucket, chunked = (make_record("listops", "reformer", 0, acc) for acc in (0.20, 0.30))
    bucket["config"] = {"attn_options": {"n_hashes": 2, "chunk_size": 64, "form": "bucket"}}
    chunked["config"] = {"attn_options": {"n_hashes": 2, "chunk_size": 64, "form": "chunked"}}
    chunked["finished_at"] = "2026-01-02T00:00:00+00:00"
    # a record written before the option existed is the default form
    older = make_record("text", "reformer", 0, 0.55)
    older["config"] = {"attn_options": {"n_hashes": 2, "chunk_size": 64}}
    write_runs(tmp_path / "runs", [*RECORDS, bucket, chunked, older])
    out = run_table(tmp_path, "--no-plots")
    md = (out / "accuracy.md").read_text()
    header = row(md, "Model", "Source")
    assert dict(zip(header, row(md, "reformer", "this suite")))["ListOps"] == "20.00"
    assert dict(zip(header, row(md, "reformer", "this suite")))["Text"] == "55.00"
    assert dict(zip(header, row(md, "reformer (chunked)", "this suite")))["ListOps"] == "30.00"
    left_out = next(line for line in md.splitlines() if line.startswith("Left out"))
    assert "reformer" not in left_out
    # the rows follow the registry's order, each form after its backend
    models = [r["model"] for r in csv.DictReader(open(out / "accuracy.csv")) if r["source"] == "this suite"]
    assert models.index("reformer (chunked)") == models.index("reformer") + 3
    published = (out / "published.md").read_text()
    header = row(published, "Mechanism", "Row")
    assert dict(zip(header, row(published, "reformer", "this suite (chunked)")))["ListOps"] == "30.00"
    assert dict(zip(header, row(published, "reformer", "this suite")))["ListOps"] == "20.00"
