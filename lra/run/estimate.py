"""What a run will cost here, said before its data are read or generated when that is long.

The estimate runs the loop's own training step and evaluation (run/loop.py) on this machine, on
made-up rows of the task's shape (``Task.example_rows``: no data needed), with copies of the run's
model and optimizer, so the run is the run it would be:

1) warm-up: one training step on one row, not counted (kernels built, memory mapped, the
   optimizer's state made: seconds a run pays once, never per step);
2) one more one-row step, timed: it gives a rough estimate; a run that this puts ``ROUGH_MARGIN``
   times under ``NOTICE_S`` is timed no further (no line would print). Otherwise the timing gets a
   budget of ``BUDGET_SHARE`` of the rough estimate (``SLICE_S`` to ``MAX_SLICE_S`` seconds);
3) training: steps on the whole batch when ``REPEATS`` of them fit the budget, each size after one
   untimed step, repeated until the budget is timed, their mean; otherwise the same on as many rows
   as fit and on half as many, and the line through the two means extended to the batch (a part per
   step, a part per row), or the batch timed after all where that line shows it cheap;
4) evaluation: the same for evaluation batches, on a third of the budget; their mean per row.

seconds = steps left x step + (evaluations x validation rows + test rows) x forward per row

Steps timed after the warm-up are what the loop will see under the same load: one-time costs are
left out, and a busy machine slows the estimate as it slows the run (a mean, as the run's time is a
sum of its steps). ``scripts/estimate_check.py`` compares the estimate with real runs' times.

A run estimated at ``NOTICE_S`` seconds or more prints one line before its data are read or
generated (``--no-estimate`` silences it); on a CPU it names ``--preset cpu`` where the task has that
preset and it is the smaller protocol. A run of several processes (torchrun) makes no estimate.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from ..config import RunConfig
from ..format import fmt_duration
from ..tasks.base import SPLITS
from .checkpoint import TrainState
from .loop import evaluate, evaluation_due, train_step
from .setup import Prepared, Run, make_optimizer

# the line is printed for runs estimated to take at least this long here
NOTICE_S = 600
# seconds of timed training steps after the warm-up (and a third as many of evaluation): BUDGET_SHARE
# of the run's rough estimate, at least SLICE_S and at most MAX_SLICE_S
SLICE_S = 1.0
MAX_SLICE_S = 20.0
BUDGET_SHARE = 0.01
# at least this many timed steps (and evaluation batches), however slow one is
REPEATS = 2
# and at most this many, however fast
MAX_REPEATS = 20
# a run whose rough estimate (from one warm row) is this many times under NOTICE_S is not timed further
ROUGH_MARGIN = 4


@dataclass
class Estimate:
    """The timed parts of a run and how often the rest of the run repeats them."""

    # seconds of one training step of the whole batch, and of one row's forward pass in an evaluation
    step_s: float
    row_s: float
    # what is left: training steps, evaluations of the validation split, and its and the test split's rows
    steps: int
    evaluations: int
    val_rows: int
    test_rows: int

    @property
    def train_s(self) -> float:
        return self.steps * self.step_s

    @property
    def eval_s(self) -> float:
        """The validations' seconds (a record's eval_time_s; the final test is apart)."""
        return self.evaluations * self.val_rows * self.row_s

    @property
    def test_s(self) -> float:
        return self.test_rows * self.row_s

    @property
    def total_s(self) -> float:
        return self.train_s + self.eval_s + self.test_s


def stand_in(p: Prepared, rows: int) -> Run:
    """A run of copies of the prepared model and a fresh optimizer of the run's kind, on ``p.example``'s
    rows, ``rows`` to a batch: the loop's own step and evaluation run on it, and the run is left as it was."""
    net = copy.deepcopy(p.model).train()
    cfg = dataclasses.replace(p.cfg, train=dataclasses.replace(p.cfg.train, batch_size=rows))
    splits = {s: p.example for s in SPLITS}
    return Run(cfg, p.device, p.d, p.bf16, p.spec, splits, p.max_len, net, net, make_optimizer(net, p.cfg))


