"""scripts/gpu_paper_listops.sh on the CPU (DRY_RUN=1: every step, tiny), the plan that sizes its
runs (scripts/gpu_paper_plan.py), the summary of runs that stopped or never started, and the
time limit of a step (scripts/gpu_steps.sh)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, load_script
from lra.cli import call

BACKENDS = ["full", "linear", "linformer", "moba", "topk", "agent", "mita"]


def status(out: Path) -> dict:
    return {line.split("\t")[0]: line.split("\t")[1] for line in (out / "status.tsv").read_text().splitlines()}


def test_dry_run_runs_every_step(tmp_path: Path) -> None:
    out, data = tmp_path / "out", tmp_path / "data"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "DATA_DIR": str(data), "OMP_NUM_THREADS": "1"}
    ran = subprocess.run(["bash", "scripts/gpu_paper_listops.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    states = status(out)
    # pip is kept off the network in the dry run: its failure is recorded, and the steps after it run
    assert states.pop("flash-attn") == "failed (exit 1)"
    assert states.pop("flash-attn-import").startswith("failed: ModuleNotFoundError")
    assert states.pop("train") == "7 of 7 completed"
    assert states == {name: "ok" for name in ("check", "data-generate", "data-cache", "bench-64k", "profile-listops",
                                              "plan", "table", "profile-64k")}
    assert (out / "gpu.txt").read_text().startswith("no GPU")
    # the device check says why flash-attn's varlen path did not run
    check = json.loads((out / "device-check" / "check.json").read_text())
    assert check["flash_varlen"] == {"status": "SKIP", "why": "flash-attn is not installed (pip install flash-attn)"}
    assert [b["backend"] for b in check["backends"]] == ["full", "mita[torch]"]
    # seven records of the paper preset, with the dry run's values after the plan's protocol
    plan = json.loads((out / "plan.json").read_text())
    assert [p["attn"] for p in plan["runs"]] == BACKENDS and "train.steps=2" in plan["extra_set"]
    for attn in BACKENDS:
        record = json.loads((out / "runs" / f"listops_{attn}_paper_seed0" / "record.json").read_text())
        assert (record["status"], record["preset"], record["steps"]) == ("completed", "paper", 2), attn
        assert record["config"]["data"]["max_len"] == 128 and record["config"]["train"]["eval_batches"] == 1
    bench = json.loads((out / "throughput" / "model-64k" / "record.json").read_text())
    assert [(p["backend"], p["status"]) for p in bench["points"]] == [("full", "ok"), ("mita", "ok")]
    assert bench["settings"]["attn_options"]["mita"]["kernel"] == "triton"
    for folder, backends in (("profile-listops", ["full", "mita"]), ("profile-64k", ["mita"])):
        profile = json.loads((out / folder / "profile.json").read_text())
        assert [p["backend"] for p in profile["points"]] == backends
    accuracy = (out / "tables" / "accuracy.md").read_text()
    assert all(f"| {attn} | this suite | preset paper | 1 |" in accuracy for attn in BACKENDS)
    summary = (out / "summary.md").read_text()
    for attn in BACKENDS:
        assert f"| {attn} | {plan['runs'][0]['protocol']} | completed | 2 of 2 |" in summary


def test_plan_cuts_evaluations_then_steps_alike_for_every_backend(tmp_path: Path) -> None:
    plan = load_script("gpu_paper_plan")
    # full at the paper protocol: 45 s + 6 ms x 2.5 x (5000 + 0.3 x (100 x 62 + 63)), an evaluation
    # batch 0.3 of a step
    paper_s = 45 + 0.006 * 2.5 * (5000 + 0.3 * (100 * 62 + 63))
    assert plan.expected_s("full", 5000, 50, 62) == pytest.approx(paper_s)
    assert plan.protocols(["full"], paper_s + 0.1)[0]["protocol"] == "paper"
    assert plan.protocols(["full"], paper_s - 0.1)[0]["protocol"] == "eval-250"
    # the slowest backend sets the protocol of all
    runs = plan.protocols(["full", "topk"], 250)
    assert [(r["protocol"], r["fits_alone"]) for r in runs] == [("eval-250", "paper"), ("eval-250", "eval-250")]
    runs = plan.protocols(["full", "topk"], 150)
    assert {r["protocol"] for r in runs} == {"steps-2000"}
    assert runs[0]["values"] == {"steps": 2000, "warmup_steps": 400, "eval_every": 100, "eval_batches": 62}
    assert all(r["expected_s"] <= 150 for r in runs)
    # a backend that fits nothing is not run; the others keep theirs
    runs = plan.protocols(["full", "topk"], 60)
    assert [r["protocol"] for r in runs] == ["steps-500", "not run"]
    assert runs[1]["why"].startswith("500 steps need ~") and runs[1]["values"] is None
    assert call("gpu_paper_plan.py", plan.main, ["plan", "--budget-s", "60", "--backends", "full,topk",
                                                  "--extra-set", "train.threads=2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "plan.tsv").read_text().splitlines() == [
        "full\trun\ttrain.steps=500 train.warmup_steps=100 train.eval_every=25 train.eval_batches=62 train.threads=2",
        "topk\tnot run\t"]


def test_report_keeps_a_stopped_run_and_names_the_runs_not_started(tmp_path: Path) -> None:
    plan = load_script("gpu_paper_plan")
    plan.make_plan(["full", "topk", "linear"], 70, tmp_path, 2.5, 45)
    # full stopped at the limit after 400 steps, two evaluations logged; topk did not fit; linear never started
    run = tmp_path / "runs" / "listops_full_paper_seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 200, "val_acc": 0.31}, {"step": 400, "loss": 1.9}, {"step": 400, "val_acc": 0.27}]) + "\n")
    (tmp_path / "train-exit.tsv").write_text("full\t124\n")
    (tmp_path / "status.tsv").write_text("data-generate\tok\t40\tlra-data generate listops\n")
    (tmp_path / "gpu.txt").write_text("NVIDIA H200, 143771 MiB, 570.00\n")
    text = plan.report(tmp_path)
    assert text.startswith("# ListOps, paper protocol, on NVIDIA H200, 143771 MiB, 570.00")
    assert "| full | steps-500 | stopped at its time limit | 400 (partial) | 0.3100 |" in text
    assert "| topk | not run | not run: 500 steps need ~" in text
    assert "| linear | steps-500 | not run: the training step did not start (see status.tsv) |" in text
    assert json.loads((tmp_path / "summary.json").read_text())["runs"][0]["best_val_acc"] == 0.31


@pytest.mark.parametrize("argv, says", [
    (["plan", "--budget-s", "100", "--backends", "full,nope"], "--backends: nope; valid: full, linear"),
    (["plan", "--budget-s", "0"], "--budget-s and --contention must be positive"),
    (["report"], "is not a folder"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture, argv, says) -> None:
    out = tmp_path / "out"
    assert call("gpu_paper_plan.py", load_script("gpu_paper_plan").main, [*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()


def test_a_step_is_stopped_at_its_limit_and_one_without_time_is_not_run(tmp_path: Path) -> None:
    script = f"""
        LOGS={tmp_path} STATUS={tmp_path}/status.tsv
        source scripts/gpu_steps.sh
        step slow 1 sleep 30
        step none 0 true
        step quick 30 "${{LRA[@]}}" lra-data generate nope
        step fine 30 python3 -c 'print(6 * 7)'
    """
    subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [line.split("\t") for line in (tmp_path / "status.tsv").read_text().splitlines()]
    assert [line[:2] for line in lines] == [["slow", "stopped at its limit (1 s)"], ["none", "not run"],
                                            ["quick", "failed (exit 2)"], ["fine", "ok"]]
    assert int(lines[0][2]) < 5 and lines[2][3] == "lra-data generate nope"
    assert "cannot generate 'nope'" in (tmp_path / "quick.log").read_text()
    assert (tmp_path / "fine.log").read_text() == "42\n"
