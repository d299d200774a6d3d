"""Tuning in lra-sweep and lra-table: the grid at the first seed, each cell's choice by validation
accuracy (ties: the smaller value), the other seeds at the choice, the records saying so, and the
tables reporting each cell at its chosen point with every grid point beside it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from lra.sweep import spec as specs
from lra.tuning import Grid, choose, make_grid, point_of
from lra.tables.tuning import value_text

SWEEP = [sys.executable, "-c", "from lra.sweep.cli import entry; entry()"]
# MQAR's smoke set with a one-layer model of width 16: a run takes about a second
TINY = ["model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "train.steps=12", "train.eval_every=6",
        "train.threads=1"]
LRS = [0.001, 0.003, 0.01]


def tuned_flags(attn: str = "full,linear", seeds: str = "0,1,2") -> List[str]:
    return ["--task", "mqar", "--attn", attn, "--seeds", seeds, "--preset", "smoke", "--set", *TINY,
            "--tune", "train.lr=1e-3,3e-3,1e-2", "--quiet"]


def records(out: Path) -> List[Dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/record.json"))]


@pytest.fixture(scope="module")
def tuned_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tuned") / "sw"
    proc = subprocess.run([*SWEEP, "run", *tuned_flags(), "--executor", "debug", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("scores, chosen", [
    ({(1e-3,): 0.5, (3e-3,): 0.7, (1e-2,): 0.6}, (3e-3,)),
    ({(1e-2,): 0.7, (1e-3,): 0.7, (3e-3,): 0.2}, (1e-3,)),
    ({(1e-3,): None, (3e-3,): 0.1, (1e-2,): None}, (3e-3,)),
    ({(3e-3,): None, (1e-3,): None}, (1e-3,)),
    ({(64, "a"): 0.9, (16, "b"): 0.9, (16, "a"): 0.9}, (16, "a")),
], ids=["best", "tie-smaller", "diverged-never-wins", "none-scored-smallest", "two-keys"])
def test_choose_takes_the_best_score_and_breaks_ties_toward_the_smaller_point(scores: Dict, chosen: tuple) -> None:
    assert choose(scores) == chosen


def test_a_grid_reads_its_values_one_way_and_finds_a_saved_config_on_it() -> None:
    grid = make_grid("--tune", {"train.lr": ["3e-4", "1.0e-3", 0.01]}, "val_acc", 0)
    assert grid.points() == [(0.0003,), (0.001,), (0.01,)]
    assert grid.sets((0.001,)) == ["train.lr=0.001"]
    assert point_of({"train": {"lr": 1e-3}}, grid) == (0.001,)
    assert point_of({"train": {"lr": 2e-3}}, grid) is None
    assert point_of({"attn_options": {"topk": 16}}, make_grid("x", {"attn.topk": [8, 16]}, "val_acc", 0)) == (16,)
    assert Grid.from_block(grid.block()) == grid
    assert [value_text(v) for v in (3e-4, 1e-3, 0.05, 64, 1e-2)] == ["3e-4", "1e-3", "0.05", "64", "1e-2"]


def test_the_dry_run_lists_the_grid_then_each_cells_seeds_to_be_chosen(cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-sweep", "run", *tuned_flags(), "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 0, ran.err
    *lines, total = ran.out.strip().splitlines()
    grid = [line for line in lines if "--seed 0 " in line]
    waiting = [line for line in lines if "train.lr=<chosen>" in line]
    assert len(grid) == 2 * 3 and len(waiting) == 2 * 2 and len(lines) == 10
    assert all("--tuning '{\"grid\": {\"train.lr\": [0.001, 0.003, 0.01]}" in line for line in grid)
    assert total.startswith("10 runs: 6 on the tuning grid (train.lr over 0.001, 0.003, 0.01 at seed 0")
    assert "4 at each cell's chosen values (seeds 1, 2; 4 still to be chosen)" in total
    assert not (tmp_path / "sw").exists()


def test_the_sweep_runs_each_cells_other_seeds_at_the_point_its_grid_chose(tuned_sweep: Path) -> None:
    found = records(tuned_sweep)
    assert len(found) == 2 * (3 + 2)
    for attn in ("full", "linear"):
        grid = {r["config"]["train"]["lr"]: r for r in found if r["attn"] == attn and r["seed"] == 0}
        assert sorted(grid) == LRS
        best = max(r["val_acc"] for r in grid.values())
        expected = min(lr for lr, r in grid.items() if r["val_acc"] == best)
        others = [r for r in found if r["attn"] == attn and r["seed"] != 0]
        assert sorted(r["seed"] for r in others) == [1, 2]
        for record in others:
            assert record["config"]["train"]["lr"] == expected
            block = record["config"]["tuning"]
            assert block["chosen"] == {"train.lr": expected} and block["select"] == "val_acc" and block["seed"] == 0
            assert {s[0]["train.lr"]: s[1] for s in block["scores"]} == {lr: r["val_acc"] for lr, r in grid.items()}
        assert all(r["config"]["tuning"] == {"grid": {"train.lr": LRS}, "select": "val_acc", "seed": 0}
                   for r in grid.values())


def test_status_shows_the_grid_each_point_and_the_choice(tuned_sweep: Path, cli: Callable) -> None:
    ran = cli("lra-sweep", "status", tuned_sweep)
    assert ran.code == 0, ran.err
    lines = ran.out.strip().splitlines()
    assert "10 runs: 10 finished" in lines
    assert lines[lines.index("10 runs: 10 finished") + 1].startswith("tuning: train.lr over 0.001, 0.003, 0.01 at seed 0")
    chosen = {r["attn"]: r["config"]["train"]["lr"] for r in records(tuned_sweep) if r["seed"] == 1}
    section = lines[lines.index("10 runs: 10 finished") + 2:]
    for attn in ("full", "linear"):
        line = next(line for line in section if line.strip().startswith(f"mqar_{attn}_smoke"))
        assert line.endswith(f"train.lr={chosen[attn]!r}")
    assert lines[-1].strip() == "2 of 2 cells chosen; seeds 1, 2 run at each cell's choice once its grid has finished (0 runs waiting)"


def test_a_finished_tuned_sweep_run_again_runs_nothing(tuned_sweep: Path, cli: Callable) -> None:
    stamps = {p: p.stat().st_mtime_ns for p in tuned_sweep.glob("*/record.json")}
    ran = cli("lra-sweep", "run", *tuned_flags(), "--executor", "debug", "--out", tuned_sweep)
    assert ran.code == 0 and "0 to run (10 finished left as they are)" in ran.err
    assert {p: p.stat().st_mtime_ns for p in tuned_sweep.glob("*/record.json")} == stamps


def test_the_tables_report_the_chosen_point_and_list_every_grid_point(tuned_sweep: Path, cli: Callable,
                                                                       tmp_path: Path) -> None:
    ran = cli("lra-table", "--runs", tuned_sweep, "--include-smoke", "--out", tmp_path / "t", "--no-plots")
    assert ran.code == 0, ran.err
    chosen = {r["attn"]: r["config"]["train"]["lr"] for r in records(tuned_sweep) if r["seed"] == 1}
    recall = (tmp_path / "t" / "recall.md").read_text()
    assert "| Seeds | train.lr chosen (4 pairs) | 4 pairs |" in recall
    for attn in ("full", "linear"):
        row = next(line for line in recall.splitlines() if line.startswith(f"| {attn} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[7] == "3" and cells[8] == value_text(chosen[attn])
        accs = [100 * r["test_acc"] for r in records(tuned_sweep) if r["attn"] == attn
                and r["config"]["train"]["lr"] == chosen[attn]]
        assert len(accs) == 3 and cells[9].startswith(f"{sum(accs) / 3:.2f} ±")
    tuning = (tmp_path / "t" / "tuning.md").read_text()
    assert "| Model | Task | Level | Protocol | 1e-3 | 3e-3 | 1e-2 | Chosen | Test at chosen, mean ± std | Seeds |" in tuning
    grid = {(r["attn"], r["config"]["train"]["lr"]): r for r in records(tuned_sweep) if r["seed"] == 0}
    for attn in ("full", "linear"):
        row = next(line for line in tuning.splitlines() if line.startswith(f"| {attn} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[4:7] == [f"{100 * grid[(attn, lr)]['val_acc']:.1f} / {100 * grid[(attn, lr)]['test_acc']:.1f}"
                              for lr in LRS]
        assert cells[7] == f"train.lr {value_text(chosen[attn])}" and cells[9] == "3"


def test_an_untuned_run_of_a_grid_points_values_is_that_grid_point(tuned_sweep: Path, cli: Callable,
                                                                 tmp_path: Path) -> None:
    """A run made outside the sweep (no tuning in its config) at a grid point's values counts as that point:
    the sweep leaves it alone and the tables read it as the point's run."""
    out = tmp_path / "sw"
    shutil.copytree(tuned_sweep, out)
    folder = next(p for p in out.glob("*full*seed0*") if json.loads((p / "config.json").read_text())["train"]["lr"] == 0.001)
    for name in ("config.json", "record.json"):
        data = json.loads((folder / name).read_text())
        config = data if name == "config.json" else data["config"]
        config.pop("tuning")
        (folder / name).write_text(json.dumps(data))
    ran = cli("lra-sweep", "run", *tuned_flags(), "--executor", "debug", "--out", out)
    assert ran.code == 0 and "0 to run (10 finished left as they are)" in ran.err
    ran = cli("lra-table", "--runs", out, "--include-smoke", "--out", tmp_path / "t", "--no-plots")
    assert ran.code == 0, ran.err
    row = next(line for line in (tmp_path / "t" / "tuning.md").read_text().splitlines() if line.startswith("| full |"))
    assert "—" not in row.split("|")[5]


