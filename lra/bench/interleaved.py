"""Every backend's training step at one length in one process, in rounds (``lra-bench model
--interleaved``): each ratio to full attention comes from steps timed side by side, on the same
inputs, under the same load.

The process of one (length, batch), started by lra/bench/sweep.py:

1. Inputs: one batch of tokens, labels and row lengths drawn from the seed, shared by every backend,
   after one small step of every backend (what the process sets up once counts in no backend's memory).
2. Memory: for each backend in turn (``memory_order``: the hungriest at the previous length first),
   its model and optimizer built from the seed, then one training step. Its peak memory is that of
   the build and the step: the model, the optimizer state, the activations and the gradients. A
   backend that runs out of memory ends the process while a smaller batch is left to try (the sweep
   then halves the batch for every backend); at batch 1 it is recorded as ``oom``. A backend whose
   first step shows that its steps cannot fit its budget (``budget_s`` a backend and length) is
   recorded as ``timeout``; one that raises anything else as ``error``. The others go on.
3. Rounds: ``warmup - 1`` untimed rounds, then ``repeats`` timed ones, one training step of each
   backend a round in the order of ``backends`` (full first). A backend's time is the median of its
   rounds. A step that runs out of memory here ends the process like one in step 2: every backend
   holds its model and optimizer through the rounds, and the batch is one for all of them.

Memory on the CPU: before each backend the heaps' free pages go back to the kernel (malloc_trim) and
the process's peak resident set is reset (/proc/self/clear_refs); the backend's peak is the peak
resident set during its build and step minus the resident set before it. Blocks of 32 MiB and more
are mapped per use then (lra/machine/allocator.py), so the resident set follows what the tensors
need. On CUDA: max_memory_allocated minus memory_allocated before the build, the peak reset first.
Where the peak cannot be reset (not Linux), no peak is recorded.

The memory cap (``max_mem_gb``, CPU): each backend's build and first step, and each step of the
rounds, may bring the resident set to at most ``max_mem_gb`` above what the process held once set
up (lra/bench/measure.py ResidentCap). It is renewed before each, from what is resident then, so
address space that an earlier backend left mapped but not resident does not count; and the peak
resident set of each is checked against it after, so pages of the heap's holes that a backend
touches again count: whether a backend fits does not depend on the order the backends ran in.

Timing on the CPU keeps every freed block on the heap (no page faults once the heap has grown): the
hungriest backend takes one untimed step first, which grows it. Rounds that run out of memory that
way are all run again with big blocks mapped per use; each point's ``allocator`` says which setting
timed it.
"""
from __future__ import annotations

import gc
import json
import signal
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..files import write_atomic
from ..machine import allocator, load_average
from .measure import OverBudget, ResidentCap, is_oom, proc_status_mb, reset_peak_rss, summarize, timed
from .point import prepare
from .workloads import batch_inputs, build_model, kernel_of, train_step

