"""lra-table: synthetic records -> accuracy, taxonomy and throughput tables, which records they used (the
efficiency table: test_table_efficiency.py; the plots: test_plots.py)."""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lra.bench import record as bench_record
from lra.tables import cli as tables
from lra.cli import guarded
from table_records import RECORDS, make_record, row, run_table, write_runs

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_attention.py"
FIVE = ("listops", "text", "retrieval", "image", "pathfinder")


# backends a test loads from a file (--attn-module) are forgotten after it
pytestmark = pytest.mark.usefixtures("isolated_registry")


def test_accuracy_mean_std_diverged_and_average(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    out = run_table(tmp_path, "--no-plots")
    md = (out / "accuracy.md").read_text()
    header = row(md, "Model", "Source")
    full = dict(zip(header, row(md, "full", "this suite")))
    mita = dict(zip(header, row(md, "mita", "this suite")))
    # two seeds on ListOps: 30 and 40 -> mean 35, sample std 7.07
    assert full["ListOps"] == "35.00 ± 7.07" and full["Seeds"] == "1–2"
    # the older seed-0 Text record (99%) is superseded by the newer one (60%)
    assert full["Text"] == "60.00"
    assert full["Avg"] == f"{statistics.fmean([35.0, 60.0, 70.0, 40.0, 65.0]):.2f}" and full["Path-X"] == "—"
    assert mita["ListOps"] == "50.00 (1 of 2 diverged)"
    assert mita["Retrieval"] == "diverged" and mita["Avg"] == "—"
    # published rows beside ours; the MiTA paper's per-task numbers are missing, not invented
    published = dict(zip(header, row(md, "MiTA", "Wen et al. 2026")))
    assert published["ListOps"] == "—" and published["Avg"] == "58.91"
    assert dict(zip(header, row(md, "Transformer", "Tay et al. 2021")))["Retrieval"] == "57.46"
    tex = (out / "accuracy.tex").read_text()
    assert r"35.00 $\pm$ 7.07" in tex and "diverged" in tex and r"\bottomrule" in tex


def test_accuracy_csv_is_numeric_and_never_numbers_a_diverged_run(tmp_path: Path) -> None:
    write_runs(tmp_path / "runs", RECORDS)
    out = run_table(tmp_path, "--no-plots")
    rows = list(csv.DictReader(open(out / "accuracy.csv")))
    ours = {(r["model"], r["task"]): r for r in rows if r["source"] == "this suite"}
    assert float(ours[("full", "listops")]["acc_mean"]) == pytest.approx(35.0)
    assert float(ours[("full", "listops")]["acc_std"]) == pytest.approx(statistics.stdev([30.0, 40.0]))
    assert ours[("mita", "retrieval")]["acc_mean"] == "" and ours[("mita", "retrieval")]["diverged"] == "1"
    assert ours[("mita", "avg")]["acc_mean"] == ""


def test_empty_runs_still_give_taxonomy_with_user_backend(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "runs").mkdir()
    out = run_table(tmp_path, "--attn-module", str(EXAMPLE))
    stdout = capsys.readouterr().out
    assert f"no run records in {tmp_path / 'runs'}" in stdout
    assert not (out / "accuracy.md").exists() and not (out / "accuracy_by_task.png").exists()
    md = (out / "taxonomy.md").read_text()
    header = row(md, "Name", "Paper")
    for name in ["full", "linear", "linformer", "moba", "topk", "agent", "mita"]:
        assert dict(zip(header, row(md, name)))["From"] == "built-in"
    mine = dict(zip(header, row(md, "myattn")))
    assert mine["Scaling"] == "none" and mine["Mask"] == "yes" and mine["Budget (N=4096)"] == "N"
    assert mine["From"].endswith("my_attention.py")
    assert dict(zip(header, row(md, "mita")))["Budget (N=4096)"] == "m + k = 128"
    assert "myattn" in (out / "taxonomy.csv").read_text()


def sweep_record(points: List[Dict[str, Any]], **fields: Any) -> Dict[str, Any]:
    """An lra-bench sweep record holding ``points``: every key the reader asks for, then ``fields``."""
    record: Dict[str, Any] = {key: {} for key in bench_record.RECORD_KEYS}
    record.update({"kind": "lra-bench", "level": "attention", "points": points, **fields})
    return record


def test_throughput_table_from_sweep_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "runs").mkdir()
    sweep = tmp_path / "throughput" / "cpu-sweep"
    sweep.mkdir(parents=True)
    points = [
        {"backend": "full", "length": 1024, "status": "ok", "tokens_per_s": {"train": 51200.0}},
        {"backend": "full", "length": 4096, "status": "oom"},
        {"backend": "full", "length": 16384, "status": "oom", "skipped": True},
        {"backend": "mita", "length": 1024, "status": "ok", "tokens_per_s": {"train": 80000.0}},
        {"backend": "mita", "length": 4096, "status": "estimated", "estimated": True, "tokens_per_s": {"train": 70000.0}},
    ]
    (sweep / "record.json").write_text(json.dumps(sweep_record(points, hardware={"gpu": None, "cpu_model": "Test CPU"})))
    (sweep / "unrelated.json").write_text(json.dumps({"no": "points"}))
    md = (run_table(tmp_path) / "throughput.md").read_text()
    assert "Test CPU" in md
    # any other JSON file is left out with lra-bench report's own one-line reason
    assert f"lra-table: skipped {sweep / 'unrelated.json'} is not a lra-bench record" in capsys.readouterr().err
    assert row(md, "full") == ["full", "51.2k", "oom", "(oom)"]
    assert row(md, "mita") == ["mita", "80k", "~70k", "—"]


