"""The training loop: steps until the last one, a non-finite loss or a signal, with logging,
evaluation and checkpoints on their schedules.

AdamW, linear warmup then linear decay (or the LRA JAX schedules), gradient clipping, evaluation every ``eval_every`` steps.
The batch of step ``s`` is a pure function of (seed, s), so a resumed run sees exactly the batches
it would have seen. Under torchrun the same loop runs with DistributedDataParallel.

    loop()         steps until the end, a divergence or a signal (run/signals.py)
    train_step()   one optimizer step on the batch of ``state.step``
    after_step()   logging, evaluation and checkpoints on their schedules
    evaluate()     accuracy and loss on a split, stopping between batches when asked
"""
from __future__ import annotations

import copy
import math
import time
from functools import lru_cache
from typing import Callable, NoReturn, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import TrainConfig
from ..tasks import Split
from ..tasks.augment import augment
from ..tasks.base import IGNORE
from . import distributed, folder
from .checkpoint import TrainState, save
from .setup import Run, to_device
from .signals import StopSignals


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived; a checkpoint was saved and the run can be resumed."""


class Stopped(Exception):
    """An evaluation stopped between two batches because a signal asked the run to stop."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based), by ``cfg.schedule``."""
    if cfg.schedule == "linear":
        # 1) linear warmup from lr/warmup to lr over the first warmup_steps steps
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        # 2) then linear decay, reaching 0 after the last step
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * max(0.0, 1.0 - progress)
    # the LRA JAX schedules (lra_benchmarks/utils/train_utils.py create_learning_rate_scheduler), a
    # product of factors of the optimizer's step count s (0 at the first step, whose rate is 0):
    # 1) constant * linear_warmup
    rate = cfg.lr * min(1.0, step / cfg.warmup_steps)
    if cfg.schedule == "rsqrt":
        # 2) rsqrt_decay: 1 / sqrt(s), held at 1 / sqrt(warmup) during the warmup
        return rate / math.sqrt(max(step, cfg.warmup_steps))
    # 2) cosine_decay: half a cosine per cycle after the warmup, restarting at each cycle's end
    progress = max(0.0, (step - cfg.warmup_steps) / (cfg.steps_per_cycle or cfg.steps))
    return rate * max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, n: int, batch: int, seed: int) -> np.ndarray:
    """Example indices of step ``step``: a stream of seeded per-epoch permutations, cut in batches."""
    start, out = step * batch, []
    while sum(len(o) for o in out) < batch:
        epoch, offset = divmod(start, n)
        take = _epoch_order(n, seed, epoch)[offset : offset + batch - sum(len(o) for o in out)]
        out.append(take)
        start += len(take)
    return np.concatenate(out)


def loop(run: Run, state: TrainState, quiet: bool, stop: StopSignals) -> Tuple[str, str]:
    """Steps until the last one ("completed"), a non-finite loss ("diverged", with why), or a signal
    (a checkpoint, then Interrupted: at the end of a step, or between two batches of an evaluation)."""
    tc, d = run.cfg.train, run.d
    bar = tqdm(total=tc.steps, initial=state.step, desc=f"{run.cfg.task}/{run.cfg.attn}", disable=quiet or not d.main)
    try:
        # an evaluation a signal cut short is done first; so is the one of train.steps = 0 (the initial
        # weights, --init-from's say, evaluated as if best at step 0)
        if evaluation_due(state.step, tc) and state.evaluated_at < state.step:
            validate(run, state, stop)
        while state.step < tc.steps:
            stop.phase = "step"
            loss = train_step(run, state)
            if not math.isfinite(loss):
                return "diverged", f"loss became {loss} at step {state.step + 1}; the last good checkpoint is kept"
            after_step(run, state, loss, bar, stop)
            if distributed.any_flag(stop.requested(), d, run.device):
                stop_here(run, state, f"at step {state.step}")
    finally:
        bar.close()
    return "completed", ""


def stop_here(run: Run, state: TrainState, where: str) -> NoReturn:
    """Save a checkpoint of ``state`` and stop the run (a signal asked for it)."""
    save(run, state)
    raise Interrupted(f"stopped by signal {where}; continue with the same command (or --resume)")


def evaluation_due(step: int, tc: TrainConfig) -> bool:
    """Whether the validation split is evaluated after step ``step``: every ``eval_every`` steps and at the last."""
    return step == tc.steps or (step > 0 and step % tc.eval_every == 0)


