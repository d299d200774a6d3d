"""Runs that survive: SIGKILL then resume gives the same record; divergence; torchrun with gloo."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a tiny model on a tiny generated ListOps set, so a run takes seconds
TINY = [
    "--task", "listops", "--attn", "full", "--preset", "smoke", "--quiet",
    "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "model.dropout=0.1",
    "data.max_len=128", "train.steps=30", "train.eval_every=10", "train.checkpoint_every=5",
    "train.log_every=1", "train.threads=1",
]
RUN = [sys.executable, "-c", "from lra.cli.run import entry; entry()"]
METRICS = ("steps", "best_step", "val_acc", "test_acc", "majority_acc", "final_train_loss", "status")


def lra_run(args: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def record(out: Path) -> dict:
    (path,) = out.glob("*/record.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny generated data set and one uninterrupted reference run."""
    root = tmp_path_factory.mktemp("resume")
    proc = lra_run([*TINY, "--out", "ref"], root)
    assert proc.returncode == 0, proc.stderr
    return root


def test_sigkill_then_resume_gives_the_same_record(workdir: Path) -> None:
    out = workdir / "killed"
    child = subprocess.Popen([*RUN, *TINY, "--out", str(out)], cwd=workdir, stderr=subprocess.PIPE, text=True)
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
    proc = lra_run([*TINY, "--out", str(out)], workdir)
    assert proc.returncode == 0, proc.stderr
    ref, resumed = record(workdir / "ref"), record(out)
    assert {k: resumed[k] for k in METRICS} == {k: ref[k] for k in METRICS}
    ref_log = (next((workdir / "ref").glob("*/metrics.jsonl"))).read_text()
    assert next(out.glob("*/metrics.jsonl")).read_text() == ref_log


def test_sigterm_saves_a_checkpoint_and_resume_flag_continues(workdir: Path) -> None:
    out = workdir / "term"
    # long enough that the signal always lands inside the training loop
    args = [*TINY, "--out", str(out), "--set", "train.steps=400"]
    child = subprocess.Popen([*RUN, *args], cwd=workdir, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        logs = list(out.glob("*/metrics.jsonl"))
        if logs and len(logs[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and "continue with the same command" in err
    assert list(out.glob("*/checkpoint.pt")) and not list(out.glob("*/record.json"))
    proc = lra_run([*args, "--resume"], workdir)
    assert proc.returncode == 0, proc.stderr
    resumed = record(out)
    assert resumed["status"] == "completed" and resumed["steps"] == 400
    lines = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    # one loss line per step: the steps after the checkpoint were dropped and logged again
    losses_at = [m["step"] for m in lines if "loss" in m]
    assert losses_at == list(range(1, 401))


def test_a_finished_run_is_never_overwritten(workdir: Path) -> None:
    out = workdir / "twice"
    shutil.copytree(workdir / "ref", out)
    before = record(out)
    proc = lra_run([*TINY, "--out", str(out)], workdir)
    assert proc.returncode == 0, proc.stderr
    folders = sorted(p.parent.name for p in out.glob("*/record.json"))
    assert folders == ["listops_full_smoke_seed0", "listops_full_smoke_seed0-2"]
    assert json.loads((out / folders[0] / "record.json").read_text()) == before


def test_resume_without_a_run_is_an_error(workdir: Path) -> None:
    proc = lra_run([*TINY, "--out", str(workdir / "none"), "--resume"], workdir)
    assert proc.returncode == 2 and "no run folder" in proc.stderr and "Traceback" not in proc.stderr


def test_divergence_stops_with_a_diverged_record(workdir: Path) -> None:
    out = workdir / "diverge"
    proc = lra_run([*TINY, "--out", str(out), "--set", "train.lr=1e12", "train.grad_clip=0.0"], workdir)
    assert proc.returncode == 1
    assert "diverged" in proc.stderr and "Traceback" not in proc.stderr
    rec = record(out)
    assert rec["status"] == "diverged" and rec["test_acc"] is None and "loss became" in rec["message"]
    assert rec["steps"] < 30


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_processes_match_one_process(workdir: Path) -> None:
    """Gloo DDP with the global batch split in two: the loss curve matches one process.

    Dropout is off so both runs compute the same function; the tolerance covers float32
    reduction order (the two halves' gradients are averaged instead of one batch mean).
    """
    args = [*TINY, "--set", "model.dropout=0.0", "train.steps=12", "train.checkpoint_every=0"]
    single = lra_run([*args, "--out", "one"], workdir)
    assert single.returncode == 0, single.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["torchrun", "--nproc_per_node=2", "--master_port=29533", "--no-python", *RUN, *args, "--out", "two"]
    double = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300, env=env)
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = ((workdir / d).glob("*/metrics.jsonl") for d in ("one", "two"))
    logs = [[json.loads(line) for line in next(f).read_text().splitlines()] for f in (one, two)]
    losses = [[m["loss"] for m in log if "loss" in m] for log in logs]
    assert len(losses[0]) == len(losses[1]) == 12
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-4
    rec = record(workdir / "two")
    assert rec["world_size"] == 2 and len([p for p in (workdir / "two").iterdir() if p.is_dir()]) == 1
