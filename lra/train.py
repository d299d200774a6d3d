"""The one trainer for every task and backend: ``train(cfg) -> result record``.

AdamW, linear warmup then linear decay, gradient clipping, evaluation every ``eval_every`` steps,
the best-validation weights tested at the end. The batch of step ``s`` is a pure function of
(seed, s), so a resumed run sees exactly the batches it would have seen. Checkpoints are written
every ``checkpoint_every`` steps and on SIGTERM / SIGINT; under torchrun the same loop runs with
DistributedDataParallel and rank 0 writes every file.

    train()        setup -> restore -> loop -> finish, in one screen
    train_step()   one optimizer step on the batch of ``state.step``
    after_step()   logging, evaluation and checkpoints on their schedules
"""
from __future__ import annotations

import contextlib
import copy
import math
import signal
import time
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import checkpoint as ckpt
from . import distributed
from .augment import augment
from .checkpoint import TrainState
from .config import RunConfig, TrainConfig
from .files import write_json_atomic
from .machine import environment, git_commit, load_average, matmul_rate
from .record import Record, now
from .tasks import Split
from .tasks.base import IGNORE
from .tracking import open_tracker
from .train_setup import Run, peak_memory_mb, setup, to_device


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived; a checkpoint was saved and the run can be resumed."""


def train(cfg: RunConfig, resume: bool = False, quiet: bool = False) -> Dict[str, Any]:
    """Train ``cfg.attn`` on ``cfg.task``; write and return the result record (a dict, with ``run_dir``).

    The run folder is locked from when it is chosen until the record is written (or the run stops).
    """
    started_at = now()
    # the code this process runs: read now, since a checkout during the run changes the tree, not the code
    commit = git_commit()
    if resume:
        # nothing to resume is refused before any data is read or generated (minutes for the paper preset)
        ckpt.choose_run_dir(cfg, resume)
    with contextlib.ExitStack() as held:
        # 1) setup: device and processes, data, model and optimizer
        run = setup(cfg, quiet)
        # 2) restore: claim (and lock) the run folder, continue its checkpoint if it has one
        run.run_dir = claim_run_dir(cfg, resume, run.d, held)
        state = restore_or_start(run, started_at)
        held.callback(run.tracker.close)
        if not state.commits or state.commits[-1] != commit:
            state.commits.append(commit)
        # 3) the loop, until the last step, a non-finite loss or a signal
        status, message = loop(run, state, quiet)
        # 4) finish: test the best weights, write the record
        record = finish(run, state, status, message)
    distributed.teardown(run.d)
    return {**record.to_dict(), "run_dir": str(run.run_dir)}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    # 1) linear warmup from lr/warmup to lr over the first warmup_steps steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    # 2) then linear decay, reaching 0 after the last step
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * max(0.0, 1.0 - progress)


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


def claim_run_dir(cfg: RunConfig, resume: bool, d: distributed.Dist, held: contextlib.ExitStack) -> Any:
    """Rank 0 chooses and locks the run folder (unlocked when ``held`` closes); every rank gets its path.
    A refusal (the folder in use, say) is rank 0's one line; the other ranks end with it."""

    def claim() -> Any:
        run_dir, lock = ckpt.claim_run_dir(cfg, resume)
        held.callback(lock.release)
        return run_dir

    run_dir = distributed.on_main(claim, d)
    if d.enabled:
        holder = [run_dir]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    assert run_dir is not None
    return run_dir


def restore_or_start(run: Run, started_at: str) -> TrainState:
    """The run's state, and its metrics log opened (rank 0's): from the checkpoint when there is one."""
    path = run.run_dir / "checkpoint.pt"
    saved = ckpt.load_checkpoint(path)
    if saved is None:
        torch.manual_seed(run.cfg.seed * 1000 + run.d.rank + 1)
        state = TrainState(started_at=started_at)
        # --init-from: another run's best weights, on a fresh start only (a resume has its own)
        if run.init is not None:
            run.init.apply(run.model)
            if run.d.main:
                print(f"lra-run: {run.init.summary()}", flush=True)
    else:
        ckpt.restore_weights(path, saved, run.model, run.optimizer)
        state = TrainState(**saved["state"])
        rng = saved["rng_cpu"]
        torch.set_rng_state(rng[run.d.rank] if run.d.rank < len(rng) else rng[0])
        if run.device.type == "cuda" and saved["rng_cuda"] is not None:
            torch.cuda.set_rng_state(saved["rng_cuda"].cpu())
    covered = None if saved is None else state.log_bytes
    run.log = ckpt.open_metrics(run.run_dir / "metrics.jsonl", covered) if run.d.main else None
    if run.d.main:
        run.tracker = open_tracker(run.cfg.train.tracker, run.run_dir, run.cfg.to_dict(), None if saved is None else state.step)
    return state


