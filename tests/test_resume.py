"""Runs that survive: SIGKILL then resume gives the same record; divergence; torchrun with gloo.
The runs that receive a signal, and torchrun's, are processes of their own; every other run is in this
process (conftest.cli)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import lra.machine
import lra.run.train
from lra.run.checkpoint import TrainState, checkpoint_problem
from lra.cli import call, run as lra_run

# a tiny model on the smoke preset's ListOps set (conftest.listops_data), so a run takes a second
TINY = [
    "--task", "listops", "--attn", "full", "--preset", "smoke", "--quiet",
    "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "model.dropout=0.1",
    "data.max_len=128", "train.steps=30", "train.eval_every=10", "train.checkpoint_every=5",
    "train.log_every=1", "train.threads=1",
]
RUN = [sys.executable, "-c", "from lra.cli.run import entry; entry()"]
METRICS = ("steps", "best_step", "val_acc", "test_acc", "majority_acc", "final_train_loss", "status")


def record(out: Path) -> dict:
    (path,) = out.glob("*/record.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> Path:
    """A working folder holding one uninterrupted reference run (in ./ref)."""
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert call("lra-run", lra_run.main, [*TINY, "--data-dir", str(listops_data), "--out", "ref"]) == 0
    return root


@pytest.fixture
def run_in(workdir: Path, listops_data: Path, cli: Callable, monkeypatch: pytest.MonkeyPatch) -> Callable:
    """run_in(*args): lra-run with TINY's data folder, in this process, in ``workdir``."""
    monkeypatch.chdir(workdir)
    return lambda *args: cli("lra-run", *args, "--data-dir", listops_data)


def spawn(args: list, cwd: Path, data: Path) -> subprocess.Popen:
    """lra-run in a process of its own (to receive a signal)."""
    return subprocess.Popen([*RUN, *args, "--data-dir", str(data)], cwd=cwd, stderr=subprocess.PIPE, text=True)


def test_sigkill_then_resume_gives_the_same_record(workdir: Path, listops_data: Path, run_in: Callable) -> None:
    out = workdir / "killed"
    child = spawn([*TINY, "--out", str(out)], workdir, listops_data)
    ckpt = None
    deadline = time.time() + 120
    # kill as soon as the second checkpoint exists (mid-run, between checkpoints)
    while time.time() < deadline and child.poll() is None:
        found = list(out.glob("*/checkpoint.pt"))
        if found and found[0].stat().st_mtime > 0:
            lines = (found[0].parent / "metrics.jsonl").read_text().splitlines()
            if len(lines) >= 12:
                ckpt = found[0]
                break
        time.sleep(0.05)
    assert ckpt is not None, "the run ended before it could be killed"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not list(out.glob("*/record.json"))
    proc = run_in(*TINY, "--out", out)
    assert proc.code == 0, proc.err
    ref, resumed = record(workdir / "ref"), record(out)
    assert {k: resumed[k] for k in METRICS} == {k: ref[k] for k in METRICS}
    ref_log = (next((workdir / "ref").glob("*/metrics.jsonl"))).read_text()
    assert next(out.glob("*/metrics.jsonl")).read_text() == ref_log


