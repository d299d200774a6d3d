"""Ctrl-C that answers: the first SIGINT says at once what will happen and the run saves and stops at
the end of its step, or between two batches of an evaluation or of the test; a second one stops it
now, leaving the last checkpoint as it was; the same command continues either way. Real signals go to
runs in processes of their own, whose steps are made long by a backend that sleeps
(tests/slow_attention.py); the runs compared with an uninterrupted one are in this process."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, List

import pytest

import lra.run.loop
import lra.run.setup
import lra.run.train
from conftest import ROOT, TINY_LISTOPS
from sweep_helpers import outcome

RUN = [sys.executable, "-c", "from lra.cli.run import entry; entry()"]
# a run of the slow backend: each step sleeps 2 x sleep_s (two layers), each evaluation batch too
SLOW = [*TINY_LISTOPS, "--attn-module", str(ROOT / "tests" / "slow_attention.py"), "--attn", "slow",
        "--set", "train.steps=6", "train.eval_every=3", "train.eval_batches=0", "train.log_every=1",
        "train.checkpoint_every=2", "train.threads=1"]
SAID_WITHIN_S = 1.0


class Child:
    """lra-run in a process of its own; its stderr read by a thread, each line with when it came."""

    def __init__(self, command: List[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: List[tuple] = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def said(self, start: str) -> float:
        """When a line starting with ``start`` came (inf if none has)."""
        return next((t for t, line in self.lines if line.startswith(start)), float("inf"))

    def signal(self) -> float:
        self.proc.send_signal(signal.SIGINT)
        return time.monotonic()

    def end(self, timeout: float = 120) -> float:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return time.monotonic()

    @property
    def err(self) -> str:
        return "\n".join(line for _, line in self.lines)


def logged(run_dir: Path, key: str, step: int) -> bool:
    """Whether metrics.jsonl holds a line with ``key`` at ``step``."""
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return any(key in m and m["step"] == step for m in map(json.loads, filter(None, lines)))


def wait_for(test: Callable[[], bool], child: Child, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not test():
        assert child.proc.poll() is None, f"the run ended before {what}: {child.err}"
        assert time.time() < deadline, f"no {what} in {timeout} s: {child.err}"
        time.sleep(0.01)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_first_signal_is_said_at_once_while_the_main_thread_is_busy(tmp_path: Path) -> None:
    """The main thread inside one long operation (here: a sleep with SIGINT blocked for it, as a long C
    call runs no Python handler): the first signal is said within a second, the second ends the process."""
    code = textwrap.dedent("""
        import signal, sys, time
        from lra.run.signals import StopSignals
        with StopSignals(kept=lambda: "nothing to keep here"):
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            print("busy", file=sys.stderr, flush=True)
            time.sleep(60)
    """)
    child = Child([sys.executable, "-c", code], tmp_path)
    wait_for(lambda: child.said("busy") < float("inf"), child, "the busy line")
    sent = child.signal()
    wait_for(lambda: child.said("lra-run: stopping") < float("inf"), child, "the stopping line", timeout=10)
    assert child.said("lra-run: stopping") - sent < SAID_WITHIN_S
    assert "saving at the end of this step; Ctrl-C again to stop now" in child.err
    assert child.proc.poll() is None
    sent = child.signal()
    ended = child.end(timeout=10)
    assert ended - sent < SAID_WITHIN_S and child.proc.returncode == 130
    assert child.err.splitlines()[-1] == "lra-run: stopped now; nothing to keep here"


def test_ctrl_c_saves_at_the_end_of_a_long_step_and_the_same_command_continues(tmp_path: Path, listops_data: Path) -> None:
    args = [*SLOW, "attn.sleep_s=0.75", "--data-dir", str(listops_data), "--out", "runs"]
    run_dir = tmp_path / "runs" / "listops_slow_smoke_seed0"
    child = Child([*RUN, *args], tmp_path)
    # in step 2 (its loss line not yet written): the signal lands 0.1 s into a 1.5 s step
    wait_for(lambda: logged(run_dir, "loss", 1), child, "step 1")
    time.sleep(0.1)
    sent = child.signal()
    child.end()
    assert child.said("lra-run: stopping: saving at the end of this step; Ctrl-C again to stop now") - sent < SAID_WITHIN_S
    assert child.proc.returncode == 130, child.err
    assert child.err.splitlines()[-1] == "lra-run: stopped by signal at step 2; continue with the same command (or --resume)"
    # the rest of the step, then the checkpoint: well before the run's other 4 steps and 2 evaluations (15 s)
    assert child.said("lra-run: stopped by signal") - sent < 8
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "record.json").exists()
    again = Child([*RUN, *args], tmp_path)
    again.end(timeout=300)
    assert again.proc.returncode == 0, again.err
    assert f"lra-run: resumed runs/listops_slow_smoke_seed0 from step 2 of 6" in again.err


def test_a_second_ctrl_c_stops_now_and_keeps_the_last_checkpoint(tmp_path: Path, listops_data: Path) -> None:
    args = [*SLOW, "attn.sleep_s=1.5", "--data-dir", str(listops_data), "--out", "runs"]
    run_dir = tmp_path / "runs" / "listops_slow_smoke_seed0"
    child = Child([*RUN, *args], tmp_path)
    # step 3 runs (3 s) after the checkpoint of step 2
    wait_for(lambda: logged(run_dir, "loss", 2) and (run_dir / "checkpoint.pt").is_file(), child, "step 2's checkpoint")
    kept = digest(run_dir / "checkpoint.pt")
    child.signal()
    wait_for(lambda: child.said("lra-run: stopping") < float("inf"), child, "the stopping line", timeout=10)
    sent = child.signal()
    ended = child.end()
    # at once: no interpreter shutdown either
    assert ended - sent < 2 * SAID_WITHIN_S and child.proc.returncode == 130, child.err
    assert child.err.splitlines()[-1] == (f"lra-run: stopped now; the checkpoint of step 2 in runs/listops_slow_smoke_seed0 "
                                          "is kept; the same command continues from it")
    assert digest(run_dir / "checkpoint.pt") == kept
    again = Child([*RUN, *args], tmp_path)
    again.end(timeout=300)
    assert again.proc.returncode == 0, again.err
    assert "lra-run: resumed runs/listops_slow_smoke_seed0 from step 2 of 6" in again.err


def test_ctrl_c_in_an_evaluation_stops_between_its_batches(tmp_path: Path, listops_data: Path) -> None:
    # the validation split's 32 rows in 16 batches of 2, each 1.5 s: the signal lands in the first
    args = [*SLOW, "attn.sleep_s=0.75", "train.batch_size=2", "--data-dir", str(listops_data), "--out", "runs"]
    run_dir = tmp_path / "runs" / "listops_slow_smoke_seed0"
    child = Child([*RUN, *args], tmp_path)
    wait_for(lambda: logged(run_dir, "loss", 3), child, "step 3 (the evaluation after it starts)")
    time.sleep(0.1)
    sent = child.signal()
    child.end()
    assert child.said("lra-run: stopping: saving before the next batch of this evaluation") - sent < SAID_WITHIN_S
    assert child.proc.returncode == 130, child.err
    assert child.err.splitlines()[-1] == ("lra-run: stopped by signal in the evaluation after step 3; continue with "
                                          "the same command (or --resume)")
    # one batch (1.5 s) and the checkpoint, not the evaluation's 24 s
    assert child.said("lra-run: stopped by signal") - sent < 8
    assert not logged(run_dir, "val_acc", 3)
    again = Child([*RUN, *args], tmp_path)
    again.end(timeout=300)
    assert again.proc.returncode == 0, again.err
    # the evaluation cut short was done on resuming, once
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val_acc" in m] == [3, 6]


# ---- in this process: a stopped evaluation or test, resumed, ends as an uninterrupted run ----

FAST = [*TINY_LISTOPS, "--attn", "full", "--set", "train.steps=6", "train.eval_every=3", "train.log_every=1",
        "train.checkpoint_every=4", "train.threads=1"]


@pytest.mark.parametrize("where", ["validation", "test"])
def test_a_run_stopped_in_an_evaluation_resumes_to_the_uninterrupted_outcome(
    where: str, cli: Callable, tmp_path: Path, listops_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = cli("lra-run", *FAST, "--data-dir", listops_data, "--out", tmp_path / "ref")
    assert ran.code == 0, ran.err
    evaluate = lra.run.loop.evaluate
    # the signal comes before the second batch of the evaluation after step 3, or of the test
    split = "val" if where == "validation" else "test"

    def signalled(model, data, *args, stop=None, **kwargs):  # type: ignore[no-untyped-def]
        checks = [0]

        def stop_then() -> bool:
            checks[0] += 1
            if checks[0] == 2 and data is target[0]:
                os.kill(os.getpid(), signal.SIGINT)
            return stop()

        return evaluate(model, data, *args, stop=stop_then if stop is not None else None, **kwargs)

    target = [None]
    setup = lra.run.setup.setup

    def setup_and_mark(*args, **kwargs):  # type: ignore[no-untyped-def]
        run = setup(*args, **kwargs)
        target[0] = run.splits[split]
        return run

    with monkeypatch.context() as patch:
        patch.setattr(lra.run.loop, "evaluate", signalled)
        patch.setattr(lra.run.train, "evaluate", signalled)
        patch.setattr(lra.run.train, "setup", setup_and_mark)
        stopped = cli("lra-run", *FAST, "--data-dir", listops_data, "--out", tmp_path / "run")
    assert stopped.code == 130, stopped.err
    said = "in the evaluation after step 3" if where == "validation" else "in the test"
    assert stopped.err.splitlines()[-1] == f"lra-run: stopped by signal {said}; continue with the same command (or --resume)"
    resumed = cli("lra-run", *FAST, "--data-dir", listops_data, "--out", tmp_path / "run")
    assert resumed.code == 0, resumed.err
    run, ref = outcome(tmp_path / "run" / "listops_full_smoke_seed0"), outcome(tmp_path / "ref" / "listops_full_smoke_seed0")
    assert run == ref