def train_step(run: Run, state: TrainState) -> float:
    """One optimizer step on the batch of step ``state.step``; the global batch's mean loss. A
    non-finite loss (on any process) is returned before the weights change, and the step not counted."""
    tc, d, cfg = run.cfg.train, run.d, run.cfg
    t0 = time.perf_counter()
    local = tc.batch_size // d.world_size
    rows = slice(d.rank * local, (d.rank + 1) * local)
    idx = batch_indices(state.step, len(run.splits["train"]), tc.batch_size, cfg.seed)[rows]
    tokens, lengths, labels = to_device(run.splits["train"], idx, run.device)
    tokens = augment(tc.augment, tokens, run.spec, cfg.seed, state.step, tc.batch_size, rows)
    lr = lr_at(state.step, tc)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(device_type=run.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        logits = run.net(tokens, lengths)
    logits, labels = per_target(logits, labels)
    loss = F.cross_entropy(logits.float(), labels)
    # the global batch's mean loss, and whether any process saw a non-finite one
    stats = distributed.all_sum(torch.stack([loss.detach(), (~torch.isfinite(loss)).float()]), d)
    global_loss = stats[0].item() / d.world_size
    if stats[1].item() > 0:
        return float("nan") if math.isfinite(global_loss) else global_loss
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if tc.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
    run.optimizer.step()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    state.train_time += time.perf_counter() - t0
    state.tokens += run.tokens_per_step
    state.step += 1
    state.losses.append(global_loss)
    return global_loss


def after_step(run: Run, state: TrainState, loss: float, bar: tqdm, stop: StopSignals) -> None:
    """The mean loss logged every ``log_every`` steps, the validation split every ``eval_every`` (and
    at the last step), a checkpoint every ``checkpoint_every``."""
    tc, step = run.cfg.train, state.step
    bar.update(1)
    if step % tc.log_every == 0:
        state.last_loss = sum(state.losses) / len(state.losses)
        state.losses = []
        lr = run.optimizer.param_groups[0]["lr"]
        if run.log is not None:
            folder.append_metric(run.log, {"step": step, "loss": state.last_loss, "lr": lr})
        run.tracker.log(step, {"loss": state.last_loss, "lr": lr, "tokens_per_s": state.tokens / max(state.train_time, 1e-9)})
    if evaluation_due(step, tc):
        acc = validate(run, state, stop)
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{acc:.3f}", tok_s=f"{state.tokens / state.train_time:.0f}")
    if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
        save(run, state)


def validate(run: Run, state: TrainState, stop: StopSignals) -> float:
    """Accuracy on the validation split, logged; the weights kept when they are the best so far. A
    signal between two of its batches saves a checkpoint that holds the evaluation as not done, and
    stops the run (a resume evaluates first)."""
    tc, step = run.cfg.train, state.step
    t1 = time.perf_counter()
    stop.phase = "evaluation"
    try:
        acc, val_loss = evaluate(run.net, run.splits["val"], tc.batch_size, tc.eval_batches, run.device, run.d,
                                 run.bf16, stop=between_batches(stop, run.d))
    except Stopped:
        stop_here(run, state, f"in the evaluation after step {step}")
    state.eval_time += time.perf_counter() - t1
    if acc > state.best_acc:
        state.best_acc, state.best_step, state.best_model = acc, step, copy.deepcopy(run.model.state_dict())
    state.evaluated_at = step
    if run.log is not None:
        folder.append_metric(run.log, {"step": step, "val_acc": acc, "val_loss": val_loss})
    run.tracker.log(step, {"val_acc": acc, "val_loss": val_loss})
    return acc


def between_batches(stop: StopSignals, d: distributed.Dist) -> Optional[Callable[[], bool]]:
    """What an evaluation asks between two batches: whether a signal came. None under torchrun, whose
    processes must stop at the same batch (they agree at the end of a step instead)."""
    return None if d.enabled else stop.requested


def per_target(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row per target: a token-level task's logits [B, L, C] and labels [B, L] flattened to
    [B L, C] and [B L] (cross_entropy skips the IGNORE labels); a classifier's are returned as they are."""
    if labels.dim() == 1:
        return logits, labels
    return logits.flatten(0, 1), labels.flatten()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, split: Split, batch: int, max_batches: int, device: torch.device, d: distributed.Dist,
    bf16: bool, stop: Optional[Callable[[], bool]] = None,
) -> Tuple[float, float]:
    """Accuracy and mean loss on the first ``max_batches`` batches of ``split`` (0 = all); for a
    token-level task, over the labelled positions of those rows. ``stop``: asked before each batch;
    True raises Stopped (the model is left in training mode)."""
    model.eval()
    n = len(split) if max_batches == 0 else min(len(split), max_batches * batch)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    for b, start in enumerate(range(0, n, batch)):
        if b % d.world_size != d.rank:
            continue
        if stop is not None and stop():
            model.train()
            raise Stopped
        tokens, lengths, labels = to_device(split, np.arange(start, min(start + batch, n)), device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens, lengths)
        logits, labels = per_target(logits, labels)
        sums += torch.stack([
            (logits.argmax(-1) == labels).sum().double(),
            F.cross_entropy(logits.float(), labels, reduction="sum").double(),
            (labels != IGNORE).sum().double(),
        ])
    correct, loss, count = distributed.all_sum(sums, d).tolist()
    model.train()
    return correct / count, loss / count
