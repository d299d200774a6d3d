"""A run killed at any moment and run again ends with the files of a run never killed.

In-process kills: an exception no code catches (as SIGKILL runs no handler) raised at one chosen
moment: before any step, evaluation, file write or log line, in the middle of a write (the partial
file or line a kill leaves), or after it. The named edges (before the first checkpoint, between a
checkpoint and a log line, during an evaluation, inside a write) and seeded random moments, some
killed twice. Then real SIGKILLs at seeded random times, and two runs started at once.
"""
from __future__ import annotations

import fcntl
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

import lra.run.checkpoint
import lra.run.folder
import lra.run.loop
import lra.run.train
from conftest import Killed
from lra.cli import run as lra_run

# timings and process measurements (the machine's load too): the only record fields a kill may change
TIMINGS = ("train_time_s", "eval_time_s", "tokens_per_s", "peak_memory_mb", "started_at", "finished_at", "load_average", "matmul_gflops")
# checkpoints at 4, 8, ...; loss lines at 3, 6, ... (so a checkpoint falls inside a loss window);
# evaluations at 7, 14 and 20
TINY = [
    "--task", "listops", "--attn", "full", "--preset", "smoke", "--quiet", "--out", "runs",
    "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "model.dropout=0.1", "data.max_len=128",
    "train.steps=20", "train.eval_every=7", "train.checkpoint_every=4", "train.log_every=3", "train.threads=1",
]
RUN = [sys.executable, "-c", "from lra.cli.run import entry; entry()"]


# one moment: (what is happening, "before" | "mid" | "after")
Moment = Tuple[str, str]


class Killer:
    """Counts the moments of a run and kills it at moment number ``at`` (1-based; 0 = never)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.seen: List[Moment] = []

    def moment(self, what: str, when: str, partial: Optional[Callable[[], None]] = None) -> None:
        self.seen.append((what, when))
        if len(self.seen) == self.at:
            if partial is not None:
                partial()
            raise Killed(f"killed {when} {what}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        lr_at, evaluate = lra.run.loop.lr_at, lra.run.loop.evaluate
        save, append = lra.run.checkpoint.save_checkpoint, lra.run.folder.append_metric
        write_json = lra.run.train.write_json_atomic

        def step(step: int, cfg: object) -> float:
            self.moment(f"step {step + 1}", "before")
            return lr_at(step, cfg)

        def evaluation(*args: object, **kwargs: object) -> object:
            self.moment("evaluation", "before")
            return evaluate(*args, **kwargs)

        def atomic(write: Callable[..., None]) -> Callable[..., None]:
            def wrapped(path: Path, data: object, *advice: str) -> None:
                # a kill inside an atomic write leaves its partial temporary file
                leave = lambda: (path.parent / f".{path.name}.kIlLeD").write_bytes(b"\x80partial")  # noqa: E731
                self.moment(path.name, "before")
                self.moment(path.name, "mid", leave)
                write(path, data, *advice)
                self.moment(path.name, "after")
            return wrapped

        def line(log: object, row: Dict[str, object]) -> None:
            text = (json.dumps(row) + "\n").encode()
            cut = lambda: (log.write(text[: len(text) // 2]), log.flush())  # noqa: E731
            self.moment("metrics line", "before")
            self.moment("metrics line", "mid", cut)
            append(log, row)
            self.moment("metrics line", "after")

        monkeypatch.setattr(lra.run.loop, "lr_at", step)
        # evaluations: the validations of the loop and the final test
        monkeypatch.setattr(lra.run.loop, "evaluate", evaluation)
        monkeypatch.setattr(lra.run.train, "evaluate", evaluation)
        monkeypatch.setattr(lra.run.checkpoint, "save_checkpoint", atomic(save))
        monkeypatch.setattr(lra.run.folder, "write_json_atomic", atomic(lra.run.folder.write_json_atomic))
        monkeypatch.setattr(lra.run.train, "write_json_atomic", atomic(write_json))
        monkeypatch.setattr(lra.run.folder, "append_metric", line)


def run_in(folder: Path, monkeypatch: pytest.MonkeyPatch, killer: Killer, extra: Tuple[str, ...] = ()) -> bool:
    """One lra-run in ``folder``; True if it was killed."""
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    with monkeypatch.context() as patch:
        killer.install(patch)
        try:
            assert lra_run.main([*TINY, *extra]) == 0
        except Killed:
            return True
    return False


def outcome(folder: Path) -> dict:
    """What must not depend on kills: the record without timings, the log, the best weights, the file names."""
    (run,) = [p for p in (folder / "runs").iterdir() if p.is_dir()]
    record = json.loads((run / "record.json").read_text())
    best = torch.load(run / "best_model.pt", weights_only=True)
    return {
        "record": {k: v for k, v in record.items() if k not in TIMINGS},
        "metrics": (run / "metrics.jsonl").read_bytes(),
        "best": {k: v.tolist() for k, v in best.items()},
        "files": sorted(p.name for p in run.iterdir()),
    }


@pytest.fixture(scope="module")
def data_dir(listops_data: Path) -> Path:
    """The session's smoke ListOps set (conftest.listops_data); torch's thread count is restored after
    each test by conftest.torch_threads (train.threads=1 would outlive an in-process run)."""
    return listops_data


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Tuple[dict, List[Moment]]:
    """The uninterrupted run's outcome, and every moment it went through."""
    folder = tmp_path_factory.mktemp("kill-ref")
    killer = Killer()
    with pytest.MonkeyPatch.context() as patch:
        assert not run_in(folder, patch, killer, ("data.data_dir=" + str(data_dir),))
    return outcome(folder), killer.seen


