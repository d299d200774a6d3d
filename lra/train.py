"""The one trainer for every task and backend: ``train(cfg) -> result record``.

AdamW, linear warmup then linear decay, gradient clipping, evaluation every ``eval_every`` steps,
the best-validation weights tested at the end. The batch of step ``s`` is a pure function of
(seed, s), so a resumed run sees exactly the batches it would have seen. Checkpoints are written
every ``checkpoint_every`` steps and on SIGTERM / SIGINT; under torchrun the same loop runs with
DistributedDataParallel and rank 0 writes every file.
"""
from __future__ import annotations

import contextlib
import copy
import math
import resource
import signal
import time
from functools import lru_cache
from typing import IO, Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from attentions import get_attention
from attentions.check import output_problem

from . import checkpoint as ckpt
from . import distributed
from .augment import augment, check_augment
from .machine import environment, load_average
from .config import RunConfig, TrainConfig
from .errors import UserError
from .model import LRAModel
from .files import write_json_atomic
from .record import SCHEMA_VERSION, now
from .tasks import Split, get_task
from .tasks.base import quiet_bars


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived; a checkpoint was saved and the run can be resumed."""


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


def to_device(split: Split, idx: np.ndarray, device: torch.device) -> Tuple[torch.Tensor, ...]:
    tokens = torch.from_numpy(np.ascontiguousarray(split.tokens[idx]).astype(np.int64)).to(device)
    lengths = torch.from_numpy(np.ascontiguousarray(split.lengths[idx]).astype(np.int64)).to(device)
    labels = torch.from_numpy(np.ascontiguousarray(split.labels[idx]).astype(np.int64)).to(device)
    return tokens, lengths, labels


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, split: Split, batch: int, max_batches: int, device: torch.device, d: distributed.Dist, bf16: bool
) -> Tuple[float, float]:
    """Accuracy and mean loss on the first ``max_batches`` batches of ``split`` (0 = all)."""
    model.eval()
    n = len(split) if max_batches == 0 else min(len(split), max_batches * batch)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    for b, start in enumerate(range(0, n, batch)):
        if b % d.world_size != d.rank:
            continue
        tokens, lengths, labels = to_device(split, np.arange(start, min(start + batch, n)), device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens, lengths)
        sums += torch.stack([
            (logits.argmax(-1) == labels).sum().double(),
            F.cross_entropy(logits.float(), labels, reduction="sum").double(),
            torch.tensor(float(len(labels)), dtype=torch.float64, device=device),
        ])
    correct, loss, count = distributed.all_sum(sums, d).tolist()
    model.train()
    return correct / count, loss / count


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name} but no CUDA device is visible; use train.device=cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device {name!r} is not a device; valid: auto, cpu, cuda, cuda:N")


def peak_memory_mb(device: torch.device) -> Tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_peak_rss"


class BrokenBackend(Exception):
    """An attention's output broke the contract (attentions.check.output_problem)."""


def check_backend(model: LRAModel, split: Split, device: torch.device, bf16: bool, attn: str) -> None:
    """Run the model once on two training rows and check every attention call's output: its shape,
    dtype and finiteness. A broken backend (often a plugin) is named here, not deep inside the model."""
    tokens, lengths, _ = to_device(split, np.arange(min(2, len(split))), device)

    def inspect(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], out: Any) -> None:
        q, mask = args[0], kwargs.get("mask", args[3] if len(args) > 3 else None)
        # under autocast an op may legitimately give float32 where bfloat16 went in
        problem = output_problem(out, q, mask, dtypes=(q.dtype, torch.float32) if bf16 else None)
        if problem:
            raise BrokenBackend(problem)

    hooks = [block.attn.register_forward_hook(inspect, with_kwargs=True) for block in model.encoder.blocks]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                model(tokens, lengths)
    except BrokenBackend as err:
        raise UserError(f"attention {attn!r} broke the contract on its first call: {err}; "
                        "`lra-check-attn --name NAME` (with the backend's file) runs the whole contract battery")
    finally:
        for hook in hooks:
            hook.remove()
        model.train()


def new_state(started_at: str) -> Dict[str, Any]:
    """Everything a resume needs besides the model, optimizer and RNG (checkpoint.STATE_KEYS)."""
    return {
        "step": 0, "best_acc": -1.0, "best_step": 0, "best_model": None, "train_time": 0.0,
        "eval_time": 0.0, "tokens": 0, "peak_mb": 0.0, "last_loss": float("nan"), "started_at": started_at,
        # the losses since the last logged mean, and the bytes of metrics.jsonl written so far
        "losses": [], "log_bytes": 0,
    }


