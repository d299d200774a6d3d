"""lra-analyze budget and tokens on tiny finished runs: what they print and write, numbers checked
against the run's record and against counts worked by hand, and bad input (one line, exit 2,
nothing written)."""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

from conftest import TINY_LISTOPS
from lra.analyze import cli as analyze
from lra.analyze.tokens import layer_stats, listops_depth, listops_kinds
from lra.cli import call, data as lra_data, run as lra_run
from lra.tasks.listops import TOKEN_ID


def lra_analyze(*argv: str) -> int:
    return call("lra-analyze", analyze.main, list(argv))


def rows(path: Path) -> List[Dict[str, str]]:
    return list(csv.DictReader(path.open()))


@pytest.fixture(scope="module")
def more_runs(tiny_runs: dict) -> dict:
    """Beside the session's full and MiTA runs: a Top-k and a Linformer run on the same data."""
    for attn in ("topk", "linformer"):
        argv = [*TINY_LISTOPS, "train.steps=2", "--attn", attn, "--data-dir", str(tiny_runs["data"]),
                "--out", str(tiny_runs["root"] / "runs")]
        assert call("lra-run", lra_run.main, argv) == 0
    return {**tiny_runs, **{a: tiny_runs["root"] / "runs" / f"listops_{a}_smoke_seed0" for a in ("topk", "linformer")}}


