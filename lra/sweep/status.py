"""``lra-sweep status``: one line per run and a summary, from the run folders and the sweep's state files.

A run is finished (with its test accuracy), diverged, running (at step s of S, with an ETA from the
steps this attempt has made), failed (the error's line and the log's path) or pending (not started,
queued on the cluster, or stopped part-way: the next ``lra-sweep run`` resumes it from its checkpoint, or restarts it when it
stopped before its first one).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..format import fmt_duration, plural
from .folder import SweepFolder
from .progress import Progress, run_progress

STATES = ("finished", "diverged", "running", "pending", "failed")


@dataclass
class RunStatus:
    key: str
    label: str
    state: str
    detail: str

    def line(self, width: int) -> str:
        return f"{self.label:<{width}}  {self.state:<8}  {self.detail}"


def sweep_status(folder: SweepFolder) -> List[RunStatus]:
    runs = folder.runs()
    states = [folder.state(r["key"]) for r in runs]
    queued = cluster_jobs([str(s.get("job", "")) for s in states if s.get("cluster") == "slurm"])
    return [run_status(folder, r, queued) for r in runs]


def run_status(folder: SweepFolder, entry: Dict, queued: Optional[Dict[str, str]]) -> RunStatus:
    key, label = entry["key"], entry["label"]
    progress = run_progress(folder, entry)
    state = folder.state(key)
    if progress.kind == "completed":
        acc = "n/a" if progress.test_acc is None else f"{progress.test_acc:.4f}"
        return RunStatus(key, label, "finished", f"test acc {acc} ({progress.run_dir})")
    if progress.kind == "diverged":
        return RunStatus(key, label, "diverged", f"{progress.message} ({progress.run_dir})")
    here = state.get("host") == os.uname().nodename
    job = str(state.get("job") or "")
    started = state.get("cluster") == "slurm" and (queued or {}).get(job) in ("RUNNING", "COMPLETING")
    if progress.kind == "running" or started or (state.get("status") == "running" and alive(state, here, queued)):
        return RunStatus(key, label, "running", running_detail(progress, state, job))
    if state.get("status") == "failed":
        return RunStatus(key, label, "failed", f"{state.get('error') or 'no error line'} (log: {state.get('log')})")
    if job and (queued or {}).get(job) in ("PENDING", "REQUEUED", "CONFIGURING", "REQUEUE_HOLD", "SUSPENDED"):
        return RunStatus(key, label, "pending", f"queued as SLURM job {job} ({(queued or {})[job].lower()})")
    if progress.kind == "stopped" and progress.checkpoint:
        return RunStatus(key, label, "pending", f"stopped at step {progress.step} of {progress.steps}; the next "
                         "lra-sweep run resumes it from its last checkpoint")
    if progress.kind == "stopped" and progress.step:
        return RunStatus(key, label, "pending", f"stopped at step {progress.step} of {progress.steps}, before its "
                         "first checkpoint; the next lra-sweep run restarts it")
    return RunStatus(key, label, "pending", "not started")


def alive(state: Dict, here: bool, queued: Optional[Dict[str, str]]) -> bool:
    """Whether the job a state file calls running still is: its SLURM job (when squeue answers) or its
    process (this machine)."""
    job = str(state.get("job") or "")
    if state.get("cluster") == "slurm" and queued is not None:
        return queued.get(job) in ("RUNNING", "COMPLETING")
    if here:
        try:
            os.kill(int(state.get("pid", 0)), 0)
            return int(state.get("pid", 0)) > 0
        except (OSError, ValueError):
            return False
    # another machine, and no cluster to ask: what the job last said
    return True


def running_detail(progress: Progress, state: Dict, job: str) -> str:
    where = f"{state.get('host', '?')}" + (f", job {job}" if job else "")
    if not progress.run_dir:
        return f"starting (reading or generating the data) on {where}"
    text = f"step {progress.step} of {progress.steps}"
    started, first = state.get("started"), state.get("start_step")
    if isinstance(started, (int, float)) and isinstance(first, int) and progress.step > first:
        rate = (progress.step - first) / max(1e-9, time.time() - started)
        text += f", ETA {fmt_duration((progress.steps - progress.step) / rate)}"
    return f"{text} on {where}"


def cluster_jobs(job_ids: List[str]) -> Optional[Dict[str, str]]:
    """SLURM's state of each job id that squeue still lists (upper case: RUNNING, PENDING, ...), array
    tasks as ``<array>_<task>``; a job it no longer lists has ended. None where there is no squeue or
    it does not answer (then the state files are all there is to go by)."""
    arrays = sorted({j.split("_")[0] for j in job_ids if j and j.split("_")[0].isdigit()})
    if not arrays or shutil.which("squeue") is None:
        return None
    try:
        # squeue fails on a job id it no longer knows: one id per call would be slow, so all of them
        # are asked for in one call, by user, and filtered here
        proc = subprocess.run(["squeue", "-h", "-o", "%i %T", "-u", str(os.getuid())], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    out = proc.stdout
    states: Dict[str, str] = {}
    wanted = set(arrays)
    for line in out.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0].split("_")[0] not in wanted:
            continue
        # a pending array's tasks not yet started are one line: 12_[3-7%2] or 12_[1,4]
        match = re.fullmatch(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]", parts[0])
        if match is None:
            states[parts[0]] = parts[1]
            continue
        for piece in match.group(2).split(","):
            low, _, high = piece.partition("-")
            for task in range(int(low), int(high or low) + 1):
                states[f"{match.group(1)}_{task}"] = parts[1]
    return states


def summary(statuses: List[RunStatus]) -> str:
    counts = Counter(s.state for s in statuses)
    parts = [f"{counts[s]} {s}" for s in STATES if counts[s]]
    return f"{plural(len(statuses), 'run')}: " + ", ".join(parts)


def report(folder: SweepFolder) -> str:
    """One line per run and the summary; for a tuned sweep, then its grid, scores and choices."""
    from .spec import from_yaml
    from .tune import report_lines

    statuses = sweep_status(folder)
    width = max((len(s.label) for s in statuses), default=0)
    lines = [s.line(width) for s in statuses] + [summary(statuses)]
    if folder.saved_spec().get("tune") is not None:
        lines += report_lines(folder, from_yaml(str(folder.spec_file), origin=f"the sweep's spec {folder.spec_file}"))
    return "\n".join(lines)


def unfinished(statuses: List[RunStatus]) -> List[RunStatus]:
    return [s for s in statuses if s.state not in ("finished", "diverged")]


def find(statuses: List[RunStatus], key: str) -> Optional[RunStatus]:
    return next((s for s in statuses if s.key == key), None)