def test_sigterm_saves_a_checkpoint_and_resume_flag_continues(workdir: Path, listops_data: Path, run_in: Callable,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = workdir / "term"
    # long enough that the signal always lands inside the training loop (it is sent within 10 ms of
    # step 3's line; the steps after it take about a second)
    steps = 150
    args = [*TINY, "--out", str(out), "--set", f"train.steps={steps}"]
    child = spawn(args, workdir, listops_data)
    deadline = time.time() + 120
    while time.time() < deadline:
        logs = list(out.glob("*/metrics.jsonl"))
        if logs and len(logs[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and "continue with the same command" in err
    assert list(out.glob("*/checkpoint.pt")) and not list(out.glob("*/record.json"))
    # resumed on other code: the record names both (the first process ran this checkout's)
    monkeypatch.setattr(lra.run.train, "git_commit", lambda: "resumed-on")
    proc = run_in(*args, "--resume")
    assert proc.code == 0, proc.err
    resumed = record(out)
    assert resumed["status"] == "completed" and resumed["steps"] == steps
    assert resumed["git_commit"] == f"{lra.machine.git_commit()} -> resumed-on"
    lines = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    # one loss line per step: the steps after the checkpoint were dropped and logged again
    losses_at = [m["step"] for m in lines if "loss" in m]
    assert losses_at == list(range(1, steps + 1))


def test_the_record_names_the_code_the_run_started_from(workdir: Path, run_in: Callable,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # a checkout during the run changes the tree, not the code that runs: the record names the start's
    monkeypatch.setattr(lra.run.train, "git_commit", lambda: "started-on")
    monkeypatch.setattr(lra.machine, "git_commit", lambda: "checked-out-later")
    proc = run_in(*TINY, "--out", workdir / "commit")
    assert proc.code == 0, proc.err
    assert record(workdir / "commit")["git_commit"] == "started-on"


def test_a_checkpoint_written_before_the_commits_field_still_resumes() -> None:
    state = TrainState(started_at="2026-12-01T00:00:00+00:00", step=5).to_dict()
    del state["commits"]
    saved = {"model": {}, "optimizer": {}, "state": state, "rng_cpu": [torch.get_rng_state()], "rng_cuda": None}
    assert checkpoint_problem(saved) == ""
    assert TrainState(**state).commits == []
    del state["step"]
    assert "lacks state step" in checkpoint_problem(saved)


def test_a_finished_run_is_never_overwritten(workdir: Path, run_in: Callable) -> None:
    out = workdir / "twice"
    shutil.copytree(workdir / "ref", out)
    before = record(out)
    proc = run_in(*TINY, "--out", out)
    assert proc.code == 0, proc.err
    folders = sorted(p.parent.name for p in out.glob("*/record.json"))
    assert folders == ["listops_full_smoke_seed0", "listops_full_smoke_seed0-2"]
    assert json.loads((out / folders[0] / "record.json").read_text()) == before


def test_resume_without_a_run_is_an_error(workdir: Path, run_in: Callable) -> None:
    proc = run_in(*TINY, "--out", workdir / "none", "--resume")
    assert proc.code == 2 and "no run folder" in proc.err and "Traceback" not in proc.err
    assert len(proc.err.splitlines()) == 1 and not (workdir / "none").exists()


def test_resume_without_a_run_is_refused_before_the_data_are_made(workdir: Path, cli: Callable) -> None:
    """A --resume with nothing to resume used to generate the task's data first (the paper preset's
    100,000 ListOps rows take minutes) and only then say so."""
    empty = workdir / "no-data-yet"
    empty.mkdir()
    proc = cli("lra-run", *TINY, "--out", workdir / "none", "--resume", "--data-dir", empty)
    assert proc.code == 2 and "no run folder" in proc.err
    assert list(empty.iterdir()) == [], "data were generated for a run that could not start"


def test_divergence_stops_with_a_diverged_record(workdir: Path, run_in: Callable) -> None:
    out = workdir / "diverge"
    proc = run_in(*TINY, "--out", out, "--set", "train.lr=1e12", "train.grad_clip=0.0")
    assert proc.code == 1
    assert "diverged" in proc.err and "Traceback" not in proc.err
    rec = record(out)
    assert rec["status"] == "diverged" and rec["test_acc"] is None and "loss became" in rec["message"]
    assert rec["steps"] < 30


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_processes_match_one_process(workdir: Path, listops_data: Path, run_in: Callable) -> None:
    """Gloo DDP with the global batch split in two: the loss curve matches one process.

    Dropout is off so both runs compute the same function; the tolerance covers float32
    reduction order (the two halves' gradients are averaged instead of one batch mean).
    """
    args = [*TINY, "--set", "model.dropout=0.0", "train.steps=12", "train.checkpoint_every=0"]
    single = run_in(*args, "--out", "one")
    assert single.code == 0, single.err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["torchrun", "--nproc_per_node=2", "--master_port=29533", "--no-python", *RUN, *args, "--out", "two",
           "--data-dir", str(listops_data)]
    double = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300, env=env)
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = ((workdir / d).glob("*/metrics.jsonl") for d in ("one", "two"))
    logs = [[json.loads(line) for line in next(f).read_text().splitlines()] for f in (one, two)]
    losses = [[m["loss"] for m in log if "loss" in m] for log in logs]
    assert len(losses[0]) == len(losses[1]) == 12
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-4
    rec = record(workdir / "two")
    assert rec["world_size"] == 2 and len([p for p in (workdir / "two").iterdir() if p.is_dir()]) == 1