def kill_and_rerun(folder: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path, kills: List[int]) -> None:
    """Kill at each of ``kills`` in turn (each counted in its own run), then run to the end."""
    extra = ("data.data_dir=" + str(data_dir),)
    for at in kills:
        killer = Killer(at)
        assert run_in(folder, monkeypatch, killer, extra), f"the run ended before moment {at} ({len(killer.seen)})"
        # SIGKILL drops the lock with the process; here the trainer's exit did
        lock = folder / "runs" / next(p.name for p in (folder / "runs").iterdir() if p.is_dir()) / ".lock"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if list((folder / "runs").glob("*/record.json")):
            # killed after its record: the run had finished; the same command would start a new one
            return
    assert not run_in(folder, monkeypatch, Killer(), extra)


def first(seen: List[Moment], what: str, when: str, after: int = 0) -> int:
    """1-based index of the first moment ``(what, when)`` after moment ``after``."""
    return next(i + 1 for i, m in enumerate(seen) if i >= after and m == (what, when))


def named_edges(seen: List[Moment]) -> Dict[str, List[int]]:
    first_save = first(seen, "checkpoint.pt", "after")
    last_eval = max(i + 1 for i, m in enumerate(seen) if m[0] == "evaluation")
    return {
        "before-the-first-checkpoint": [first(seen, "checkpoint.pt", "before")],
        "after-a-loss-line-before-the-first-checkpoint": [first(seen, "metrics line", "after")],
        "between-a-checkpoint-and-the-next-loss-line": [first_save],
        "mid-checkpoint-write": [first(seen, "checkpoint.pt", "mid", first_save)],
        "during-evaluation": [first(seen, "evaluation", "before")],
        "mid-metrics-line": [first(seen, "metrics line", "mid", first_save)],
        "mid-config-write": [first(seen, "config.json", "mid")],
        "during-the-final-test": [last_eval],
        "between-best-model-and-record": [first(seen, "record.json", "before")],
        "mid-record-write": [first(seen, "record.json", "mid")],
        "after-the-record": [first(seen, "record.json", "after")],
        "twice-between-checkpoints": [first_save + 3, 6],
    }


def random_kills(seen: List[Moment], count: int, seed: int = 14) -> Dict[str, List[int]]:
    """``count`` seeded random moments; every third case is killed a second time after resuming."""
    rng = random.Random(seed)
    cases = {}
    for i in range(count):
        kills = [rng.randint(1, len(seen))]
        if i % 3 == 2:
            kills.append(rng.randint(1, 12))
        cases[f"random-{i}-at-" + "-".join(map(str, kills))] = kills
    return cases


EDGE_NAMES = [
    "before-the-first-checkpoint", "after-a-loss-line-before-the-first-checkpoint",
    "between-a-checkpoint-and-the-next-loss-line", "mid-checkpoint-write", "during-evaluation", "mid-metrics-line",
    "mid-config-write", "during-the-final-test", "between-best-model-and-record", "mid-record-write",
    "after-the-record", "twice-between-checkpoints",
]
RANDOM_CASES = 12