def timed(work: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``work()``, once the device has finished it."""
    begin = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - begin


def repeated(measure: Callable[[], float], budget: float) -> List[float]:
    """``measure()`` after one untimed call (a first call at a new size pays one-time costs), until
    ``budget`` seconds are timed and REPEATS taken (MAX_REPEATS at most)."""
    measure()
    times: List[float] = []
    while len(times) < MAX_REPEATS and (len(times) < REPEATS or sum(times) < budget):
        times.append(measure())
    return times


def at_batch(measure: Callable[[int], float], batch: int, rows: int, budget: float) -> float:
    """Seconds of ``measure(batch)``: timed at the batch when ``rows`` reaches it. Otherwise timed at
    ``rows`` and at half as many, and the line through the two means (a part per call, a part per row)
    extended to the batch; when that puts the batch within twice the time of ``rows`` (or of the
    budget's share), the batch itself is timed instead. Scaling one size's time by the rows alone would
    count the part per call (Python, synchronisation: most of a small step, more still on a busy
    machine) once per row; and a line from few rows to many multiplies their noise."""
    if rows >= batch:
        return statistics.fmean(repeated(lambda: measure(batch), budget))
    half = max(1, rows // 2)
    small = statistics.fmean(repeated(lambda: measure(half), budget / 3))
    large = statistics.fmean(repeated(lambda: measure(rows), budget / 3))
    line = large + max(0.0, (large - small) / (rows - half)) * (batch - rows)
    if line > max(budget / REPEATS, 2 * large):
        return line
    return statistics.fmean(repeated(lambda: measure(batch), budget / 3))


def estimate(p: Prepared, sizes: Dict[str, int], done: int, precise: bool = False) -> Estimate:
    """The rest of the run after ``done`` steps (its steps, its evaluations and the test), timed here on
    the loop's own step and evaluation. Unless ``precise``, a run that one warm row already shows to be
    far shorter than NOTICE_S gets that rough estimate, and no more of its time is spent."""
    tc = p.cfg.train
    left = range(done + 1, tc.steps + 1)
    # no training (train.steps = 0): the initial weights are validated once
    evaluations = sum(1 for s in left if evaluation_due(s, tc)) if tc.steps else 1
    val_rows = sizes["val"] if not tc.eval_batches else min(sizes["val"], tc.eval_batches * tc.batch_size)
    test_rows = sizes["test"] if not tc.test_batches else min(sizes["test"], tc.test_batches * tc.batch_size)
    batch = min(tc.batch_size // p.d.world_size, len(p.example))
    runs: Dict[int, Run] = {}
    state = TrainState(started_at="")

    def step(rows: int) -> float:
        run = runs.setdefault(rows, stand_in(p, rows))
        return timed(lambda: train_step(run, state), p.device)

    def evaluation(rows: int) -> float:
        net = runs.setdefault(rows, stand_in(p, rows)).net
        return timed(lambda: evaluate(net, p.example, rows, 1, p.device, p.d, p.bf16), p.device)

    with torch.random.fork_rng(devices=[p.device] if p.device.type == "cuda" else []):
        # 1) the warm-up (one-time costs), 2) one warm row: a rough estimate, scaled by the rows
        step(1)
        one = step(1)
        # a forward pass costs about a third of a training step
        rough = Estimate(one * batch, one / 3, len(left), evaluations, val_rows, test_rows)
        if not precise and rough.total_s * ROUGH_MARGIN < NOTICE_S:
            return rough
        # the longer the run, the longer it is timed, on rows sized so that REPEATS steps fill the budget
        budget = min(MAX_SLICE_S, max(SLICE_S, BUDGET_SHARE * rough.total_s))
        rows = int(min(batch, max(2, budget / REPEATS // max(one, 1e-6))))
        # 3) training steps, 4) evaluation batches
        step_s = at_batch(step, batch, rows, budget)
        row_s = at_batch(evaluation, batch, rows, budget / 3) / batch
    return Estimate(step_s, row_s, len(left), evaluations, val_rows, test_rows)


def notice(cfg: RunConfig, est: Estimate, device: torch.device) -> str:
    """The line to print before the data ("" when the run is estimated under NOTICE_S seconds)."""
    if est.total_s < NOTICE_S:
        return ""
    where = "on this CPU" if device.type == "cpu" else f"on {device}"
    line = (f"estimated {fmt_duration(est.total_s)} {where} for {est.steps:,} steps of {cfg.task}/{cfg.attn} "
            f"(preset {cfg.preset}): {fmt_duration(est.step_s)} a step and {fmt_duration(est.eval_s + est.test_s)} "
            "of evaluation, timed here on rows of the task's shape")
    if device.type == "cpu" and smaller_cpu_preset(cfg):
        line += f"; --preset cpu is the CPU-sized protocol for {cfg.task}"
    return line + "; --no-estimate skips this"


def smaller_cpu_preset(cfg: RunConfig) -> bool:
    """Whether the task has a ``cpu`` preset that trains on fewer tokens (steps x batch x length) than this run."""
    from ..config import CONFIG_DIR, read_yaml, resolve
    from ..tasks import get_task

    if cfg.preset == "cpu" or "cpu" not in (read_yaml(CONFIG_DIR / "tasks" / f"{cfg.task}.yaml").get("presets") or {}):
        return False
    task = get_task(cfg.task)
    cpu = resolve(cfg.task, cfg.attn, "cpu", [])

    def tokens(c: RunConfig) -> int:
        return c.train.steps * c.train.batch_size * task.max_len(c.data)

    return tokens(cpu) < tokens(cfg)
