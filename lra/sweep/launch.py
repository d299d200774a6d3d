"""Putting a sweep's runs on submitit's executors.

    slurm   submitit's SLURM executor: the runs to do go out as one job array (``--array-parallelism``
            caps how many run at once); the command returns once they are queued
    local   this machine: as many runs at once as ``--parallel``, each pinned to its own share of the
            cores with as many torch threads; the command waits, with one progress bar over the runs
    debug   submitit's in-process executor, one run after another in this process (for tests)

A run that is finished, diverged, running or still queued is never submitted again; every other one
(not started, stopped part-way, failed) is, and lra-run continues a stopped one where it stopped.
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import submitit
from tqdm import tqdm

from ..errors import UserError
from ..format import clip
from .folder import SweepFolder
from .job import RunJob
from .status import find, sweep_status

EXECUTORS = ("local", "slurm", "debug")
# how often a job may hit its time limit and be requeued (submitit's default, 3, would end a run that
# needs four job lengths); a pre-emption is not counted
MAX_TIMEOUTS = 1000


@dataclass
class SlurmOptions:
    partition: Optional[str] = None
    gpus_per_run: int = 0
    cpus_per_run: int = 1
    mem_gb: Optional[float] = None
    # minutes a job may run before SLURM stops it (it is requeued and resumes)
    time_min: int = 24 * 60
    array_parallelism: int = 256
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # further submitit SLURM parameters, e.g. {"exclude": "node3", "signal_delay_s": 120}
    extra: Dict[str, Any] = field(default_factory=dict)

    def parameters(self) -> Dict[str, Any]:
        values: Dict[str, Any] = {
            "timeout_min": self.time_min, "cpus_per_task": self.cpus_per_run, "tasks_per_node": 1, "nodes": 1,
            "slurm_array_parallelism": self.array_parallelism,
        }
        if self.gpus_per_run:
            values["gpus_per_node"] = self.gpus_per_run
        if self.mem_gb is not None:
            values["mem_gb"] = self.mem_gb
        for name in ("partition", "account", "qos", "constraint"):
            if getattr(self, name) is not None:
                values[f"slurm_{name}"] = getattr(self, name)
        values.update({f"slurm_{k}": v for k, v in self.extra.items()})
        return values


def slurm_executor(folder: SweepFolder, options: SlurmOptions) -> submitit.AutoExecutor:
    """submitit's SLURM executor with ``options``; an option submitit does not know is a UserError."""
    executor = submitit.AutoExecutor(folder=str(folder.submitit_dir / "%j"), cluster="slurm",
                                     slurm_max_num_timeout=MAX_TIMEOUTS)
    try:
        executor.update_parameters(name=f"lra-sweep-{folder.out.name}", **options.parameters())
    except (ValueError, TypeError, NameError) as err:
        raise UserError(f"a SLURM option submitit does not take: {clip(str(err), 300)}")
    return executor


def to_submit(folder: SweepFolder) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """The runs to submit now, and how many of the others are in each state."""
    statuses = sweep_status(folder)
    todo: List[Dict[str, Any]] = []
    left: Dict[str, int] = {}
    for run in folder.runs():
        status = find(statuses, run["key"])
        assert status is not None
        if status.state in ("finished", "diverged", "running") or status.detail.startswith("queued"):
            left[status.state] = left.get(status.state, 0) + 1
        else:
            todo.append(run)
    return todo, left


def submit_slurm(folder: SweepFolder, runs: List[Dict[str, Any]], options: SlurmOptions) -> List[str]:
    """One job array of the runs; each run's state names its job. Returns the job ids."""
    executor = slurm_executor(folder, options)
    jobs = []
    try:
        # submitit echoes sbatch's errors: the refusal is said once, below
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():
            for run in runs:
                jobs.append(executor.submit(RunJob(str(folder.out), run["key"], run["argv"])))
    except submitit.core.utils.FailedJobError as err:
        first = next((line for line in str(err).splitlines() if line.strip()), "sbatch failed")
        raise UserError(f"SLURM refused the jobs: {clip(first, 300)}{config_hint(str(err))}")
    for run, job in zip(runs, jobs):
        folder.set_state(run["key"], "submitted", cluster="slurm", job=str(job.job_id))
    return [str(job.job_id) for job in jobs]


@dataclass
class Slot:
    """What one local run gets: its cores (pinned, as many torch threads) and its GPUs (None: all)."""
    cores: List[int]
    gpus: Optional[List[int]] = None


