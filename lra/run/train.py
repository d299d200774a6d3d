"""The one trainer for every task and backend: ``train(cfg) -> result record``.

A run goes setup -> claim -> restore -> loop -> finish: the device, processes, data, model and
optimizer (run/setup.py); the run folder chosen and locked (run/folder.py); its checkpoint continued
or a fresh start (run/checkpoint.py); the steps (run/loop.py); then the best-validation weights
tested and the record written (``finish``, schema in run/record.py). Checkpoints are written every
``checkpoint_every`` steps and on SIGTERM / SIGINT; under torchrun rank 0 writes every file.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Dict, Optional

import numpy as np

from ..config import RunConfig
from ..files import write_json_atomic
from ..machine import environment, git_commit, load_average, matmul_rate, peak_memory_mb
from ..tasks.base import IGNORE
from . import checkpoint, distributed, folder
from .checkpoint import TrainState, restore_or_start
from .estimate import notice
from .loop import evaluate, loop
from .record import Record, now
from .setup import Run, setup


def train(cfg: RunConfig, resume: bool = False, quiet: bool = False, estimate: bool = True) -> Dict[str, Any]:
    """Train ``cfg.attn`` on ``cfg.task``; write and return the result record (a dict, with ``run_dir``).

    The run folder is locked from when it is chosen until the record is written (or the run stops).
    ``estimate``: say before training what a long run will cost here (run/estimate.py).
    """
    started_at = now()
    # the code this process runs: read now, since a checkout during the run changes the tree, not the code
    commit = git_commit()
    if resume:
        # nothing to resume is refused before any data is read or generated (minutes for the paper preset)
        folder.choose_run_dir(cfg, resume)
    with contextlib.ExitStack() as held:
        # 1) setup: device and processes, data, model and optimizer
        run = setup(cfg, quiet)
        # 2) restore: claim (and lock) the run folder, continue its checkpoint if it has one
        run.run_dir = folder.claim(cfg, resume, run.d, held)
        state = restore_or_start(run, started_at)
        held.callback(run.tracker.close)
        if not state.commits or state.commits[-1] != commit:
            state.commits.append(commit)
        # a single process only: a backward outside DistributedDataParallel's forward would wake its gradient hooks
        if estimate and not run.d.enabled and state.step < cfg.train.steps:
            line = notice(run, state)
            if line:
                print(f"lra-run: {line}", file=sys.stderr, flush=True)
        # 3) the loop, until the last step, a non-finite loss or a signal
        status, message = loop(run, state, quiet)
        # 4) finish: test the best weights, write the record
        record = finish(run, state, status, message)
    distributed.teardown(run.d)
    return {**record.to_dict(), "run_dir": str(run.run_dir)}


def finish(run: Run, state: TrainState, status: str, message: str) -> Record:
    """Test the best-validation weights (a completed run), then write record.json (and best_model.pt)."""
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
        test_acc, _ = evaluate(run.net, run.splits["test"], tc.batch_size, tc.test_batches, run.device, run.d, run.bf16)
        run.tracker.log(state.step, {"test_acc": test_acc})
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
