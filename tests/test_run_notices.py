"""What lra-run says before the work starts: the estimate of a long run (lra/run/estimate.py), the
size of a large data set it generates, and the step a resumed run continues from."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

import lra.run.estimate
import lra.tasks.listops
from conftest import TINY_LISTOPS, killed_at_step
from sweep_helpers import outcome

TINY = ["--attn", "full", "--set", "train.steps=8", "train.eval_every=4", "train.checkpoint_every=3",
        "train.threads=1"]


def test_a_long_run_says_its_estimate_and_the_cpu_preset_first(cli: Callable, tmp_path: Path, listops_data: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # every run counts as long here
    monkeypatch.setattr(lra.run.estimate, "NOTICE_S", 0)
    ran = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", listops_data, "--out", tmp_path / "a")
    assert ran.code == 0, ran.err
    (line,) = [l for l in ran.err.splitlines() if "estimated" in l]
    assert line.startswith("lra-run: estimated ") and " on this CPU for 8 steps of listops/full (preset smoke)" in line
    assert "--preset cpu is the CPU-sized protocol for listops; --no-estimate skips this" in line
    quiet = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", listops_data, "--out", tmp_path / "b", "--no-estimate")
    assert quiet.code == 0 and "estimated" not in quiet.err
    # timing the rows changes nothing of the run
    a, b = outcome(tmp_path / "a" / "listops_full_smoke_seed0"), outcome(tmp_path / "b" / "listops_full_smoke_seed0")
    assert a["metrics"] == b["metrics"] and a["best"] == b["best"]
    assert a["record"]["test_acc"] == b["record"]["test_acc"]


def test_a_short_run_says_nothing_and_the_estimate_scales_with_the_steps(
    cli: Callable, tmp_path: Path, listops_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", listops_data, "--out", tmp_path)
    assert ran.code == 0 and "estimated" not in ran.err
    # a step of this run, scaled by the steps: one second a step makes 100 steps 100 s or more
    monkeypatch.setattr(lra.run.estimate, "step_times", lambda run: (1.0, 0.0))
    from lra.config import resolve
    from lra.run.checkpoint import TrainState

    class Fake:
        cfg = resolve("listops", "full", "smoke", ["train.steps=100"])
        splits = {"val": [0] * 10, "test": [0] * 10}

        class d:
            world_size = 1

    assert lra.run.estimate.run_seconds(Fake(), TrainState(started_at="", step=40)) == 60.0


def test_generating_a_large_set_says_so_with_its_size(cli: Callable, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lra.tasks.listops, "NOTICE_MB", 0)
    (tmp_path / "data").mkdir()
    ran = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", tmp_path / "data", "--out", tmp_path / "runs")
    assert ran.code == 0, ran.err
    lines = ran.err.splitlines()
    assert any(l.startswith("lra: generating ListOps (128 rows, about 1 MB) into ") for l in lines), ran.err


def test_a_resumed_run_says_from_which_step(cli: Callable, tmp_path: Path, listops_data: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    args = [*TINY_LISTOPS, *TINY, "--data-dir", listops_data, "--out", tmp_path]
    with killed_at_step(monkeypatch, 7):
        cli("lra-run", *args)
    ran = cli("lra-run", *args)
    assert ran.code == 0, ran.err
    assert f"lra-run: resumed {tmp_path}/listops_full_smoke_seed0 from step 6 of 8" in ran.err
    assert json.loads((tmp_path / "listops_full_smoke_seed0" / "record.json").read_text())["steps"] == 8
