"""lra-sweep on a real single-node SLURM cluster (scripts/slurm_local.sh): a sweep through the SLURM
executor equals the in-process one; a job warned as SLURM warns a pre-empted job checkpoints, is
requeued and ends identical to an uninterrupted run; status follows it through each state.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`scripts/slurm_local.sh install`);
elsewhere these tests skip. CI installs the packages and runs them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Set

import pytest

from conftest import ROOT
from sweep_helpers import executor_flags, outcomes, sweep_flags, wait_until

SCRIPT = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The local cluster, started for these tests and stopped after them; SLURM_CONF set."""
    if os.geteuid() != 0:
        pytest.skip("starting a local SLURM cluster needs root")
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"no SLURM here ({', '.join(missing)} missing): scripts/slurm_local.sh install adds it")
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_LOCAL_DIR": str(folder)}
    started = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(folder / "slurm.conf"))
        yield str(folder / "slurm.conf")
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=60)


def test_a_slurm_sweep_equals_the_in_process_sweep(slurm: str, debug_sweep: Path, listops_data: Path,
                                                   tmp_path: Path, cli: Callable) -> None:
    out = tmp_path / "sw"
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data), "--executor", "slurm", "--cpus-per-run", "1",
              "--time", "30", "--out", out)
    assert ran.code == 0 and "submitted 4 runs to SLURM" in ran.out, ran.err
    # queued or running, nothing is submitted twice
    again = cli("lra-sweep", "run", *sweep_flags(listops_data), "--executor", "slurm", "--out", out)
    assert again.code == 0 and "0 to run" in again.err, again.err
    wait_until(lambda: "4 runs: 4 finished" in cli("lra-sweep", "status", out).out, 600, "the 4 SLURM runs")
    assert outcomes(out) == outcomes(debug_sweep)
    # each job notes its end just after the run's record
    states = lambda: [json.loads(p.read_text()) for p in (out / "sweep" / "state").glob("*.json")]  # noqa: E731
    wait_until(lambda: all(s["status"] == "completed" for s in states()), 60, "the jobs' last state")
    assert all(s["cluster"] == "slurm" for s in states())


def test_a_signalled_job_is_requeued_and_ends_as_an_uninterrupted_run(
    slurm: str, listops_data: Path, tmp_path: Path, cli: Callable
) -> None:
    flags = sweep_flags(listops_data, "full", "0", ["train.steps=300"])
    out, reference = tmp_path / "sw", tmp_path / "reference"
    assert cli("lra-sweep", "run", *flags, "--executor", "slurm", "--time", "60", "--out", out).code == 0
    state_file = next((out / "sweep" / "state").glob("*.json"))
    job = json.loads(state_file.read_text())["job"]
    run_dir = out / "listops_full_smoke_seed0"
    seen: Set[str] = set()

    def status() -> str:
        line = cli("lra-sweep", "status", out).out.splitlines()[0]
        state = re.search(r"\]  (finished|running|pending|failed|diverged) +(\S+)", line)
        seen.add(" ".join(state.groups()) if state else line)
        return line

    wait_until(lambda: (run_dir / "checkpoint.pt").exists(), 300, "a checkpoint", poll=0.05)
    status()
    # what SLURM sends before a time limit, and to a pre-empted job
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    wait_until(lambda: " finished " in status(), 600, "the requeued job", poll=0.3)
    assert {"running step", "pending queued", "finished test"} <= seen, seen
    log = (out / "sweep" / "logs" / f"{json.loads((out / 'sweep' / 'runs.json').read_text())['runs'][0]['key']}.log")
    text = log.read_text()
    # the signal may land in a training step, an evaluation or the test ("stopped by signal at step
    # N", "... in the evaluation after step N", "... in the test"): the run stopped there, requeued
    assert text.count("== lra-run ") == 2
    assert re.search(r"stopped by signal (at step \d+|in the evaluation after step \d+|in the test)", text), text
    assert cli("lra-sweep", "run", *flags, "--executor", "debug", "--out", reference).code == 0
    assert outcomes(out) == outcomes(reference)


def test_a_partition_slurm_does_not_have_is_refused_and_nothing_written(slurm: str, listops_data: Path,
                                                                       tmp_path: Path, cli: Callable) -> None:
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data, "full", "0"), "--executor", "slurm",
              "--partition", "nosuch", "--out", tmp_path / "sw")
    assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1 and "SLURM refused the jobs" in ran.err, ran.err
    assert not (tmp_path / "sw").exists()


def test_one_grid_gives_the_same_records_on_the_slurm_local_and_debug_executors(
    slurm: str, executor_grid: Path, listops_data: Path, tmp_path: Path, cli: Callable
) -> None:
    out = tmp_path / "sw"
    ran = cli("lra-sweep", "run", *executor_flags(listops_data), "--executor", "slurm", "--time", "30", "--out", out)
    assert ran.code == 0 and "submitted 2 runs to SLURM (jobs " in ran.out, ran.err
    wait_until(lambda: "2 runs: 2 finished" in cli("lra-sweep", "status", out).out, 900, "the 2 SLURM runs")
    # the debug executor's records equal the local executor's too (tests/test_sweep.py)
    assert outcomes(out) == outcomes(executor_grid)


def test_one_run_is_one_job(slurm: str, listops_data: Path, tmp_path: Path, cli: Callable) -> None:
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data, "full", "0"), "--executor", "slurm", "--time", "30",
              "--out", tmp_path / "sw")
    assert ran.code == 0 and re.search(r"submitted 1 run to SLURM \(job \d+(_0)?\);", ran.out), ran.out
    wait_until(lambda: "1 run: 1 finished" in cli("lra-sweep", "status", tmp_path / "sw").out, 600, "the SLURM run")


def test_sbatch_without_slurm_conf_names_the_variable(listops_data: Path, tmp_path: Path, cli: Callable,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("sbatch") is None:
        pytest.skip("no sbatch here: scripts/slurm_local.sh install adds it")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("/etc/slurm/slurm.conf exists: sbatch finds a configuration without SLURM_CONF")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    ran = cli("lra-sweep", "run", *sweep_flags(listops_data, "full", "0"), "--executor", "slurm", "--out", tmp_path / "sw")
    assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert "SLURM_CONF is not set: export SLURM_CONF=" in ran.err and not (tmp_path / "sw").exists()
