"""lra-run --init-from (MiTA's swap-in finding) and train.steps=0: the weights really come from the
source, the record says where from, the run's identity includes its source, a resume continues its
own checkpoint, and bad sources are one line, exit 2, nothing written."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from conftest import TINY_LISTOPS, TINY_MITA, killed_at_step
from lra.run.folder import run_name, same_run
from lra.cli import call, run as lra_run
from lra.config import resolve
from lra.run.record import validate_record
from lra.tables.records import load_records

FULL = "listops_full_smoke_seed0"


def lra_run_in(out: Path, tiny_runs: dict, attn: str, *extra: str) -> int:
    argv = [*TINY_LISTOPS, *extra, "--attn", attn, "--data-dir", str(tiny_runs["data"]), "--out", str(out)]
    return call("lra-run", lra_run.main, argv)


def record_of(folder: Path) -> dict:
    return json.loads((folder / "record.json").read_text())


def test_zero_steps_from_the_same_backend_reproduces_the_source(tiny_runs: dict, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """full -> full, train.steps=0: the same weights on the same test rows give the source's test accuracy."""
    capsys.readouterr()
    assert lra_run_in(tmp_path, tiny_runs, "full", "train.steps=0", "--init-from", str(tiny_runs["full"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"lra-run: started from {tiny_runs['full']} (full, test acc {record_of(tiny_runs['full'])['test_acc']:.4f}): " \
                     "32 of 32 tensors loaded; none new"
    assert "no training (train.steps=0)" in out[1]
    folder = tmp_path / f"{FULL}_from-{FULL}"
    record, source = record_of(folder), record_of(tiny_runs["full"])
    validate_record(record)
    assert (record["steps"], record["best_step"], record["config"]["train"]["steps"]) == (0, 0, 0)
    assert record["test_acc"] == source["test_acc"] and record["tokens_per_s"] is None
    assert record["init_from"] == {"run": FULL, "attn": "full", "attn_budget": "N", "attn_options": {},
                                   "test_acc": source["test_acc"], "loaded": 32, "new": []}
    assert record["config"]["init_from"] == str(tiny_runs["full"])
    assert [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()] == [0]


def test_full_to_mita_swap_in_then_fine_tune(tiny_runs: dict, tmp_path: Path) -> None:
    """The swap-in: MiTA on full attention's weights, evaluated as is and after a short fine-tune."""
    for steps in (0, 2):
        assert lra_run_in(tmp_path / f"s{steps}", tiny_runs, "mita", *TINY_MITA, f"train.steps={steps}",
                          "--init-from", str(tiny_runs["full"])) == 0
        record = record_of(tmp_path / f"s{steps}" / f"listops_mita_smoke_seed0_from-{FULL}")
        assert record["attn"] == "mita" and record["steps"] == steps and record["attn_budget"] == "m + k = 16"
        assert record["init_from"]["attn"] == "full" and record["init_from"]["loaded"] == 32
        assert record["test_acc"] is not None


def test_a_backends_own_parameters_stay_new(tiny_runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """full -> linformer: every shared tensor is the source's exactly; Linformer's projections are new."""
    capsys.readouterr()
    assert lra_run_in(tmp_path, tiny_runs, "linformer", "train.steps=0", "--init-from", str(tiny_runs["full"])) == 0
    assert "32 of 36 tensors loaded; 4 new: encoder.blocks.*.attn.E (x2), encoder.blocks.*.attn.F (x2)" in capsys.readouterr().out
    folder = tmp_path / f"listops_linformer_smoke_seed0_from-{FULL}"
    assert record_of(folder)["init_from"]["new"] == [f"encoder.blocks.{i}.attn.{p}" for i in (0, 1) for p in "EF"]
    started = torch.load(folder / "best_model.pt", weights_only=True)
    source = torch.load(tiny_runs["full"] / "best_model.pt", weights_only=True)
    assert all(torch.equal(started[name], tensor) for name, tensor in source.items())


def test_init_from_is_part_of_the_run_identity(tiny_runs: dict) -> None:
    plain = resolve("listops", "mita", "smoke")
    swapped = resolve("listops", "mita", "smoke")
    swapped.init_from = str(tiny_runs["full"])
    assert run_name(plain) == "listops_mita_smoke_seed0"
    assert run_name(swapped) == f"listops_mita_smoke_seed0_from-{FULL}"
    # a config.json without the field (it is optional) is a plain run's
    saved = plain.to_dict()
    del saved["init_from"]
    assert same_run(saved, plain) and not same_run(saved, swapped)


def test_a_resumed_run_continues_its_checkpoint_not_the_source(tiny_runs: dict, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Killed after its step-4 checkpoint and run again, an --init-from run ends as an uninterrupted one:
    the source's weights were applied once, at the fresh start, and not again over the checkpoint."""
    args = ["train.steps=8", "train.checkpoint_every=4", "--init-from", str(tiny_runs["full"])]
    assert lra_run_in(tmp_path / "whole", tiny_runs, "full", *args) == 0
    with killed_at_step(monkeypatch, 5):
        lra_run_in(tmp_path / "killed", tiny_runs, "full", *args)
    folder = tmp_path / "killed" / f"{FULL}_from-{FULL}"
    assert (folder / "checkpoint.pt").exists() and not (folder / "record.json").exists()
    capsys.readouterr()
    assert lra_run_in(tmp_path / "killed", tiny_runs, "full", *args) == 0
    assert "started from" not in capsys.readouterr().out
    whole, resumed = record_of(tmp_path / "whole" / folder.name), record_of(folder)
    keys = ("steps", "best_step", "val_acc", "test_acc", "final_train_loss", "init_from")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}


def test_tables_leave_init_from_runs_out(tiny_runs: dict, tmp_path: Path) -> None:
    assert lra_run_in(tmp_path, tiny_runs, "full", "train.steps=0", "--init-from", str(tiny_runs["full"])) == 0
    records, selection = load_records([tmp_path], include_smoke=True)
    assert records == [] and "started from the weights of listops_full_smoke_seed0 (--init-from)" in selection.notes()[1]


def unfinished(root: Path) -> str:
    """A run folder with a config.json and nothing else: a run that has not finished."""
    (root / "half").mkdir()
    (root / "half" / "config.json").write_text("{}")
    return str(root / "half")


BAD: Dict[str, tuple] = {
    "missing-folder": (lambda root, runs: str(root / "nowhere"), [], "no such run folder"),
    "unfinished": (lambda root, runs: unfinished(root), [], "the run has not finished (no record.json yet); best_model.pt is needed"),
    "other-shape": (lambda root, runs: str(runs["full"]), ["model.dim=32"],
                    "that run's model has another shape (model.dim 16 there, 32 here)"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_source_is_one_line_exit_2_nothing_written(name: str, tiny_runs: dict, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    source, sets, message = BAD[name]
    path = source(tmp_path, tiny_runs)
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    assert lra_run_in(tmp_path / "out", tiny_runs, "mita", *sets, "--init-from", path) == 2
    lines: List[str] = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lra-run: error: --init-from {path}: ") and message in lines[0], lines
    assert sorted(tmp_path.rglob("*")) == before
