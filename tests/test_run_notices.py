"""What lra-run says before the work starts: the estimate of a long run (lra/run/estimate.py), the
size of a large data set it generates, and the step a resumed run continues from."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

import lra.run.estimate
import lra.tasks.listops
from conftest import ROOT, TINY_LISTOPS, killed_at_step, load_script
from sweep_helpers import outcome

TINY = ["--attn", "full", "--set", "train.steps=8", "train.eval_every=4", "train.checkpoint_every=3",
        "train.threads=1"]


def test_a_long_run_says_its_estimate_before_generating_its_data(cli: Callable, tmp_path: Path, listops_data: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # every run counts as long here, and every ListOps set as large
    monkeypatch.setattr(lra.run.estimate, "NOTICE_S", 0)
    monkeypatch.setattr(lra.tasks.listops, "NOTICE_MB", 0)
    (tmp_path / "data").mkdir()
    ran = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", tmp_path / "data", "--out", tmp_path / "a")
    assert ran.code == 0, ran.err
    lines = ran.err.splitlines()
    (line,) = [l for l in lines if "estimated" in l]
    assert line.startswith("lra-run: estimated ") and " on this CPU for 8 steps of listops/full (preset smoke): " in line
    assert line.endswith("of evaluation, timed here on rows of the task's shape; --no-estimate skips this")
    # the smoke preset is smaller than the cpu one: no advice to take that
    assert "--preset cpu" not in line
    # the cost before the work: the estimate precedes the generation of the data
    generating = next(i for i, l in enumerate(lines) if l.startswith("lra: generating ListOps"))
    assert lines.index(line) < generating
    quiet = cli("lra-run", *TINY_LISTOPS, *TINY, "--data-dir", listops_data, "--out", tmp_path / "b", "--no-estimate")
    assert quiet.code == 0 and "estimated" not in quiet.err
    # timing the rows changes nothing of the run
    a, b = outcome(tmp_path / "a" / "listops_full_smoke_seed0"), outcome(tmp_path / "b" / "listops_full_smoke_seed0")
    assert a["metrics"] == b["metrics"] and a["best"] == b["best"]
    assert a["record"]["test_acc"] == b["record"]["test_acc"]


@pytest.mark.parametrize("task, preset, advised", [("listops", "paper", True), ("listops", "official", True),
                                                  ("listops", "smoke", False), ("listops", "cpu", False),
                                                  ("mqar", "paper", True), ("mqar", "smoke", False),
                                                  ("text", "paper", False)])
def test_the_cpu_preset_is_advised_only_where_it_is_the_smaller_protocol(task: str, preset: str, advised: bool) -> None:
    from lra.config import resolve

    assert lra.run.estimate.smaller_cpu_preset(resolve(task, "full", preset, [])) is advised


def test_the_estimate_counts_the_steps_evaluations_and_rows_left(monkeypatch: pytest.MonkeyPatch) -> None:
    from lra.config import resolve
    from lra.run.setup import prepare

    cfg = resolve("mqar", "full", "smoke", ["train.steps=100", "train.eval_every=30", "train.eval_batches=3",
                                            "train.test_batches=0"])
    p = prepare(cfg)
    # every timing one second: what is left is counted
    monkeypatch.setattr(lra.run.estimate, "timed", lambda work, device: 1.0)
    est = lra.run.estimate.estimate(p, {"train": 512, "val": 3000, "test": 3000}, done=40, precise=True)
    # steps 41-100; validations after steps 60, 90 and 100, of 3 batches of 8; the whole test split
    assert (est.steps, est.evaluations, est.val_rows, est.test_rows) == (60, 3, 24, 3000)
    assert est.step_s == 1.0 and est.row_s == 1.0 / 8
    assert est.total_s == 60 + (3 * 24 + 3000) / 8


@pytest.mark.parametrize("trained", [None, 3], ids=["whole-run", "first-3-steps"])
def test_the_warm_up_is_not_counted_and_the_estimate_meets_the_real_time(
    tmp_path: Path, listops_data: Path, isolated_registry: None, trained: Optional[int]
) -> None:
    """A backend whose first call at each batch size takes 1.5 s more (a kernel built for a shape) and
    every call 0.25 s: the estimate counts the steps, not the builds, and comes within 30% of the run's
    own time (scripts/estimate_check.py's comparison; one thread, and sleeps that make the steps long,
    keep a busy machine's noise small beside them), the run trained whole or from its first 3 steps
    extrapolated to its 8 (the check's cpu and paper cases)."""
    from attentions import load_attention_module

    load_attention_module(str(ROOT / "tests" / "slow_attention.py"))
    sys.modules["lra_user_attention_slow_attention"].SEEN.clear()
    check = load_script("estimate_check").check
    sets = [*TINY_LISTOPS[TINY_LISTOPS.index("--set") + 1:], "train.steps=8", "train.eval_every=4",
            "train.threads=1", "attn.sleep_s=0.25", "attn.first_s=1.5"]
    row = check("slow", "listops", "smoke", "slow", sets, str(listops_data), tmp_path, trained)
    # validations after steps 4 and 8; the part of 3 steps validates once, after its last
    assert (row["steps"], row["steps_trained"], row["evaluations"]) == (8, trained or 8, 2)
    # a step sleeps 0.5 s (two layers), and the first calls' 1.5 s, scaled to the batch of 8, would make it 12 s
    assert 0.45 < row["estimate_step_s"] < 4, row
    assert abs(row["ratio"] - 1) < 0.3 and abs(row["step_ratio"] - 1) < 0.3, row
