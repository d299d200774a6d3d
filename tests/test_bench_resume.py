"""lra-bench resumes an unfinished sweep: the same command on the same --out keeps the points the
stopped sweep measured (whole lengths of an interleaved one) and measures only the rest; a record
of other settings, or not a record, is a one-line error that leaves it as it was."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch

from lra.bench import sweep as bench_sweep
from lra.bench.cli import main as bench_main
from lra.cli import guarded

REAL_CHILD = bench_sweep.run_child
MODEL = ["model", "--task", "text", "--interleaved", "--attn", "full,linear", "--batch", "1", "--repeats", "1",
         "--gemm-size", "0", "--threads", "1", "--quiet", "--no-plot"]
ATTENTION = ["attention", "--attn", "full,linear", "--lengths", "64,128", "--batch", "1", "--heads", "1",
             "--head-dim", "8", "--repeats", "1", "--gemm-size", "0", "--threads", "1", "--quiet", "--no-plot"]


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def stop_after(calls: int, seen: List[Dict[str, Any]]):
    """The real child process for the first ``calls`` points, then a Ctrl-C; every spec run is in ``seen``."""
    def child(spec: Dict[str, Any], workdir: Path) -> Dict[str, Any]:
        if len(seen) == calls:
            raise KeyboardInterrupt
        seen.append(spec)
        return REAL_CHILD(spec, workdir)
    return child


def record_of(out: Path) -> Dict[str, Any]:
    return json.loads((out / "record.json").read_text())


def test_an_interleaved_sweep_resumes_at_the_length_it_stopped_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out, argv = tmp_path / "out", [*MODEL, "--lengths", "64,128"]
    first: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(1, first))
    with pytest.raises(KeyboardInterrupt):
        bench_main([*argv, "--out", str(out)])
    stopped = record_of(out)
    assert stopped["complete"] is False and [(p["backend"], p["length"]) for p in stopped["points"]] == [
        ("full", 64), ("linear", 64)]

    second: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, second))
    assert bench_main([*argv, "--out", str(out)]) == 0
    done = record_of(out)
    # only the length not finished ran again, in one process for both backends
    assert [(spec["length"], spec["backends"]) for spec in second] == [(128, ["full", "linear"])]
    assert done["complete"] is True and [(p["backend"], p["length"], p["status"]) for p in done["points"]] == [
        ("full", 64, "ok"), ("linear", 64, "ok"), ("full", 128, "ok"), ("linear", 128, "ok")]
    # the kept points are the measurements the stopped sweep made, with its start and per-length entry
    assert done["points"][:2] == stopped["points"] and done["per_length"][0] == stopped["per_length"][0]
    assert done["started_at"] == stopped["started_at"]
    assert [r["points_kept"] for r in done["resumed"]] == [2]
    assert "Resumed at" in (out / "table.md").read_text()


def test_a_length_cut_short_is_measured_again_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out, argv = tmp_path / "out", [*MODEL, "--lengths", "64,128"]
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, []))
    assert bench_main([*argv, "--out", str(out)]) == 0
    # as a sweep killed while it saved the points of its last length leaves it
    record = record_of(out)
    record.update(complete=False, points=record["points"][:3])
    (out / "record.json").write_text(json.dumps(record))

    again: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, again))
    assert bench_main([*argv, "--out", str(out)]) == 0
    assert [(spec["length"], spec["backends"]) for spec in again] == [(128, ["full", "linear"])]
    assert len(record_of(out)["points"]) == 4 and record_of(out)["resumed"][0]["points_kept"] == 2


def test_a_separate_sweep_resumes_at_the_point_it_stopped_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(3, first))
    with pytest.raises(KeyboardInterrupt):
        bench_main([*ATTENTION, "--out", str(out)])
    assert len(record_of(out)["points"]) == 3

    second: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, second))
    assert bench_main([*ATTENTION, "--out", str(out)]) == 0
    assert [(spec["backend"], spec["length"]) for spec in second] == [("linear", 128)]
    done = record_of(out)
    assert done["complete"] and [(p["backend"], p["length"]) for p in done["points"]] == [
        ("full", 64), ("linear", 64), ("full", 128), ("linear", 128)]


def test_a_finished_record_is_measured_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, []))
    assert bench_main([*ATTENTION, "--out", str(out)]) == 0
    again: List[Dict[str, Any]] = []
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(99, again))
    assert bench_main([*ATTENTION, "--out", str(out)]) == 0
    assert len(again) == 4 and "resumed" not in record_of(out)


@pytest.mark.parametrize("change, says", [
    (["--lengths", "64,256"], "--lengths"),
    (["--repeats", "2"], "--repeats"),
])
def test_an_unfinished_record_of_other_settings_is_a_one_line_error(
        change: List[str], says: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(bench_sweep, "run_child", stop_after(1, []))
    with pytest.raises(KeyboardInterrupt):
        bench_main([*ATTENTION, "--out", str(out)])
    before = (out / "record.json").read_bytes()
    argv = [*ATTENTION, *change] if change[0] != "--lengths" else [*ATTENTION[:3], *change, *ATTENTION[5:]]
    assert guarded("lra-bench", lambda: bench_main([*argv, "--out", str(out)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "unfinished sweep" in err[0] and "Traceback" not in err[0]
    assert (out / "record.json").read_bytes() == before


@pytest.mark.parametrize("text", ["{not json", "[]", json.dumps({"complete": False, "points": []})])
def test_a_record_json_that_is_not_a_record_is_a_one_line_error(text: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "record.json").write_text(text)
    assert guarded("lra-bench", lambda: bench_main([*ATTENTION, "--out", str(out)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an lra-bench record" in err[0]
    assert (out / "record.json").read_text() == text