def test_model_sweep_speedups_sit_beside_the_published_ones(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    sweep = tmp_path / "throughput" / "model-gpu"
    sweep.mkdir(parents=True)
    points = [
        {"backend": "full", "length": 65536, "status": "ok", "tokens_per_s": {"train": 500.0, "forward": 2000.0}},
        {"backend": "mita", "length": 65536, "status": "ok", "tokens_per_s": {"train": 1000.0, "forward": 3000.0}},
        {"backend": "full", "length": 262144, "status": "estimated", "estimated": True,
         "tokens_per_s": {"train": 100.0, "forward": 400.0}},
        {"backend": "mita", "length": 262144, "status": "error"},
    ]
    record = sweep_record(points, level="model", complete=False, hardware={"gpu": "Test GPU"})
    (sweep / "record.json").write_text(json.dumps(record))
    md = (run_table(tmp_path) / "throughput.md").read_text()
    assert "Speedup over full attention, measured and published: model-gpu, Test GPU" in md
    assert row(md, "mita", "training") == ["mita", "training", "2x", "—"]
    assert row(md, "mita", "inference") == ["mita", "inference", "1.5x", "—"]
    # the repo's reference/published_efficiency.csv holds the MiTA paper's 19x and 56x at these lengths
    assert row(md, "mita", "published (mita2026)") == ["mita", "published (mita2026)", "19x", "56x"]
    assert "Incomplete sweep" in md


def test_reference_search_and_missing_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    found, _ = tables.find_reference(None)
    assert found is not None and (found / "published_efficiency.csv").is_file()
    code = guarded("lra-table", lambda: tables.main(["--runs", str(tmp_path), "--reference", str(tmp_path / "nowhere")]))
    assert code == 2 and "no published_lra.csv there" in capsys.readouterr().err
    # no reference anywhere: one line says so, and the tables have our rows only
    monkeypatch.setattr(tables, "package_data", lambda name: tmp_path / "clone" / name)
    write_runs(tmp_path / "runs", RECORDS[:2])
    out = run_table(tmp_path, "--no-plots")
    err = capsys.readouterr().err
    assert "no published numbers found" in err and len(err.strip().splitlines()) == 1
    md = (out / "accuracy.md").read_text()
    assert "Tay et al. 2021" not in md and "| full | this suite" in md


def test_unreadable_record_is_skipped_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_runs(tmp_path / "runs", RECORDS[:1])
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "record.json").write_text("{\"schema\": 1}")
    out = run_table(tmp_path, "--no-plots")
    err = capsys.readouterr().err
    assert "skipped" in err and "broken" in err and "record is missing" in err
    assert "| full | this suite" in (out / "accuracy.md").read_text()