def test_a_tuned_cells_runs_off_the_chosen_point_are_left_out_saying_why(tuned_sweep: Path, cli: Callable,
                                                                        tmp_path: Path) -> None:
    out = tmp_path / "sw"
    shutil.copytree(tuned_sweep, out)
    chosen = next(r["config"]["train"]["lr"] for r in records(out) if r["attn"] == "full" and r["seed"] == 1)
    other = next(lr for lr in LRS if lr != chosen)
    ran = cli("lra-run", "--task", "mqar", "--attn", "full", "--preset", "smoke", "--seed", "1", "--out", out, "--quiet",
              "--set", *TINY, f"train.lr={other}")
    assert ran.code == 0, ran.err
    ran = cli("lra-table", "--runs", out, "--include-smoke", "--out", tmp_path / "t", "--no-plots")
    assert ran.code == 0
    assert f"off its cell's chosen point (train.lr={value_text(chosen)})" in ran.err


def test_the_local_executor_queues_each_cells_seeds_as_its_grid_finishes(tuned_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "sw"
    proc = subprocess.run([*SWEEP, "run", *tuned_flags(attn="full"), "--executor", "local", "--parallel", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 runs: 5 finished" in proc.stdout
    assert "3 to run; 2 wait for their cell's tuning grid" in proc.stderr
    # one thread a run, as in the debug sweep: the same choice and the same numbers
    ours = {(r["seed"], r["config"]["train"]["lr"]): r["test_acc"] for r in records(out)}
    debug = {(r["seed"], r["config"]["train"]["lr"]): r["test_acc"] for r in records(tuned_sweep) if r["attn"] == "full"}
    assert ours == debug


def bad_specs() -> List[tuple]:
    return [
        (["--set", "train.lr=1e-3"], "train.lr is both tuned and a set axis"),
        (["--select", "test_acc"], "select 'test_acc' is not a criterion; valid: val_acc"),
        (["--tune", "train.lr"], "--tune 'train.lr' must look like section.key=value"),
        (["--tune", "train.lr=1e-3,1e-3"], "names a value twice"),
    ]


@pytest.mark.parametrize("case", range(len(bad_specs())), ids=["tuned-and-axis", "select-test", "tune-no-values",
                                                               "tune-twice"])
def test_bad_tuning_input_is_one_line_exit_2_and_nothing_written(case: int, cli: Callable, tmp_path: Path) -> None:
    extra, message = bad_specs()[case]
    flags = ["--task", "mqar", "--attn", "full", "--seeds", "0,1", "--preset", "smoke", "--tune", "train.lr=1e-3,3e-3"]
    if extra[0] == "--tune":
        flags = flags[:-2]
    ran = cli("lra-sweep", "run", *flags, *extra, "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 2 and message in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err
    assert not (tmp_path / "sw").exists()


def test_select_without_tune_and_a_bad_tuning_json_are_refused(cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-sweep", "run", "--task", "mqar", "--attn", "full", "--select", "val_acc", "--out", tmp_path / "sw")
    assert ran.code == 2 and "--select chooses among tuned values" in ran.err
    ran = cli("lra-run", "--task", "mqar", "--attn", "full", "--preset", "smoke", "--out", tmp_path / "r",
              "--tuning", "{\"grid\": 3}")
    assert ran.code == 2 and "tuning.grid must map section.key" in ran.err and not (tmp_path / "r").exists()


def test_a_yaml_attn_item_with_values_of_its_own_is_a_row_of_its_own(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("task: mqar\nattn: [mita, {mita: {attn.dwc: true}}]\npreset: smoke\nseeds: [0, 1]\n"
                    "tune: {train.lr: [1.0e-3, 3.0e-3]}\n")
    parsed = specs.from_yaml(str(spec))
    assert [b.to_yaml() for b in parsed.attns] == ["mita", {"mita": {"attn.dwc": "true"}}]
    runs = parsed.runs()
    assert len(runs) == 4 and len({parsed.cell(r) for r in runs}) == 2
    assert [r.sets for r in runs][2:] == [("attn.dwc=true", "train.lr=0.001"), ("attn.dwc=true", "train.lr=0.003")]
    assert specs.from_yaml(str(spec)).to_dict() == parsed.to_dict()
    spec.write_text("task: mqar\nattn: [{mita: {attn.dwc: true}}]\npreset: smoke\ntune: {attn.dwc: [true, false]}\n")
    with pytest.raises(specs.UserError, match="attn.dwc is both tuned and one of mita's own values"):
        specs.from_yaml(str(spec))
