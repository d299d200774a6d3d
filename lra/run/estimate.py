"""What a run will cost here, said before its first step when that is long.

The estimate times this run's own model on this machine, as lra-bench estimates its long points
(lra/bench/estimate.py): a slice is timed and scaled linearly. Here the slice is rows of the batch
of the first step: one row first, then as many as fit ``SLICE_S`` seconds (the whole batch when it
fits), forward + backward; its time is scaled to the batch and multiplied by the steps left.
Evaluations add a forward pass over their rows (forward time per row measured on the same slice).
The weights, gradients and random state are left as they were, so the run is the run it would be.

A run estimated at ``NOTICE_S`` seconds or more prints one line before training (``--no-estimate``
silences it); on a CPU it names ``--preset cpu`` for the tasks that have it. A run of several
processes (torchrun) makes no estimate.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..format import fmt_duration
from .checkpoint import TrainState
from .loop import batch_indices, per_target
from .setup import Run, to_device

# the line is printed for runs estimated to take at least this long here
NOTICE_S = 600
# seconds of timed rows before scaling to the batch (after one warm-up row)
SLICE_S = 0.5


def timed_rows(run: Run, rows: np.ndarray, backward: bool) -> float:
    """Seconds of one forward (and backward) of the model on training ``rows``."""
    tokens, lengths, labels = to_device(run.splits["train"], rows, run.device)
    begin = time.perf_counter()
    with torch.autocast(device_type=run.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        logits = run.model(tokens, lengths)
    if backward:
        logits, labels = per_target(logits, labels)
        F.cross_entropy(logits.float(), labels).backward()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return time.perf_counter() - begin


def step_times(run: Run) -> Tuple[float, float]:
    """(seconds of one training step, seconds of a forward pass per row), from a slice of step 0's batch."""
    local = run.cfg.train.batch_size // run.d.world_size
    batch = batch_indices(0, len(run.splits["train"]), run.cfg.train.batch_size, run.cfg.seed)[:local]
    params: List[torch.nn.Parameter] = list(run.model.parameters())
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        try:
            # one row: the warm-up (kernels built, memory mapped), and the size of the slice
            first = timed_rows(run, batch[:1], backward=True)
            rows = int(min(len(batch), max(1, SLICE_S // max(first, 1e-6))))
            train = timed_rows(run, batch[:rows], backward=True) if first < SLICE_S else first
            with torch.no_grad():
                forward = timed_rows(run, batch[:rows], backward=False)
        finally:
            for p in params:
                p.grad = None
    return train * len(batch) / rows, forward / rows


def run_seconds(run: Run, state: TrainState) -> float:
    """The seconds the rest of the run should take here: the steps left, the evaluations and the test."""
    tc = run.cfg.train
    step_s, row_s = step_times(run)
    left = range(state.step + 1, tc.steps + 1)
    evaluations = sum(1 for s in left if s % tc.eval_every == 0 or s == tc.steps)
    val, test = len(run.splits["val"]), len(run.splits["test"])
    val_rows = val if not tc.eval_batches else min(val, tc.eval_batches * tc.batch_size)
    test_rows = test if not tc.test_batches else min(test, tc.test_batches * tc.batch_size)
    return len(left) * step_s + (evaluations * val_rows + test_rows) * row_s / run.d.world_size


def notice(run: Run, state: TrainState) -> str:
    """The line to print before training ("" when the run is estimated under NOTICE_S seconds)."""
    from ..config import CONFIG_DIR, read_yaml

    seconds = run_seconds(run, state)
    if seconds < NOTICE_S:
        return ""
    cfg = run.cfg
    where = "on this CPU" if run.device.type == "cpu" else f"on {run.device}"
    line = (f"estimated {fmt_duration(seconds)} {where} for {cfg.train.steps - state.step:,} steps of "
            f"{cfg.task}/{cfg.attn} (preset {cfg.preset}), from one step timed here")
    presets = read_yaml(CONFIG_DIR / "tasks" / f"{cfg.task}.yaml").get("presets") or {}
    if run.device.type == "cpu" and cfg.preset != "cpu" and "cpu" in presets:
        line += f"; --preset cpu is the CPU-sized protocol for {cfg.task}"
    return line + "; --no-estimate skips this"