def test_budget_grid_table_and_heat_map(tiny_runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The trained cell reproduces the record's test accuracy: same weights, same test rows."""
    capsys.readouterr()
    assert lra_analyze("budget", str(tiny_runs["mita"]), "--set", "attn.landmarks=4,8", "attn.topk=8,16",
                       "--out", str(tmp_path), "--quiet") == 0
    out = capsys.readouterr().out
    assert "| landmarks \\ topk | 8 | 16 |" in out and "lra-analyze: wrote" in out
    table = rows(tmp_path / "budget.csv")
    assert [(r["landmarks"], r["topk"], r["cost_per_query"]) for r in table] == [
        ("4", "8", "m + k = 12"), ("4", "16", "m + k = 20"), ("8", "8", "m + k = 16"), ("8", "16", "m + k = 24")]
    trained = [r for r in table if r["trained"] == "True"]
    record = json.loads((tiny_runs["mita"] / "record.json").read_text())
    assert len(trained) == 1 and float(trained[0]["test_acc"]) == pytest.approx(record["test_acc"], abs=1e-6)
    assert {r["examples"] for r in table} == {str(record["test_examples"])}
    # the loss beside the accuracy: the markdown cell is the CSV's test_loss
    md = (tmp_path / "budget.md").read_text()
    assert "| cost per query | test acc | test loss | vs trained |" in md
    assert f"| {float(trained[0]['test_loss']):.4f} | trained |" in md
    assert (tmp_path / "budget.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["budget.csv", "budget.md", "budget.png", "budget.tex"]


def test_budget_evaluates_the_trained_setting_beside_a_grid_without_it(more_runs: dict, tmp_path: Path) -> None:
    """Any backend whose options keep its parameters: Top-k's k, trained at 128, over 16 and 32."""
    assert lra_analyze("budget", str(more_runs["topk"]), "--set", "attn.topk=16,32", "--out", str(tmp_path),
                       "--examples", "8", "--quiet") == 0
    table = rows(tmp_path / "budget.csv")
    assert [(r["topk"], r["cost_per_query"], r["trained"]) for r in table] == [
        ("16", "k = 16", "False"), ("32", "k = 32", "False"), ("128", "k = 128", "True")]
    assert {r["examples"] for r in table} == {"8"}
    assert "128 (trained, not in the grid)" in (tmp_path / "budget.md").read_text()


def test_tokens_on_listops(tiny_runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert lra_analyze("tokens", str(tiny_runs["mita"]), "--out", str(tmp_path), "--quiet") == 0
    out = capsys.readouterr().out
    assert "### By token kind" in out and "| [MAX |" in out and "### By nesting depth" in out
    layers = rows(tmp_path / "tokens.csv")
    assert [r["layer"] for r in layers] == ["1", "2"]
    # every example is longer than m = 8 and k = 8: each of its heads makes exactly m x k selections
    from lra.tasks import get_task
    from lra.config import DataConfig

    test = get_task("listops").load(DataConfig(data_dir=str(tiny_runs["data"]), size=64, max_len=128))["test"]
    n = int(layers[0]["examples"])
    assert int(test.lengths[:n].min()) >= 8
    expected = 8 * 8 * n * 2 / (2 * float(test.lengths[:n].sum()))
    for layer in layers:
        assert float(layer["selections_per_token"]) == pytest.approx(expected, rel=1e-5)
        assert 0 < float(layer["never_selected_any_head"]) <= float(layer["never_selected"]) < 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.csv", "tokens.md", "tokens.tex"]


def test_layer_stats_by_hand() -> None:
    """One example of 10 real tokens (2 padded), two heads; counts chosen so every number is plain."""
    counts = torch.tensor([[[5, 1, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0],
                            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]], dtype=torch.int32)  # [1, 2, 12]
    real = torch.arange(12)[None, :] < 10
    stats = layer_stats(counts, real)
    # head 0 leaves 7 of 10 tokens out, head 1 none; tokens 2-8 are left out by head 0 only
    assert stats["never_selected"] == pytest.approx(7 / 20)
    assert stats["never_selected_any_head"] == 0.0
    # the top 10% = 1 position: 5 of head 0's 10 selections, 1 of head 1's 10
    assert stats["top10_share"] == pytest.approx((5 / 10 + 1 / 10) / 2)
    assert stats["selections_per_token"] == pytest.approx(20 / 20)


def test_listops_kinds_and_depth_by_hand() -> None:
    expression = "[MAX 2 [MIN 3 4 ] [SM 1 [MED 5 ] ] ]".split()
    tokens = np.array([[TOKEN_ID[t] for t in expression] + [0, 0]])
    kinds, names = listops_kinds(tokens)
    assert [names[k] for k in kinds[0, :len(expression)]] == [
        "[MAX", "digit", "[MIN", "digit", "digit", "]", "[SM", "digit", "[MED", "digit", "]", "]", "]"]
    assert listops_depth(tokens)[0, :len(expression)].tolist() == [1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 2, 1]


@pytest.fixture(scope="module")
def pathfinder_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny generated Pathfinder set (64 images, the easy level) and a MiTA run smoke-trained on it."""
    root = tmp_path_factory.mktemp("pathfinder")
    data = root / "data"
    assert call("lra-data", lra_data.main, ["generate", "pathfinder32", "--size", "64", "--level", "curv_baseline",
                                            "--data-dir", str(data)]) == 0
    argv = ["--task", "pathfinder", "--attn", "mita", "--preset", "smoke", "--quiet", "--data-dir", str(data),
            "--out", str(root / "runs"), "--set", "data.size=64", "data.level=curv_baseline", "model.dim=16",
            "model.ffn_dim=32", "train.steps=2", "train.eval_every=2", "attn.landmarks=16", "attn.topk=16"]
    assert call("lra-run", lra_run.main, argv) == 0
    return root / "runs" / "pathfinder_mita_smoke_seed0"


def test_tokens_on_pathfinder_draws_the_pixels(pathfinder_run: Path, tmp_path: Path) -> None:
    assert lra_analyze("tokens", str(pathfinder_run), "--out", str(tmp_path), "--show", "2", "--quiet") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tokens.csv", "tokens.md", "tokens.tex", "tokens_examples.png", "tokens_pixels.png"]
    assert "By token kind" not in (tmp_path / "tokens.md").read_text()
    layers = rows(tmp_path / "tokens.csv")
    # 1,024 pixels, 16 landmarks x 16 keys per head: 256 selections over 1,024 tokens
    assert [float(r["selections_per_token"]) for r in layers] == [0.25, 0.25]


def folder_without_weights(root: Path, runs: dict) -> str:
    """A copy of the MiTA run without its best_model.pt (its weights were not kept)."""
    import shutil

    shutil.copytree(runs["mita"], root / "no_weights")
    (root / "no_weights" / "best_model.pt").unlink()
    return str(root / "no_weights")


def unfinished(root: Path, runs: dict) -> str:
    (root / "half").mkdir()
    (root / "half" / "config.json").write_text(json.dumps({"task": "listops"}))
    return str(root / "half")


# name: (command, run folder (from a fixture key, or made in the case's folder), more arguments, message)
BAD = {
    "missing-run-dir": ("budget", lambda r, runs: str(r / "nowhere"), ["--set", "attn.topk=8"],
                        "RUN_DIR {run}: no such run folder"),
    "tokens-missing-run-dir": ("tokens", lambda r, runs: str(r / "nowhere"), [], "RUN_DIR {run}: no such run folder"),
    "unfinished-run": ("budget", unfinished, ["--set", "attn.topk=8"],
                       "RUN_DIR {run}: the run has not finished (no record.json yet); best_model.pt is needed"),
    "no-weights": ("tokens", folder_without_weights, [], "kept no best_model.pt"),
    "changes-parameters": ("budget", lambda r, runs: str(runs["linformer"]), ["--set", "attn.k=32,64"],
                           "attn.k=32 changes the trained parameters of 'linformer' (other shapes: encoder.blocks.0.attn.E"),
    "not-mita": ("tokens", lambda r, runs: str(runs["full"]), [],
                 "tokens needs a backend with routed experts (one whose class has selected_keys: mita); this run's "
                 "backend is 'full'"),
    "set-without-section": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "topk=8"],
                            "--set 'topk=8' must look like attn.OPTION=V1,V2,..."),
    "set-other-section": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "train.lr=0.1"],
                          "(attention options only: the weights are fixed)"),
    "set-empty-value": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "attn.topk=4,,8"], "has an empty value"),
    "set-twice": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "attn.topk=4", "attn.topk=8"],
                  "--set names attn.topk twice"),
    "set-missing": ("budget", lambda r, runs: str(runs["mita"]), [], "--set is required"),
    "set-wrong-type": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "attn.topk=8,many"],
                       "attn.topk=many: attn.topk must be int"),
    "set-unknown-option": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "attn.heads=2"],
                           "unknown option 'heads' for attention 'mita'; valid: landmarks, topk"),
    "too-many-landmarks": ("budget", lambda r, runs: str(runs["mita"]), ["--set", "attn.landmarks=8,512"],
                           "attn.landmarks=512: mita landmarks=512 reaches past a sequence of 128 tokens (max_len): "
                           "clamped to 128, one landmark per token; give budgets within the run's sequence"),
    "examples-0": ("tokens", lambda r, runs: str(runs["mita"]), ["--examples", "0"], "--examples must be 1 to 10,000,000, got 0"),
    "data-dir-missing": ("tokens", lambda r, runs: str(runs["mita"]), ["--data-dir", "nodata"], "--data-dir nodata is not a folder"),
    "bad-flag": ("tokens", lambda r, runs: str(runs["mita"]), ["--bogus"], "unrecognized arguments: --bogus"),
}


def snapshot(*roots: Path) -> Dict[str, str]:
    return {str(p): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.name != ".lock"}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_exit_2_nothing_written(name: str, more_runs: dict, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    command, run_dir, extra, message = BAD[name]
    run = run_dir(tmp_path, more_runs)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path, more_runs["root"] / "runs")
    capsys.readouterr()
    assert lra_analyze(command, run, *extra) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lra-analyze: error: "), lines
    assert message.format(run=run) in lines[0] and "Traceback" not in lines[0], lines
    assert snapshot(tmp_path, more_runs["root"] / "runs") == before