@pytest.mark.parametrize("edge", EDGE_NAMES)
def test_killed_at_a_named_edge_ends_identical(edge: str, reference: Tuple[dict, List[Moment]], data_dir: Path,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, seen = reference
    kill_and_rerun(tmp_path, monkeypatch, data_dir, named_edges(seen)[edge])
    got = outcome(tmp_path)
    if edge == "after-the-record":
        # finished, then killed before its checkpoint was removed: the only difference is that file
        assert got["files"] == sorted([*ref["files"], "checkpoint.pt"])
        got["files"] = ref["files"]
    assert got == ref


@pytest.mark.parametrize("case", range(RANDOM_CASES))
def test_killed_at_random_moments_ends_identical(case: int, reference: Tuple[dict, List[Moment]], data_dir: Path,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, seen = reference
    (kills,) = [k for name, k in random_kills(seen, RANDOM_CASES).items() if name.startswith(f"random-{case}-")]
    kill_and_rerun(tmp_path, monkeypatch, data_dir, kills)
    got = outcome(tmp_path)
    if ("record.json", "after") in seen[: kills[0]]:
        # finished, then killed before its checkpoint was removed
        got["files"] = [f for f in got["files"] if f != "checkpoint.pt"]
    assert got == ref


def test_resume_with_out_written_with_a_trailing_slash(reference: Tuple[dict, List[Moment]], data_dir: Path,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out DIR/ --resume` (a trailing slash) resumes the run in DIR, whose config is the same."""
    ref, seen = reference
    extra = ("data.data_dir=" + str(data_dir),)
    assert run_in(tmp_path, monkeypatch, Killer(first(seen, "step 10", "before")), extra)
    assert not run_in(tmp_path, monkeypatch, Killer(), (*extra, "--out", "runs/", "--resume"))
    assert outcome(tmp_path) == ref


# the SIGKILL and two-runs cases run longer, so that a kill at a random time lands inside training
LONGER = ("train.steps=120",)


def spawn(folder: Path, data_dir: Path, extra: Tuple[str, ...]) -> subprocess.Popen:
    folder.mkdir(exist_ok=True)
    args = [*TINY, *extra, "data.data_dir=" + str(data_dir)]
    return subprocess.Popen([*RUN, *args], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(folder: Path, pattern: str, child: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``folder`` holds a file matching ``pattern`` (the child is then past its start-up)."""
    deadline = time.time() + timeout
    while not list(folder.glob(pattern)):
        assert child.poll() is None and time.time() < deadline, child.communicate()[1][-2000:]
        time.sleep(0.01)


@pytest.fixture(scope="module")
def longer_reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, reference: tuple) -> dict:
    folder = tmp_path_factory.mktemp("kill-ref-longer")
    with pytest.MonkeyPatch.context() as patch:
        assert not run_in(folder, patch, Killer(), (*LONGER, "data.data_dir=" + str(data_dir)))
    return outcome(folder)


@pytest.mark.parametrize("case", range(3))
def test_sigkill_at_a_random_time_then_rerun_ends_identical(case: int, longer_reference: dict, data_dir: Path,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    delay = random.Random(1400 + case).uniform(0.0, 0.8)
    child = spawn(tmp_path, data_dir, LONGER)
    # config.json is written when the run folder is claimed, just before the first step
    wait_for(tmp_path, "runs/*/config.json", child)
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    finished = bool(list(tmp_path.glob("runs/*/record.json")))
    if not finished:
        assert not run_in(tmp_path, monkeypatch, Killer(), (*LONGER, "data.data_dir=" + str(data_dir)))
    got = outcome(tmp_path)
    if finished:
        # killed after its record, before its checkpoint was removed: the only difference is that file
        got["files"] = [f for f in got["files"] if f != "checkpoint.pt"]
    assert got == longer_reference


def test_two_runs_at_once_one_refused_and_a_killed_holder_leaves_no_stuck_lock(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = ("train.steps=400",)
    children = [spawn(tmp_path, data_dir, steps) for _ in range(2)]
    # the refused one ends at once; the other trains on
    deadline = time.time() + 120
    while all(c.poll() is None for c in children):
        assert time.time() < deadline
        time.sleep(0.02)
    (refused,) = [c for c in children if c.poll() is not None]
    (holder,) = [c for c in children if c is not refused]
    err = refused.communicate()[1].strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1, err
    assert "runs/listops_full_smoke_seed0 is in use by another lra-run" in err[0] and f"(pid {holder.pid})" in err[0]
    wait_for(tmp_path, "runs/*/checkpoint.pt", holder)
    holder.send_signal(signal.SIGKILL)
    holder.communicate()
    run = tmp_path / "runs" / "listops_full_smoke_seed0"
    with open(run / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not run_in(tmp_path, monkeypatch, Killer(), (*steps, "data.data_dir=" + str(data_dir)))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == list(range(3, 401, 3))
    assert [m["step"] for m in lines if "val_acc" in m] == [*range(7, 400, 7), 400]
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()] == [run.name]
