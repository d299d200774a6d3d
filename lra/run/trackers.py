"""Experiment trackers: the scalars of metrics.jsonl, also where researchers look at them.

``train.tracker``: ``none`` (metrics.jsonl only), ``tensorboard`` (event files in <run>/tensorboard,
``tensorboard --logdir runs``) or ``wandb`` (Weights & Biases, in <run>/wandb; offline unless the
machine is logged in, or ``WANDB_MODE`` says otherwise: ``wandb sync`` uploads an offline run later).
Both are optional packages: ``pip install -e ".[track]"``.

Logged: ``loss``, ``lr`` and ``tokens_per_s`` every ``log_every`` steps, ``val_acc`` and ``val_loss`` at
each evaluation, ``test_acc`` at the end, each at its optimizer step. A resumed run continues the
same tracker run: TensorBoard drops what an earlier attempt logged past the checkpoint (purge_step),
wandb resumes the run of the same id.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, Optional


class Tracker:
    """The tracker of ``train.tracker=none``: logs nothing."""

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    def __init__(self, run_dir: Path, resume_step: Optional[int]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

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

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
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