class StopSignals:
    """While open, SIGTERM and SIGINT are noted in ``received`` (the loop saves and stops at the end
    of its step) instead of killing the process; the previous handlers come back on close."""

    def __init__(self) -> None:
        self.received: Optional[int] = None

    def __enter__(self) -> "StopSignals":
        self.previous = {s: signal.signal(s, self.note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def note(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def loop(run: Run, state: TrainState, quiet: bool) -> Tuple[str, str]:
    """Steps until the last one ("completed"), a non-finite loss ("diverged", with why), or a signal
    (a checkpoint, then Interrupted). The metrics log is closed and the signal handlers restored on return."""
    tc, d = run.cfg.train, run.d
    bar = tqdm(total=tc.steps, initial=state.step, desc=f"{run.cfg.task}/{run.cfg.attn}", disable=quiet or not d.main)
    try:
        # train.steps = 0: the initial weights (--init-from's, say) are evaluated, as if best at step 0
        if tc.steps == 0:
            validate(run, state)
        with StopSignals() as stop:
            while state.step < tc.steps:
                loss = train_step(run, state)
                if not math.isfinite(loss):
                    return "diverged", f"loss became {loss} at step {state.step + 1}; the last good checkpoint is kept"
                after_step(run, state, loss, bar)
                if distributed.any_flag(stop.received is not None, d, run.device):
                    save(run, state)
                    raise Interrupted(f"stopped by signal at step {state.step}; continue with the same command (or --resume)")
    finally:
        bar.close()
        if run.log is not None:
            run.log.close()
    return "completed", ""


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


def after_step(run: Run, state: TrainState, loss: float, bar: tqdm) -> None:
    """The mean loss logged every ``log_every`` steps, the validation split every ``eval_every`` (and
    at the last step), a checkpoint every ``checkpoint_every``."""
    tc, step = run.cfg.train, state.step
    bar.update(1)
    if step % tc.log_every == 0:
        state.last_loss = sum(state.losses) / len(state.losses)
        state.losses = []
        lr = run.optimizer.param_groups[0]["lr"]
        if run.log is not None:
            ckpt.append_metric(run.log, {"step": step, "loss": state.last_loss, "lr": lr})
        run.tracker.log(step, {"loss": state.last_loss, "lr": lr, "tokens_per_s": state.tokens / max(state.train_time, 1e-9)})
    if step % tc.eval_every == 0 or step == tc.steps:
        acc = validate(run, state)
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{acc:.3f}", tok_s=f"{state.tokens / state.train_time:.0f}")
    if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
        save(run, state)


def validate(run: Run, state: TrainState) -> float:
    """Accuracy on the validation split, logged; the weights kept when they are the best so far."""
    tc, step = run.cfg.train, state.step
    t1 = time.perf_counter()
    acc, val_loss = evaluate(run.net, run.splits["val"], tc.batch_size, tc.eval_batches, run.device, run.d, run.bf16)
    state.eval_time += time.perf_counter() - t1
    if acc > state.best_acc:
        state.best_acc, state.best_step, state.best_model = acc, step, copy.deepcopy(run.model.state_dict())
    if run.log is not None:
        ckpt.append_metric(run.log, {"step": step, "val_acc": acc, "val_loss": val_loss})
    run.tracker.log(step, {"val_acc": acc, "val_loss": val_loss})
    return acc


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
    if run.d.main:
        ckpt.save_checkpoint(run.run_dir / "checkpoint.pt", {
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "state": state.to_dict(),
            "rng_cpu": rng, "rng_cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None,
        })


def per_target(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row per target: a token-level task's logits [B, L, C] and labels [B, L] flattened to
    [B L, C] and [B L] (cross_entropy skips the IGNORE labels); a classifier's are returned as they are."""
    if labels.dim() == 1:
        return logits, labels
    return logits.flatten(0, 1), labels.flatten()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, split: Split, batch: int, max_batches: int, device: torch.device, d: distributed.Dist, bf16: bool
) -> Tuple[float, float]:
    """Accuracy and mean loss on the first ``max_batches`` batches of ``split`` (0 = all); for a
    token-level task, over the labelled positions of those rows."""
    model.eval()
    n = len(split) if max_batches == 0 else min(len(split), max_batches * batch)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    for b, start in enumerate(range(0, n, batch)):
        if b % d.world_size != d.rank:
            continue
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
    if run.d.main:
        if status == "completed":
            ckpt.save_checkpoint(run.run_dir / "best_model.pt", state.best_model)
        write_json_atomic(run.run_dir / "record.json", record.to_dict(), ckpt.RESUME)
        # after the record: a kill in between leaves a finished folder, never a checkpoint-less unfinished one
        if status == "completed":
            (run.run_dir / "checkpoint.pt").unlink(missing_ok=True)
    return record