def resume_or_start(
    run_dir: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig, d: distributed.Dist,
    device: torch.device, started_at: str,
) -> Tuple[Dict[str, Any], Optional[IO[bytes]]]:
    """The run's state and its metrics log (rank 0's): from the checkpoint when there is one, else new."""
    path = run_dir / "checkpoint.pt"
    saved = ckpt.load_checkpoint(path)
    if saved is None:
        torch.manual_seed(cfg.seed * 1000 + d.rank + 1)
        state = new_state(started_at)
    else:
        ckpt.restore_weights(path, saved, model, optimizer)
        state = saved["state"]
        rng = saved["rng_cpu"]
        torch.set_rng_state(rng[d.rank] if d.rank < len(rng) else rng[0])
        if device.type == "cuda" and saved["rng_cuda"] is not None:
            torch.cuda.set_rng_state(saved["rng_cuda"].cpu())
    covered = None if saved is None else state["log_bytes"]
    return state, ckpt.open_metrics(run_dir / "metrics.jsonl", covered) if d.main else None


def claim_run_dir(cfg: RunConfig, resume: bool, d: distributed.Dist, held: contextlib.ExitStack) -> Any:
    """Rank 0 chooses and locks the run folder (unlocked when ``held`` closes); every rank gets its path."""
    run_dir = None
    if d.main:
        run_dir, lock = ckpt.claim_run_dir(cfg, resume)
        held.callback(lock.release)
    if d.enabled:
        holder = [run_dir]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    assert run_dir is not None
    return run_dir


def train(cfg: RunConfig, resume: bool = False, quiet: bool = False) -> Dict[str, Any]:
    """Train ``cfg.attn`` on ``cfg.task``; write and return the result record.

    The run folder is locked from when it is chosen until the record is written (or the run stops).
    """
    with contextlib.ExitStack() as held:
        return run_training(cfg, resume, quiet, held)


