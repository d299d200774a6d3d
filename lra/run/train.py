"""The one trainer for every task and backend: ``train(cfg) -> result record``.

A run goes prepare -> estimate -> setup -> claim -> restore -> loop -> finish: the device, processes
and model (run/setup.py); what a long run will cost, said before the data (run/estimate.py); the data
and optimizer; the run folder chosen and locked (run/folder.py); its checkpoint continued or a fresh
start (run/checkpoint.py); the steps (run/loop.py); then the best-validation weights tested and the
record written (``finish``, schema in run/record.py). Checkpoints are written every
``checkpoint_every`` steps and on SIGTERM / SIGINT (run/signals.py: a second one stops at once);
under torchrun rank 0 writes every file.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..config import RunConfig
from ..errors import UserError
from ..files import write_json_atomic
from ..machine import environment, git_commit, load_average, matmul_rate, peak_memory_mb
from ..tasks.base import IGNORE
from . import checkpoint, distributed, folder
from .checkpoint import TrainState, restore_or_start
from .estimate import estimate as estimate_run, notice
from .loop import Stopped, between_batches, evaluate, loop, stop_here
from .record import Record, now
from .setup import Prepared, Run, prepare, setup
from .signals import StopSignals


def train(cfg: RunConfig, resume: bool = False, quiet: bool = False, estimate: bool = True,
          warnings: Sequence[str] = ()) -> Dict[str, Any]:
    """Train ``cfg.attn`` on ``cfg.task``; write and return the result record (a dict, with ``run_dir``).

    The run folder is locked from when it is chosen until the record is written (or the run stops).
    ``estimate``: say before the data are read or generated what a long run will cost here (run/estimate.py).
    ``warnings``: lines said once the model, its backend and the source of ``--init-from`` have
    passed their checks (bad input is refused in one line, without them).
    """
    started_at = now()
    # the code this process runs: read now, since a checkout during the run changes the tree, not the code
    commit = git_commit()
    if resume:
        # nothing to resume is refused before any data is read or generated (minutes for the paper preset)
        folder.choose_run_dir(cfg, resume)
    with contextlib.ExitStack() as held:
        # 1) prepare: device and processes, the model, its backend checked on made-up rows of the task
        prepared = prepare(cfg)
        # 2) what a long run will cost, timed on those rows; a single process only (a backward outside
        # DistributedDataParallel's forward would wake its gradient hooks)
        tell = estimate and not prepared.d.enabled
        sizes = prepared.task.split_sizes(cfg.data)
        missing = prepared.task.unavailable(cfg.data) if tell and sizes is not None else ""
        if missing:
            # data that cannot be had are refused now, not after the seconds of the estimate
            raise UserError(missing)
        for line in warnings:
            print(f"lra-run: warning: {line}", file=sys.stderr, flush=True)
        if tell and sizes is not None:
            say_estimate(prepared, sizes, steps_done(cfg, resume))
        # 3) setup: the data (generated first where missing) and the optimizer
        run = setup(prepared, quiet)
        if tell and sizes is None:
            say_estimate(prepared, {s: len(split) for s, split in run.splits.items()}, steps_done(cfg, resume))
        # 4) restore: claim (and lock) the run folder, continue its checkpoint if it has one
        run.run_dir = folder.claim(cfg, resume, run.d, held)
        state = restore_or_start(run, started_at)
        held.callback(run.tracker.close)
        held.callback(lambda: run.log.close() if run.log is not None else None)
        if not state.commits or state.commits[-1] != commit:
            state.commits.append(commit)
        # 5) the loop, until the last step, a non-finite loss or a signal; then the test and the record
        with StopSignals(kept=lambda: kept(run)) as stop:
            status, message = loop(run, state, quiet, stop)
            record = finish(run, state, status, message, stop)
    distributed.teardown(run.d)
    return {**record.to_dict(), "run_dir": str(run.run_dir)}


def steps_done(cfg: RunConfig, resume: bool) -> int:
    """The steps the run this command continues has behind it (its checkpoint's); 0 for a fresh start."""
    return checkpoint.peek_step(folder.choose_run_dir(cfg, resume) / "checkpoint.pt")


def say_estimate(prepared: Prepared, sizes: Dict[str, int], done: int) -> None:
    """The estimate's line on stderr, when the rest of the run is long."""
    cfg = prepared.cfg
    if done >= cfg.train.steps and cfg.train.steps:
        return
    est = estimate_run(prepared, sizes, done)
    line = notice(cfg, est, prepared.device)
    if line:
        print(f"lra-run: {line}", file=sys.stderr, flush=True)


def kept(run: Run) -> str:
    """What a run stopped now leaves to continue from."""
    if run.saved_step is None:
        return f"no checkpoint yet: the same command starts the run in {run.run_dir} over"
    return f"the checkpoint of step {run.saved_step} in {run.run_dir} is kept; the same command continues from it"


def finish(run: Run, state: TrainState, status: str, message: str, stop: StopSignals) -> Record:
    """Test the best-validation weights (a completed run), then write record.json (and best_model.pt).
    A signal between two test batches saves a checkpoint and stops: its resume only tests."""
    tc, cfg = run.cfg.train, run.cfg
    # how busy the machine was while training: the train time of two runs compares only at similar loads
    load = load_average()
    # and how fast it was: machines of the same name can differ 2x
    rate = matmul_rate(run.device)
    if state.losses:
        state.last_loss = sum(state.losses) / len(state.losses)
    test_acc: Optional[float] = None
    if status == "completed" and state.best_model is not None:
        run.model.load_state_dict(state.best_model)
        stop.phase = "test"
        try:
            test_acc, _ = evaluate(run.net, run.splits["test"], tc.batch_size, tc.test_batches, run.device, run.d,
                                   run.bf16, stop=between_batches(stop, run.d))
        except Stopped:
            # the checkpoint holds the best weights as the model's: no step is left to train them further
            stop_here(run, state, "in the test")
        run.tracker.log(state.step, {"test_acc": test_acc})
    stop.phase = "record"
    mem, mem_kind = peak_memory_mb(run.device)
    test = run.splits["test"]
    n_test = len(test) if not tc.test_batches else min(len(test), tc.test_batches * tc.batch_size)
    # the share of the most frequent answer (a token-level task's: over its labelled positions)
    answers = np.asarray(test.labels[:n_test]).ravel()
    counts = np.bincount(answers[answers != IGNORE], minlength=run.spec.num_classes)
    record = Record(
        status=status, run_name=run.run_dir.name, task=cfg.task, attn=cfg.attn, preset=cfg.preset, seed=cfg.seed,
        config=cfg.to_dict(), attn_budget=run.model.encoder.blocks[0].attn.budget(), steps=state.step,
        best_step=state.best_step, val_acc=state.best_acc if state.best_acc >= 0 else None, test_acc=test_acc,
        majority_acc=float(counts.max() / counts.sum()), test_examples=n_test,
        final_train_loss=None if math.isnan(state.last_loss) else state.last_loss,
        train_time_s=round(state.train_time, 3), eval_time_s=round(state.eval_time, 3),
        tokens_per_s=state.tokens / state.train_time if state.train_time else None,
        peak_memory_mb=round(max(mem, state.peak_mb), 1), memory_kind=mem_kind,
        params=sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        **{**environment(run.device), "git_commit": " -> ".join(state.commits)},
        world_size=run.d.world_size, precision="bf16" if run.bf16 else "fp32",
        started_at=state.started_at, finished_at=now(), message=message, load_average=load,
        init_from=None if run.init is None else run.init.record(), matmul_gflops=rate,
    )
    run.tracker.checkpoint()
    if run.d.main:
        if status == "completed":
            checkpoint.save_checkpoint(run.run_dir / "best_model.pt", state.best_model)
        write_json_atomic(run.run_dir / "record.json", record.to_dict(), folder.RESUME)
        # after the record: a kill in between leaves a finished folder, never a checkpoint-less unfinished one
        if status == "completed":
            (run.run_dir / "checkpoint.pt").unlink(missing_ok=True)
    return record