BROKEN_RECORDS = {
    "not-json": "{\"schema\": ",
    "binary": b"\x80\x81\x00\xff",
    "a-list": "[1, 2]",
    "missing-fields": "{\"schema\": 1}",
    "wrong-type": "WRONG_TYPE",
}


def test_each_unreadable_record_is_one_stderr_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_runs(tmp_path / "runs", RECORDS[:1])
    good = json.loads(next((tmp_path / "runs").glob("*/record.json")).read_text())
    for name, content in BROKEN_RECORDS.items():
        (tmp_path / "runs" / name).mkdir()
        if content == "WRONG_TYPE":
            content = json.dumps({**good, "test_acc": "high", "run_name": name})
        path = tmp_path / "runs" / name / "record.json"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    capsys.readouterr()
    out = run_table(tmp_path, "--no-plots")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(BROKEN_RECORDS), err
    for name, line in zip(sorted(BROKEN_RECORDS), err):
        assert line.startswith(f"lra-table: skipped {tmp_path / 'runs' / name / 'record.json'}: "), line
    assert "record test_acc is 'high'; expected a number or null" in "\n".join(err)
    assert "| full | this suite" in (out / "accuracy.md").read_text()


def notes_of(markdown: str) -> str:
    """The note lines under the first table of a Markdown file."""
    return markdown.split("\n\n")[2] if markdown.count("\n\n") >= 2 else ""


def test_tables_name_the_runs_they_used_and_left_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The tables name every run folder they used and every record they left out (smoke, unfinished, older duplicates)."""
    write_runs(tmp_path / "runs", [make_record("listops", "full", 0, 0.30)])
    # the user's folder: a newer run of the same seed, a smoke run, a run without its record yet
    write_runs(tmp_path / "mine", [make_record("listops", "full", 0, 0.45, finished_at="2026-02-01T00:00:00+00:00"),
                                   make_record("listops", "mita", 0, 0.17, preset="smoke")])
    unfinished = tmp_path / "mine" / "listops_topk_cpu_seed0"
    unfinished.mkdir()
    (unfinished / "config.json").write_text("{}")
    # not a run folder (a user's tables beside the runs): not mentioned
    (tmp_path / "mine" / "tables").mkdir()
    out = tmp_path / "tables"
    capsys.readouterr()
    assert tables.main(["--runs", str(tmp_path / "runs"), "--runs", str(tmp_path / "mine"), "--out", str(out), "--no-plots"]) == 0
    err = capsys.readouterr().err.splitlines()
    committed, newer = tmp_path / "runs" / "listops_full_cpu_seed0-0", tmp_path / "mine" / "listops_full_cpu_seed0-0"
    assert err == [
        f"lra-table: skipped {committed / 'record.json'}: older run of the same backend, preset, task and seed as "
        f"{newer / 'record.json'}",
        f"lra-table: skipped {tmp_path / 'mine' / 'listops_mita_smoke_seed0-1' / 'record.json'}: smoke run; --include-smoke shows it",
        f"lra-table: skipped {unfinished}: unfinished: no record.json yet; the same lra-run command resumes it",
    ]
    for stem in ("accuracy", "efficiency"):
        md = (out / f"{stem}.md").read_text()
        assert f"Runs used (1): {newer}." in md
        assert "Left out (3): " in md and "listops_mita_smoke_seed0-1" in md and str(unfinished) in md
    md = (out / "accuracy.md").read_text()
    assert dict(zip(row(md, "Model", "Source"), row(md, "full", "this suite")))["ListOps"] == "45.00"
    assert "| mita | this suite" not in md and "preset smoke" not in md
    # asked for, the smoke run is shown (in its own protocol block)
    assert tables.main(["--runs", str(tmp_path / "mine"), "--out", str(out), "--no-plots", "--include-smoke"]) == 0
    md = (out / "accuracy.md").read_text()
    assert dict(zip(row(md, "Model", "Source"), row(md, "mita", "this suite", "preset smoke")))["ListOps"] == "17.00"
    assert "Runs used (2)" in md


def test_default_runs_folder_is_the_committed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lra-run writes to ./runs; lra-table reads results/runs unless told otherwise."""
    from lra.cli.run import parser as run_parser
    from lra.config import RunConfig

    assert run_parser().get_default("out") == "runs" and RunConfig().out == "runs"
    monkeypatch.chdir(tmp_path)
    write_runs(tmp_path / "runs", [make_record("listops", "mita", 0, 0.5)])
    write_runs(tmp_path / "results" / "runs", [make_record("listops", "full", 0, 0.3)])
    assert tables.main(["--out", "tables", "--no-plots"]) == 0
    md = (tmp_path / "tables" / "accuracy.md").read_text()
    assert "| full | this suite" in md and "| mita | this suite" not in md