def local_slots(parallel: Optional[int], cpus_per_run: int, gpus_per_run: int) -> List[Slot]:
    """Disjoint shares of this machine for ``parallel`` runs at once (default: as many as the cores, and
    the GPUs when runs take GPUs, allow)."""
    cores = sorted(os.sched_getaffinity(0))
    gpus = list(range(gpu_count())) if gpus_per_run else []
    fit = len(cores) // cpus_per_run
    if gpus_per_run:
        fit = min(fit, len(gpus) // gpus_per_run)
    parallel = parallel or max(1, fit)
    if parallel * cpus_per_run > len(cores):
        raise UserError(f"--parallel {parallel} x --cpus-per-run {cpus_per_run} needs {parallel * cpus_per_run} "
                        f"cores; this machine gives {len(cores)}: lower one of them")
    if parallel * gpus_per_run > len(gpus):
        raise UserError(f"--parallel {parallel} x --gpus-per-run {gpus_per_run} needs {parallel * gpus_per_run} "
                        f"GPUs; this machine has {len(gpus)}: lower one of them, or --gpus-per-run 0 to share them")
    return [Slot(cores[i * cpus_per_run:(i + 1) * cpus_per_run],
                 gpus[i * gpus_per_run:(i + 1) * gpus_per_run] if gpus_per_run else None) for i in range(parallel)]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# runs that a finished run has made ready (a tuned sweep's other seeds), asked for after each one ends
Refill = Optional[Callable[[], List[Dict[str, Any]]]]


def run_local(folder: SweepFolder, runs: List[Dict[str, Any]], slots: List[Slot], time_min: int,
              quiet: bool, refill: Refill = None) -> Dict[str, str]:
    """Run ``runs`` on this machine, ``len(slots)`` at a time, each pinned to its slot's cores, and the
    runs ``refill`` adds as others end; returns each run's outcome ("completed", "diverged",
    "stopped", or "failed: <line>")."""
    executor = submitit.AutoExecutor(folder=str(folder.submitit_dir / "%j"), cluster="local",
                                     local_max_num_timeout=MAX_TIMEOUTS)
    executor.update_parameters(timeout_min=time_min)
    waiting = list(runs)
    running: Dict[int, Tuple[Dict[str, Any], Any]] = {}
    outcomes: Dict[str, str] = {}
    bar = tqdm(total=len(runs), desc="lra-sweep", unit="run", disable=quiet)
    try:
        while waiting or running:
            for slot in range(len(slots)):
                if slot not in running and waiting:
                    run = waiting.pop(0)
                    job = executor.submit(RunJob(str(folder.out), run["key"], run["argv"], cores=slots[slot].cores,
                                                 gpus=slots[slot].gpus))
                    folder.set_state(run["key"], "submitted", cluster="local", job=str(job.job_id))
                    running[slot] = (run, job)
            for slot, (run, job) in list(running.items()):
                if job.done():
                    outcomes[run["key"]] = outcome(job)
                    del running[slot]
                    bar.update(1)
                    bar.set_postfix_str(clip(f"{run['label']}: {outcomes[run['key']]}", 60))
                    if refill is not None:
                        more = refill()
                        waiting += more
                        bar.total += len(more)
                        bar.refresh()
            time.sleep(0.5)
    except KeyboardInterrupt:
        # the runs got Ctrl-C too (one process group) and are saving their checkpoints
        for _, job in running.values():
            job.wait()
        raise
    finally:
        bar.close()
        drop_template_folder(folder)
    return outcomes


def run_debug(folder: SweepFolder, runs: List[Dict[str, Any]], quiet: bool, cpus_per_run: int,
              refill: Refill = None) -> Dict[str, str]:
    """Run ``runs`` one after another in this process (submitit's debug executor), each with
    ``cpus_per_run`` torch threads, as the local and SLURM executors give theirs; then the runs
    ``refill`` adds as they end."""
    executor = submitit.AutoExecutor(folder=str(folder.submitit_dir / "%j"), cluster="debug")
    outcomes = {}
    waiting = list(runs)
    bar = tqdm(total=len(waiting), desc="lra-sweep", unit="run", disable=quiet)
    try:
        while waiting:
            run = waiting.pop(0)
            job = executor.submit(RunJob(str(folder.out), run["key"], run["argv"], inprocess=True, threads=cpus_per_run))
            outcomes[run["key"]] = outcome(job)
            bar.update(1)
            if refill is not None:
                more = refill()
                waiting += more
                bar.total += len(more)
    finally:
        bar.close()
        drop_template_folder(folder)
    return outcomes


def drop_template_folder(folder: SweepFolder) -> None:
    """submitit's local and debug executors, reading a job's result, make a folder named after the
    template itself (``submitit/%j``) and leave it empty: removed (when empty)."""
    with contextlib.suppress(OSError):
        (folder.submitit_dir / "%j").rmdir()


# what sbatch says when it finds no slurm.conf (and then looks for the controller in DNS)
NO_CONFIG = ("resolve_ctls_from_dns_srv", "Could not establish a configuration source", "Unknown host")


def config_hint(error: str) -> str:
    """A hint when sbatch failed for want of a configuration and SLURM_CONF is not set, else ""."""
    if os.environ.get("SLURM_CONF") or not any(s in error for s in NO_CONFIG):
        return ""
    return ("; sbatch found no slurm.conf and SLURM_CONF is not set: export SLURM_CONF=PATH/slurm.conf "
            "(for scripts/slurm_local.sh's cluster: /tmp/lra-slurm/slurm.conf)")


def outcome(job: Any) -> str:
    try:
        result = job.result()
    except Exception as err:  # noqa: BLE001 - a failed run: its line is in the sweep's state file
        lines = [line for line in str(err).splitlines() if line.strip()]
        return f"failed: {lines[-1].strip() if lines else type(err).__name__}"
    return str(result["status"])