Step = Callable[[], None]
Inputs = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """OverBudget in this (the main) thread once the block has run ``seconds``; raised when control
    next returns to Python, between the operators of a step."""
    def expire(_signum: int, _frame: Any) -> None:
        raise OverBudget(f"{what} ran past the budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class BackendMemory:
    """One backend's peak memory among several built one after another in this process."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline_mb = 0.0
        self.reset = False

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_mb = torch.cuda.memory_allocated(self.device) / 2**20
            return
        allocator.trim()
        self.reset = reset_peak_rss()
        self.baseline_mb = proc_status_mb("VmRSS")

    def result(self) -> Dict[str, Any]:
        if self.device.type == "cuda":
            peak: Optional[float] = torch.cuda.max_memory_allocated(self.device) / 2**20 - self.baseline_mb
            kind = "cuda_max_memory_allocated_minus_baseline"
        elif self.reset:
            peak, kind = proc_status_mb("VmHWM") - self.baseline_mb, "cpu_peak_rss_minus_baseline"
        else:
            peak, kind = None, "unmeasured: the peak resident set cannot be reset here (/proc/self/clear_refs)"
        return {"peak_mem_mb": peak, "memory_kind": kind, "baseline_mem_mb": self.baseline_mb}


def first_step(spec: Dict[str, Any], backend: str, inputs: Inputs, device: torch.device, dtype: torch.dtype,
               memory: BackendMemory, cap: ResidentCap) -> Tuple[Step, Dict[str, Any]]:
    """Build ``backend``'s model and optimizer from the seed and take one training step, under the
    backend's budget and the memory cap; its step function and what the step measured."""
    memory.start()
    cap.renew()
    begin = time.perf_counter()
    with time_limit(spec["budget_s"], f"{backend}'s model and first step"):
        torch.manual_seed(spec["seed"])
        point = {**spec, "backend": backend, "attn_options": spec["attn_options"].get(backend, {})}
        model = build_model(point, device)
        step = train_step(model, point, *inputs, device, dtype)
        took = timed(step, device)
    cap.check(f"{backend}'s model and first step")
    return step, {"first_step_s": took, "build_s": time.perf_counter() - begin - took, **memory.result()}


# the first-use warm-up's length and batch: every code path, one-time buffers and kernel libraries
# set up before any backend's memory is measured, at a negligible cost
WARM_LENGTH, WARM_BATCH = 256, 1


def warm_up(spec: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
    """One small training step of every backend, so that what a process sets up once (thread pools,
    oneDNN and torch caches, the C kernel libraries loaded) counts in no backend's memory. A backend
    that fails here is measured as it comes below."""
    small = {**spec, "length": min(spec["length"], WARM_LENGTH), "batch": WARM_BATCH}
    inputs = batch_inputs(small, device)
    for name in spec["backends"]:
        point = {**small, "backend": name, "attn_options": spec["attn_options"].get(name, {})}
        try:
            with time_limit(spec["budget_s"], f"{name}'s warm-up"):
                train_step(build_model(point, device), point, *inputs, device, dtype)()
        except Exception:  # noqa: BLE001 - the backend's own step at the point's size says what fails
            pass
    gc.collect()


def failure(err: Exception) -> Dict[str, Any]:
    """The status of a backend whose step raised ``err``: oom, timeout, or error (its traceback goes
    to the process's log); the other backends go on."""
    if isinstance(err, OverBudget):
        return {"status": "timeout", "message": str(err)}
    if is_oom(err):
        return {"status": "oom", "message": str(err).strip().splitlines()[0][:300]}
    traceback.print_exc()
    return {"status": "error", "message": f"{type(err).__name__}: {err}".splitlines()[0][:300]}


def over_budget(spec: Dict[str, Any], first_s: float) -> Optional[Dict[str, Any]]:
    """A timeout when the backend's steps still to come, at the pace of its first, pass its budget."""
    steps = spec["warmup"] - 1 + spec["repeats"]
    if first_s * (1 + steps) <= spec["budget_s"]:
        return None
    return {"status": "timeout",
            "message": f"its first step took {first_s:.1f} s: {steps} more would pass the budget of "
                       f"{spec['budget_s']:.0f} s a backend and length"}


class Halve(Exception):
    """A backend's step ran out of memory in the rounds at a batch that can be halved."""

    def __init__(self, backend: str, status: Dict[str, Any]):
        super().__init__(f"{backend}: {status['message']}")
        self.backend, self.status = backend, status


def rounds(steps: Dict[str, Step], spec: Dict[str, Any], device: torch.device, failed: Dict[str, Dict[str, Any]],
           kept: bool, save: Callable[[Dict[str, List[float]]], None], cap: ResidentCap) -> Dict[str, List[float]]:
    """The untimed then the timed rounds of every backend not ``failed``, each step under the memory
    cap; a backend that fails in them is added to ``failed``. Out of memory with every freed block
    ``kept`` is raised as it is; out of memory otherwise, while the batch can be halved, as Halve."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for number in range(spec["warmup"] - 1 + spec["repeats"]):
        for name, step in steps.items():
            if name in failed:
                continue
            try:
                cap.renew()
                with time_limit(spec["budget_s"], f"a step of {name}"):
                    took = timed(step, device)
                cap.check(f"a step of {name}")
            except Exception as err:  # noqa: BLE001 - a failure is the backend's status
                if kept and is_oom(err):
                    raise
                if is_oom(err) and spec.get("halve_on_oom"):
                    raise Halve(name, failure(err)) from None
                failed[name] = failure(err)
                continue
            if number >= spec["warmup"] - 1:
                times[name].append(took)
        save(times)
    return times


def timed_rounds(steps: Dict[str, Step], spec: Dict[str, Any], device: torch.device, failed: Dict[str, Dict[str, Any]],
                 hungriest: Optional[str], save: Callable[[Dict[str, List[float]]], None], cap: ResidentCap
                 ) -> Tuple[Dict[str, List[float]], str]:
    """The rounds with every freed block kept (the CPU; ``hungriest`` takes one untimed step first,
    which grows the heap), again with big blocks mapped if that runs out of memory; the times and
    the allocator setting that timed them."""
    kept = device.type == "cpu" and allocator.keep_all_freed_memory()
    times = None
    try:
        if kept and hungriest is not None:
            cap.renew()
            timed(steps[hungriest], device)
            cap.check(f"a step of {hungriest}")
        times, setting = rounds(steps, spec, device, failed, kept, save, cap), allocator.setting_now()
    except Exception as err:  # noqa: BLE001 - running out of memory is timed again below, the rest re-raised
        if not (kept and is_oom(err)):
            raise
    finally:
        if kept:
            allocator.return_freed_memory()
    if times is None:  # outside the except block, so that the failed step's tensors are freed
        gc.collect()
        times = rounds(steps, spec, device, failed, False, save, cap)
        setting = allocator.setting_now() + " (every freed block kept ran out of memory)"
    return times, setting


def run_interleaved(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Measure every backend of ``spec["backends"]`` at one length and batch; saved to the spec's
    result_path after each backend's first step and each round, so a killed process leaves them."""
    device, dtype = prepare(spec)
    cap = ResidentCap(spec["max_mem_gb"] if device.type == "cpu" else None)
    start_load = load_average()
    warm_up(spec, device, dtype)
    inputs = batch_inputs(spec, device)
    points: Dict[str, Dict[str, Any]] = {name: {"status": "pending"} for name in spec["backends"]}

    def save(status: str, **extra: Any) -> Dict[str, Any]:
        result = {"status": status, "batch": spec["batch"], "points": points, "load_average": start_load, **extra}
        write_atomic(Path(spec["result_path"]), json.dumps(result).encode())
        return result

    steps: Dict[str, Step] = {}
    failed: Dict[str, Dict[str, Any]] = {}
    memory = BackendMemory(device)
    for name in spec.get("memory_order") or spec["backends"]:
        points[name] = {"status": "running", "kernel": kernel_of(name, device, spec["attn_options"].get(name, {}))}
        status = None
        try:
            steps[name], measured = first_step(spec, name, inputs, device, dtype, memory, cap)
        except Exception as err:  # noqa: BLE001 - a failure is the backend's status
            status = failure(err)
        if status is None:
            points[name].update(measured)
            status = over_budget(spec, measured["first_step_s"])
            if status is not None:
                del steps[name]
        if status is not None:
            gc.collect()
            points[name].update(status)
            failed[name] = status
            if status["status"] == "oom" and spec.get("halve_on_oom"):
                # the sweep tries every backend again at half the batch
                return save("oom", halve=name, message=f"{name}: {status['message']}")
        save("running")
    hungriest = max((n for n in steps), key=lambda n: points[n].get("peak_mem_mb") or 0.0, default=None)

    def save_times(times: Dict[str, List[float]]) -> None:
        for name, t in times.items():
            points[name]["times_s"] = [round(x, 6) for x in t]
        save("running")

    ordered = {name: steps[name] for name in spec["backends"] if name in steps}
    try:
        times, setting = timed_rounds(ordered, spec, device, failed, hungriest, save_times, cap)
    except Halve as halt:
        points[halt.backend].update(halt.status)
        return save("oom", halve=halt.backend, message=str(halt))
    for name in spec["backends"]:
        point = points[name]
        point.pop("times_s", None)
        if name in failed:
            point.update(failed[name])
        elif times.get(name):
            point.update({"status": "ok", "train": {**summarize(times[name]), "allocator": setting}})
        point["estimated"] = False
    return save("ok", allocator=setting, load_average_end=load_average())
