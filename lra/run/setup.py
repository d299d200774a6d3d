"""What a training run is built from before its first step: the device and processes and the model
(checked against the attention contract on its first call), then the data and the optimizer."""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, Iterable, Optional, Tuple

import numpy as np
import torch

from attentions import get_attention
from attentions.check import output_problem

from . import distributed
from ..machine.allocator import keep_freed_memory
from ..tasks.augment import check_augment
from ..config import RunConfig, fill_optimizer
from ..errors import UserError
from .init_from import InitFrom, match, read_source
from ..model import LRAModel
from ..tasks import Split, TaskSpec, get_task
from ..tasks.base import Task, quiet_bars
from .trackers import Tracker


@dataclass
class Run:
    """Everything the loop works with; ``run_dir`` and ``log`` are filled once the folder is claimed."""

    cfg: RunConfig
    device: torch.device
    d: distributed.Dist
    bf16: bool
    spec: TaskSpec
    splits: Dict[str, Split]
    max_len: int
    model: LRAModel
    # the model as the loop calls it: wrapped in DistributedDataParallel under torchrun
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    run_dir: Optional[Path] = None
    # rank 0's metrics.jsonl (None on the other ranks)
    log: Optional[IO[bytes]] = None
    # the run whose weights a fresh start loads (--init-from), matched to the model
    init: Optional[InitFrom] = None
    # rank 0's experiment tracker (lra/run/trackers.py; a no-op on the other ranks and for tracker=none)
    tracker: Tracker = field(default_factory=Tracker)
    # the step of the last checkpoint saved or restored (None: none yet)
    saved_step: Optional[int] = None

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.max_len * (2 if self.spec.dual else 1)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name} but no CUDA device is visible; use train.device=cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device {name!r} is not a device; valid: auto, cpu, cuda, cuda:N")


def to_device(split: Split, idx: np.ndarray, device: torch.device) -> Tuple[torch.Tensor, ...]:
    tokens = torch.from_numpy(np.ascontiguousarray(split.tokens[idx]).astype(np.int64)).to(device)
    lengths = torch.from_numpy(np.ascontiguousarray(split.lengths[idx]).astype(np.int64)).to(device)
    labels = torch.from_numpy(np.ascontiguousarray(split.labels[idx]).astype(np.int64)).to(device)
    return tokens, lengths, labels


@dataclass
class Prepared:
    """What a run is built from before its data: the device and processes, the task and the model,
    its backend checked on made-up rows of the task's shape (``example``)."""

    cfg: RunConfig
    device: torch.device
    d: distributed.Dist
    bf16: bool
    task: Task
    spec: TaskSpec
    max_len: int
    model: LRAModel
    example: Split
    # the run whose weights a fresh start loads (--init-from), read and checked
    source: Optional[Any] = None


def prepare(cfg: RunConfig) -> Prepared:
    """Device and processes, the model, and its backend checked on its first call: everything that
    needs no data, so that a long run can say what it costs (run/estimate.py) before the data are
    read or generated, and a broken backend is named before either."""
    tc = cfg.train
    device = pick_device(tc.device)
    d = distributed.setup(device)
    if d.enabled and device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
    if tc.batch_size % d.world_size:
        raise UserError(f"train.batch_size ({tc.batch_size}) must be divisible by the {d.world_size} processes")
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if device.type == "cpu":
        torch.set_flush_denormal(tc.flush_denormal)  # False where the CPU has no such mode: nothing to flush
    keep_freed_memory()
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")

    # the source of --init-from is checked before any data is read or generated
    source = read_source(cfg.init_from, cfg) if cfg.init_from else None
    task = get_task(cfg.task)
    spec = task.spec_for(cfg.data)
    if spec.padded and not get_attention(cfg.attn).supports_mask:
        raise UserError(f"attention {cfg.attn!r} cannot honour a padding mask, and task {cfg.task!r} is padded")
    check_augment(tc.augment, spec)
    max_len = task.max_len(cfg.data)

    torch.manual_seed(cfg.seed)
    model = LRAModel(
        cfg.model, cfg.attn, cfg.attn_options, spec.vocab_size, spec.num_classes, max_len, spec.dual, spec.padded,
        spec.token_level,
    ).to(device)
    # an option past the sequence (a block, window or bucket longer than max_len) was clamped: said once
    if d.main:
        for line in model.encoder.blocks[0].attn.notices:
            print(f"lra-run: notice: {line}", file=sys.stderr, flush=True)
    # a batch of made-up rows: the backend's check takes two, the estimate up to the batch
    example = task.example_rows(cfg.data, max(2, tc.batch_size // d.world_size))
    check_backend(model, example, device, bf16, cfg.attn)
    return Prepared(cfg, device, d, bf16, task, spec, max_len, model, example, source)


def setup(p: Prepared, quiet: bool) -> Run:
    """The data (rank 0 generates or caches it first) and the optimizer, around the prepared model."""
    cfg, d = p.cfg, p.d
    with quiet_bars(quiet):
        # rank 0 generates or caches the data first; a problem with them is its one line
        splits = distributed.on_main(lambda: p.task.load(cfg.data), d) or p.task.load(cfg.data)
    optimizer = make_optimizer(p.model, cfg)
    net = torch.nn.parallel.DistributedDataParallel(p.model) if d.enabled else p.model
    init = None if p.source is None else match(p.source, p.model)
    return Run(cfg, p.device, d, p.bf16, p.spec, splits, p.max_len, p.model, net, optimizer, init=init)


def adamw(parameters: Iterable[torch.nn.Parameter], **options: Any) -> torch.optim.AdamW:
    """torch's AdamW with ``options``, in its fused form (one kernel over every parameter) where torch
    has one for the parameters' device and dtype, else the loop over the parameters: a step of the
    LRA encoder's 32 parameters (2 layers, width 64) takes 0.24 ms fused against 1.09 ms as the loop
    on the CPU (Intel Xeon, 2 threads). The two equal each other to float rounding."""
    params = list(parameters)
    try:
        return torch.optim.AdamW(params, fused=True, **options)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **options)


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """torch's AdamW with the run's betas and eps (train.beta1, beta2, eps: those of train.optimizer
    unless set, config.OPTIMIZER_VALUES). ``lra`` is the LRA JAX train scripts' flax Adam
    (lra_benchmarks/*/train.py create_optimizer): it takes lr * weight_decay * w from every weight after
    the Adam step, computed from the weights before it; torch's AdamW multiplies them by
    (1 - lr * weight_decay) first, the same update."""
    tc = fill_optimizer(dataclasses.asdict(cfg.train))
    return adamw(model.parameters(), lr=tc["lr"], betas=(tc["beta1"], tc["beta2"]), eps=tc["eps"],
                 weight_decay=tc["weight_decay"])


class BrokenBackend(Exception):
    """An attention's output broke the contract (attentions.check.output_problem)."""


def check_backend(model: LRAModel, split: Split, device: torch.device, bf16: bool, attn: str) -> None:
    """Run the model once on two rows of ``split`` and check every attention call's output: its shape,
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
