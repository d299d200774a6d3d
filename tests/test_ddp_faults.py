"""What a cluster does to a DistributedDataParallel run, with 2 gloo processes under torchrun on the
CPU: a worker killed (torchrun ends at once), rank 0 refused before it shares the run folder (the
other rank does not wait for it), SIGTERM to the job and a rerun, and an elastic restart after a
killed worker (``--max-restarts 1``). The last two end with the record and metrics.jsonl of a run
never disturbed. Each case has a time bound."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

from test_kill_anywhere import RUN, TINY, outcome, wait_for

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")

# long enough that a signal sent once the first checkpoint exists lands inside training
STEPS = ("train.steps=60",)
# seconds torchrun may take to end once a worker died or was refused (it takes well under one)
ENDS_WITHIN = 15.0
RUN_FOLDER = "runs/listops_full_smoke_seed0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(folder: Path, data_dir: Path, *flags: str, steps: tuple = STEPS) -> subprocess.Popen:
    """torchrun of 2 processes on a free port (static rendezvous: --standalone's c10d rendezvous fails
    to reconnect gloo after an elastic restart, "Gloo connectFullMesh failed ... Connection refused")."""
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["torchrun", f"--master-port={free_port()}", "--nproc-per-node=2", *flags, "--no-python", *RUN, *TINY, *steps,
           "data.data_dir=" + str(data_dir)]
    return subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(job: subprocess.Popen, within: float) -> str:
    """Wait at most ``within`` seconds for ``job`` to end; its stderr."""
    try:
        _, err = job.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise AssertionError(f"torchrun did not end within {within:.0f} s")
    return err


def workers(job: subprocess.Popen) -> Dict[int, int]:
    """rank -> pid of the worker processes torchrun started (its children with RANK in their environment)."""
    found: Dict[int, int] = {}
    for task in Path(f"/proc/{job.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
            except OSError:
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = int(pid)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> dict:
    """The outcome (test_kill_anywhere.outcome) of the 2-process run never disturbed."""
    folder = tmp_path_factory.mktemp("ddp-ref")
    job = torchrun(folder, listops_data)
    err = finish(job, 300)
    assert job.returncode == 0, err[-3000:]
    return outcome(folder)


def test_a_killed_worker_ends_torchrun_at_once(listops_data: Path, tmp_path: Path) -> None:
    job = torchrun(tmp_path, listops_data, steps=("train.steps=100000",))
    wait_for(tmp_path, f"{RUN_FOLDER}/checkpoint.pt", job)
    ranks = workers(job)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    start = time.monotonic()
    finish(job, ENDS_WITHIN)
    took = time.monotonic() - start
    assert job.returncode != 0 and not alive(ranks[0]), f"torchrun ended {job.returncode} after {took:.1f} s"


def test_rank_0_refused_before_sharing_the_folder_does_not_hang_rank_1(listops_data: Path, tmp_path: Path) -> None:
    run = tmp_path / RUN_FOLDER
    run.mkdir(parents=True)
    # the run folder held by another lra-run (this process, as pid 4242)
    with open(run / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        job = torchrun(tmp_path, listops_data)
        err = finish(job, 120)
    refused = [line for line in err.splitlines() if line.startswith("lra-run: error: ")]
    assert job.returncode != 0 and len(refused) == 1, err[-3000:]
    assert f"{RUN_FOLDER} is in use by another lra-run (pid 4242)" in refused[0]
    # nothing from the workers but that line (torchrun adds its own report of the failure)
    assert not [line for line in err.splitlines() if line.startswith("[rank")], err[-3000:]
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_sigterm_to_the_job_then_a_rerun_ends_identical(reference: dict, listops_data: Path, tmp_path: Path) -> None:
    job = torchrun(tmp_path, listops_data)
    wait_for(tmp_path, f"{RUN_FOLDER}/checkpoint.pt", job)
    job.send_signal(signal.SIGTERM)
    err = finish(job, ENDS_WITHIN)
    assert job.returncode != 0 and not (tmp_path / RUN_FOLDER / "record.json").exists(), err[-3000:]
    assert "stopped by signal at step" in err
    again = torchrun(tmp_path, listops_data)
    err = finish(again, 300)
    assert again.returncode == 0, err[-3000:]
    assert outcome(tmp_path) == reference


def test_an_elastic_restart_after_a_killed_worker_ends_identical(reference: dict, listops_data: Path,
                                                               tmp_path: Path) -> None:
    job = torchrun(tmp_path, listops_data, "--max-restarts=1")
    wait_for(tmp_path, f"{RUN_FOLDER}/checkpoint.pt", job)
    ranks: List[int] = list(workers(job).values())
    os.kill(workers(job)[1], signal.SIGKILL)
    err = finish(job, 300)
    assert job.returncode == 0, err[-3000:]
    # the restart ran new workers, which resumed from the checkpoint
    assert all(not alive(pid) for pid in ranks)
    assert outcome(tmp_path) == reference