def run_training(cfg: RunConfig, resume: bool, quiet: bool, held: contextlib.ExitStack) -> Dict[str, Any]:
    started_at = now()
    tc = cfg.train
    device = pick_device(tc.device)
    d = distributed.setup(device)
    if d.enabled and device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
    if tc.batch_size % d.world_size:
        raise UserError(f"train.batch_size ({tc.batch_size}) must be divisible by the {d.world_size} processes")
    if tc.threads:
        torch.set_num_threads(tc.threads)
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")

    task = get_task(cfg.task)
    spec = task.spec
    if spec.padded and not get_attention(cfg.attn).supports_mask:
        raise UserError(f"attention {cfg.attn!r} cannot honour a padding mask, and task {cfg.task!r} is padded")
    check_augment(tc.augment, spec)
    # rank 0 generates or caches the data first; the others then read the cache
    with quiet_bars(quiet):
        splits = task.load(cfg.data) if d.main else None
        distributed.barrier(d)
        splits = splits or task.load(cfg.data)
    max_len = task.max_len(cfg.data)
    train_split, val_split, test_split = splits["train"], splits["val"], splits["test"]

    torch.manual_seed(cfg.seed)
    model = LRAModel(
        cfg.model, cfg.attn, cfg.attn_options, spec.vocab_size, spec.num_classes, max_len, spec.dual, spec.padded
    ).to(device)
    check_backend(model, train_split, device, bf16, cfg.attn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    budget = model.encoder.blocks[0].attn.budget()

    run_dir = claim_run_dir(cfg, resume, d, held)
    state, log = resume_or_start(run_dir, model, optimizer, cfg, d, device, started_at)

    net = torch.nn.parallel.DistributedDataParallel(model) if d.enabled else model

    def save() -> None:
        state["peak_mb"] = max(state["peak_mb"], peak_memory_mb(device)[0])
        rng = [torch.get_rng_state()]
        if d.enabled:
            gathered: list = [None] * d.world_size
            torch.distributed.all_gather_object(gathered, rng[0])
            rng = gathered
        if log is not None:
            state["log_bytes"] = log.tell()
        if d.main:
            ckpt.save_checkpoint(run_dir / "checkpoint.pt", {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state, "rng_cpu": rng,
                "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            })

    stop = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    tokens_per_step = tc.batch_size * max_len * (2 if spec.dual else 1)
    local = tc.batch_size // d.world_size
    bar = tqdm(total=tc.steps, initial=state["step"], desc=f"{cfg.task}/{cfg.attn}", disable=quiet or not d.main)
    status, message = "completed", ""
    try:
        while state["step"] < tc.steps:
            step = state["step"]
            t0 = time.perf_counter()
            rows = slice(d.rank * local, (d.rank + 1) * local)
            idx = batch_indices(step, len(train_split), tc.batch_size, cfg.seed)[rows]
            tokens, lengths, labels = to_device(train_split, idx, device)
            tokens = augment(tc.augment, tokens, spec, cfg.seed, step, tc.batch_size, rows)
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = net(tokens, lengths)
            loss = F.cross_entropy(logits.float(), labels)
            # the global batch's mean loss, and whether any process saw a non-finite one
            stats = distributed.all_sum(torch.stack([loss.detach(), (~torch.isfinite(loss)).float()]), d)
            global_loss = stats[0].item() / d.world_size
            if stats[1].item() > 0:
                status = "diverged"
                message = f"loss became {global_loss} at step {step + 1}; the last good checkpoint is kept"
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            state["train_time"] += time.perf_counter() - t0
            state["tokens"] += tokens_per_step
            state["step"] = step = step + 1
            state["losses"].append(global_loss)
            bar.update(1)

            if step % tc.log_every == 0:
                state["last_loss"] = sum(state["losses"]) / len(state["losses"])
                state["losses"] = []
                if log is not None:
                    ckpt.append_metric(log, {"step": step, "loss": state["last_loss"], "lr": lr})
            if step % tc.eval_every == 0 or step == tc.steps:
                t1 = time.perf_counter()
                acc, val_loss = evaluate(net, val_split, tc.batch_size, tc.eval_batches, device, d, bf16)
                state["eval_time"] += time.perf_counter() - t1
                if acc > state["best_acc"]:
                    state.update(best_acc=acc, best_step=step, best_model=copy.deepcopy(model.state_dict()))
                if log is not None:
                    ckpt.append_metric(log, {"step": step, "val_acc": acc, "val_loss": val_loss})
                bar.set_postfix(loss=f"{global_loss:.3f}", val=f"{acc:.3f}", tok_s=f"{state['tokens'] / state['train_time']:.0f}")
            if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
                save()
            if distributed.any_flag(stop["signal"] is not None, d, device):
                save()
                raise Interrupted(f"stopped by signal at step {step}; continue with the same command (or --resume)")
    finally:
        bar.close()
        if log is not None:
            log.close()
        for s, handler in old_handlers.items():
            signal.signal(s, handler)

    # how busy the machine was while training: the train time of two runs compares only at similar loads
    load = load_average()
    if state["losses"]:
        state["last_loss"] = sum(state["losses"]) / len(state["losses"])
    if status == "completed" and state["best_model"] is not None:
        model.load_state_dict(state["best_model"])
        test_acc, _ = evaluate(net, test_split, tc.batch_size, tc.test_batches, device, d, bf16)
    else:
        test_acc = float("nan")
    mem, mem_kind = peak_memory_mb(device)
    n_test = len(test_split) if not tc.test_batches else min(len(test_split), tc.test_batches * tc.batch_size)
    counts = np.bincount(np.asarray(test_split.labels[:n_test]), minlength=spec.num_classes)
    record = {
        "schema": SCHEMA_VERSION, "status": status, "run_name": run_dir.name, "task": cfg.task, "attn": cfg.attn,
        "preset": cfg.preset, "seed": cfg.seed, "config": cfg.to_dict(), "attn_budget": budget, "steps": state["step"],
        "best_step": state["best_step"], "val_acc": state["best_acc"] if state["best_acc"] >= 0 else None,
        "test_acc": None if math.isnan(test_acc) else test_acc, "majority_acc": float(counts.max() / counts.sum()),
        "test_examples": n_test,
        "final_train_loss": None if math.isnan(state["last_loss"]) else state["last_loss"],
        "train_time_s": round(state["train_time"], 3), "eval_time_s": round(state["eval_time"], 3),
        "tokens_per_s": state["tokens"] / state["train_time"] if state["train_time"] else None,
        "peak_memory_mb": round(max(mem, state["peak_mb"]), 1), "memory_kind": mem_kind, "params": params,
        **environment(device), "world_size": d.world_size, "precision": "bf16" if bf16 else "fp32",
        "started_at": state["started_at"], "finished_at": now(), "message": message, "load_average": load,
    }
    if d.main:
        if status == "completed":
            ckpt.save_checkpoint(run_dir / "best_model.pt", state["best_model"])
        write_json_atomic(run_dir / "record.json", record)
        # after the record: a kill in between leaves a finished folder, never a checkpoint-less unfinished one
        if status == "completed":
            (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    record["run_dir"] = str(run_dir)
    distributed.teardown(d)
    return record
