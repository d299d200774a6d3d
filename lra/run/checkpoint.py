"""Resumable checkpoints: what one holds, saving it, and a run restored from it (or started afresh).

A checkpoint is a plain dict (model, optimizer, state, every process's RNG), loaded with
weights_only; a damaged or foreign file is a one-line error that says to delete it.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from ..errors import UserError
from ..files import write_atomic
from ..machine import peak_memory_mb
from .folder import RESUME, open_metrics
from .trackers import open_tracker

if TYPE_CHECKING:  # the run the trainer builds (run/setup.py, which imports this module through init_from)
    from .setup import Run

CHECKPOINT_KEYS = ("model", "optimizer", "state", "rng_cpu", "rng_cuda")


@dataclass
class TrainState:
    """Everything a resume needs besides the model, optimizer and RNG; saved as the checkpoint's
    ``state`` (a plain dict, so that the checkpoint loads with weights_only)."""

    started_at: str
    # optimizer steps taken
    step: int = 0
    # the best validation accuracy so far, its step and a copy of the weights that reached it
    best_acc: float = -1.0
    best_step: int = 0
    best_model: Optional[Dict[str, torch.Tensor]] = None
    # wall-clock seconds of training steps and of evaluation, tokens trained on, peak memory (MB)
    train_time: float = 0.0
    eval_time: float = 0.0
    tokens: int = 0
    peak_mb: float = 0.0
    # the last logged mean loss, and the losses since it
    last_loss: float = float("nan")
    losses: List[float] = field(default_factory=list)
    # the bytes of metrics.jsonl written so far (a resume cuts the log back to them)
    log_bytes: int = 0
    # the code each process of the run started from (machine.git_commit); a resume on other code adds
    # one. Optional: a checkpoint without it resumes with it empty
    commits: List[str] = field(default_factory=list)
    # the last step whose validation finished (-1: none yet); a checkpoint saved by a signal in the
    # middle of one holds the step before, and the resume evaluates first. Optional: a checkpoint
    # without it was saved after its step's validation
    evaluated_at: int = -1

    def to_dict(self) -> Dict[str, Any]:
        # not dataclasses.asdict: it would deep-copy the best weights
        return {f.name: getattr(self, f.name) for f in fields(self)}


# the state keys a checkpoint must hold (commits and evaluated_at are optional)
STATE_KEYS = tuple(f.name for f in fields(TrainState) if f.name not in ("commits", "evaluated_at"))


def save_checkpoint(path: Path, state: Dict[str, Any]) -> None:
    write_atomic(path, lambda f: torch.save(state, f), RESUME)


def read_torch_file(path: Path, what: str, advice: str) -> Any:
    """``torch.load`` of a file this suite wrote (tensors and plain containers only, onto the CPU); a
    damaged or foreign file is one line: "<what> is unreadable (<cause>); <advice>"."""
    try:
        # torch warns (on stderr) about some foreign pickles before refusing them: the error says enough
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated file, another format, a pickle of other objects
        raise UserError(f"{what} is unreadable ({type(err).__name__}); {advice}")


def load_checkpoint(path: Path) -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path`` (None when there is none); a foreign or damaged file is a one-line error."""
    if not path.exists():
        return None
    saved = read_torch_file(path, f"the checkpoint {path}", "delete it to start the run over")
    problem = checkpoint_problem(saved)
    if problem:
        raise UserError(f"the checkpoint {path} {problem}; delete it to start the run over")
    return saved


def checkpoint_problem(saved: Any) -> str:
    """What makes ``saved`` something other than a checkpoint of this trainer ("" when it is one)."""
    if not isinstance(saved, dict):
        return f"holds a {type(saved).__name__}, not a training checkpoint"
    missing = [k for k in CHECKPOINT_KEYS if k not in saved]
    if missing:
        return f"is not a training checkpoint of this suite (it lacks {', '.join(missing)})"
    state = saved["state"]
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else ["state"]
    if missing:
        return f"lacks state {', '.join(missing)} (written by another version of the suite?)"
    if not isinstance(state["step"], int) or state["step"] < 0 or not isinstance(state["log_bytes"], int):
        return f"holds step {state['step']!r} and log size {state['log_bytes']!r}; both must be whole numbers"
    rng = saved["rng_cpu"]
    if not isinstance(rng, list) or not rng or not all(isinstance(r, torch.Tensor) and r.dtype == torch.uint8 for r in rng):
        return "holds no usable random-number state (rng_cpu)"
    return ""


def restore_weights(path: Path, saved: Dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer; a checkpoint of another model shape is a one-line error."""
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
        detail = " ".join(str(err).split())
        raise UserError(f"the checkpoint {path} does not fit this run's model ({detail[:240]}); delete it to start "
                        "the run over")


def restore_or_start(run: Run, started_at: str) -> TrainState:
    """The run's state, and its metrics log opened (rank 0's): from the checkpoint when there is one."""
    path = run.run_dir / "checkpoint.pt"
    saved = load_checkpoint(path)
    if saved is None:
        torch.manual_seed(run.cfg.seed * 1000 + run.d.rank + 1)
        state = TrainState(started_at=started_at)
        # --init-from: another run's best weights, on a fresh start only (a resume has its own)
        if run.init is not None:
            run.init.apply(run.model)
            if run.d.main:
                print(f"lra-run: {run.init.summary()}", flush=True)
    else:
        restore_weights(path, saved, run.model, run.optimizer)
        state = TrainState(**{"evaluated_at": saved["state"]["step"], **saved["state"]})
        run.saved_step = state.step
        rng = saved["rng_cpu"]
        torch.set_rng_state(rng[run.d.rank] if run.d.rank < len(rng) else rng[0])
        if run.device.type == "cuda" and saved["rng_cuda"] is not None:
            torch.cuda.set_rng_state(saved["rng_cuda"].cpu())
    covered = None if saved is None else state.log_bytes
    run.log = open_metrics(run.run_dir / "metrics.jsonl", covered) if run.d.main else None
    if run.d.main:
        run.tracker = open_tracker(run.cfg.train.tracker, run.run_dir, run.cfg.to_dict(), None if saved is None else state.step)
    if run.d.main and saved is not None:
        print(f"lra-run: resumed {run.run_dir} from step {state.step} of {run.cfg.train.steps}", file=sys.stderr, flush=True)
    return state


def save(run: Run, state: TrainState) -> None:
    """A resumable checkpoint: weights, optimizer, state and every process's RNG (rank 0 writes it)."""
    state.peak_mb = max(state.peak_mb, peak_memory_mb(run.device)[0])
    rng = [torch.get_rng_state()]
    if run.d.enabled:
        gathered: list = [None] * run.d.world_size
        torch.distributed.all_gather_object(gathered, rng[0])
        rng = gathered
    if run.log is not None:
        state.log_bytes = run.log.tell()
    # the tracker keeps what was logged up to this step before the checkpoint says it was logged
    run.tracker.checkpoint()
    if run.d.main:
        save_checkpoint(run.run_dir / "checkpoint.pt", {
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "state": state.to_dict(),
            "rng_cpu": rng, "rng_cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None,
        })
    run.saved_step = state.step


def peek_step(path: Path) -> int:
    """The step of the checkpoint at ``path`` (0 when there is none), its tensors left unread."""
    if not path.is_file():
        return 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(saved["state"]["step"])
    except Exception:  # noqa: BLE001 - a damaged checkpoint is named when the run restores it
        return 0
