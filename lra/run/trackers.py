"""Experiment trackers: the scalars of metrics.jsonl, also where researchers look at them.

``train.tracker``: ``none`` (metrics.jsonl only), ``tensorboard`` (event files in <run>/tensorboard,
``tensorboard --logdir runs``) or ``wandb`` (Weights & Biases, in <run>/wandb; offline unless the
machine is logged in, or ``WANDB_MODE`` says otherwise: ``wandb sync`` uploads an offline run later).
Both are optional packages: ``pip install -e ".[track]"``.

Logged: ``loss``, ``lr`` and ``tokens_per_s`` every ``log_every`` steps, ``val_acc`` and ``val_loss`` at
each evaluation, ``test_acc`` at the end, each at its optimizer step. A resumed run continues the
same tracker run and holds each logged step once, however often it was stopped:

- TensorBoard gets each scalar as it is logged; its events are flushed before every checkpoint, and
  a resume from step C opens the writer with ``purge_step`` C + 1, so TensorBoard drops whatever an
  earlier attempt logged past the checkpoint (a fresh start purges from step 0). Everything up to
  step C (that step's loss and validation too) was logged before its checkpoint and stays.
- wandb cannot take back what it was sent, so it is sent a step's scalars (one row per step) when the
  checkpoint that covers the step is written (``checkpoint()``, every ``checkpoint_every`` steps and
  when a signal stops the run), and the rest when the record is written. An attempt killed past its
  checkpoint has sent nothing that the resume sends again; the rows shown lag by up to
  ``checkpoint_every`` steps.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, Optional


class Tracker:
    """The tracker of ``train.tracker=none``: logs nothing."""

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        pass

    def checkpoint(self) -> None:
        """Everything logged so far is kept: called just before a checkpoint or the record is written."""

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, run_dir: Path, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # the first step not logged yet: the checkpoint's step was logged before the checkpoint was saved
        first_new = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=first_new)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def checkpoint(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Tracker):
    def __init__(self, run_dir: Path, config: Dict[str, Any]) -> None:
        import os

        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if logged_in(wandb) else "offline")
        # one id per run folder, so that a resumed attempt continues the same wandb run
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lra-suite"), name=run_dir.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config, mode=mode,
                              settings=wandb.Settings(silent=True, console="off"))
        # step -> its scalars, logged since the last checkpoint: not sent yet
        self.pending: Dict[int, Dict[str, float]] = {}

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        self.pending.setdefault(step, {}).update(scalars)

    def checkpoint(self) -> None:
        for step in sorted(self.pending):
            self.run.log(self.pending[step], step=step, commit=True)
        self.pending = {}

    def close(self) -> None:
        # what was logged past the last checkpoint is dropped: the resumed run logs it again
        self.pending = {}
        self.run.finish()


def logged_in(wandb: Any) -> bool:
    try:
        return bool(wandb.api.api_key)
    except Exception:  # noqa: BLE001 - no settings, no key: offline
        return False


def open_tracker(kind: str, run_dir: Path, config: Dict[str, Any], resume_step: Optional[int]) -> Tracker:
    """The run's tracker; ``resume_step`` is the checkpoint's step on a resume (None on a fresh start)."""
    if kind == "tensorboard":
        return TensorBoard(run_dir, resume_step)
    if kind == "wandb":
        return WandB(run_dir, config)
    return Tracker()