def test_taxonomy_budgets_are_the_lra_settings_of_configs_attn() -> None:
    """The taxonomy table gives the LRA budgets of configs/attn (128 keys each), not the classes' defaults
    (Linformer k = 256, Top-k k = 64)."""
    budgets = {r[0]: r[7] for r in tables.taxonomy_table().rows}
    assert budgets["linformer"] == "k = 128" and budgets["topk"] == "k = 128" and budgets["mita"] == "m + k = 128"


def test_differences_from_full_are_marked_by_a_stated_rule(tmp_path: Path) -> None:
    """The significance screen marks the backends that differ from full by more than seed spread and test-split noise allow."""
    accs = {"full": (0.30, 0.31, 0.32), "mita": (0.40, 0.41, 0.42), "topk": (0.34, 0.35, 0.36), "moba": (0.10,),
            "agent": (0.31, 0.31, 0.31)}
    write_runs(tmp_path / "runs", [make_record("listops", attn, seed, acc) for attn, values in accs.items()
                                   for seed, acc in enumerate(values)])
    md = (run_table(tmp_path, "--no-plots") / "accuracy.md").read_text()
    note = next(line for line in md.splitlines() if line.startswith("Differences from full"))
    # mita +10: 2 SE = 2 sqrt(1/3 + 1/3 + 2 * 0.36 * 0.64 / 416 * 100^2) = 6.9; topk +4 is within its 6.8;
    # agent's seeds agree exactly, but the test split alone keeps it unmarked; moba has one seed
    assert "mita on ListOps (cpu) +10.0 points (2 SE 6.9)" in note
    assert "topk" not in note and "agent" not in note and "moba" not in note
    assert "3 backend-task pairs compared" in note
    # one seed each: nothing to compare, no footnote
    write_runs(tmp_path / "one", [make_record("listops", "full", 0, 0.3), make_record("listops", "mita", 0, 0.4)])
    out = tmp_path / "one_tables"
    assert tables.main(["--runs", str(tmp_path / "one"), "--out", str(out), "--no-plots"]) == 0
    assert "Differences from full" not in (out / "accuracy.md").read_text()


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    """`lra-table | head -1`: every file is written, the status is 0, nothing on stderr but the notes."""
    import subprocess
    import sys

    write_runs(tmp_path / "runs", RECORDS[:2])
    command = (f"{sys.executable} -c 'from lra.tables.cli import entry; entry()' --runs {tmp_path / 'runs'} "
               f"--out {tmp_path / 'tables'} --no-plots | head -c 10; exit ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "tables").glob("*.md")) == ["accuracy.md", "efficiency.md", "published.md", "taxonomy.md"]
