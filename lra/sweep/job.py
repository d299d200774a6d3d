"""One run of a sweep as a submitit job: ``lra-run`` in a child process, its output in the run's log.

Pre-emption and time limits: SLURM warns a job with SIGUSR2 (submitit asks for it ``signal_delay_s``
before the limit, and ``scancel --signal=USR2`` sends the same). submitit then calls ``checkpoint``:
the child gets SIGTERM, which the trainer turns into a checkpoint and a clean stop, and submitit
requeues the job. The requeued job runs the same lra-run command, which continues the unfinished run
of the same config in the same folder (lra/run/folder.py), so it ends as an uninterrupted run would.
The child ignores SIGUSR2 itself (a cluster may signal every process of the job): the stop it needs
comes as SIGTERM, after the job has decided to requeue.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional

import submitit

from ..format import clip
from .folder import SweepFolder
from .progress import run_progress

# seconds the child has to write its checkpoint after SIGTERM before it is killed (SLURM kills the
# job signal_delay_s after its warning; the trainer saves at the end of its current step)
STOP_GRACE_S = 60
# lra-run's exit statuses (lra/cli/run.py)
COMPLETED, ENDED, BAD_INPUT, INTERRUPTED = 0, 1, 2, 130


class RunFailed(Exception):
    """The run stopped with an error; its one line and log are in the sweep's state file."""


class RunJob(submitit.helpers.Checkpointable):
    """``lra-run <argv>`` for run ``key`` of the sweep in ``out``.

    ``cores``: pin the child to these CPUs and give torch as many threads (the local executor's
    share of the machine); under SLURM the job's own allocation (``SLURM_CPUS_PER_TASK``) sets the threads.
    ``gpus``: the GPUs the child sees (CUDA_VISIBLE_DEVICES; None: whatever this process sees).
    ``inprocess``: run lra-run in this process (the debug executor: no child, no signals), with
    ``threads`` torch threads (unless OMP_NUM_THREADS sets them, as it would a child's).
    """

    def __init__(self, out: str, key: str, argv: List[str], cores: Optional[List[int]] = None,
                 gpus: Optional[List[int]] = None, inprocess: bool = False, threads: int = 0) -> None:
        self.out, self.key, self.argv, self.cores, self.gpus, self.inprocess = out, key, list(argv), cores, gpus, inprocess
        self.threads = threads
        self._child: Optional[subprocess.Popen] = None

    def __getstate__(self) -> Dict[str, Any]:
        # the child process stays with the job that started it, never in the pickle submitit requeues
        return {k: v for k, v in self.__dict__.items() if k != "_child"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("threads", 0)
        self._child = None

    def __call__(self) -> Dict[str, Any]:
        folder = SweepFolder(Path(self.out))
        entry = folder.entry(self.key)
        progress = run_progress(folder, entry)
        if progress.done:
            return {"key": self.key, "status": progress.kind, "test_acc": progress.test_acc}
        if progress.kind == "running":
            # another job (or a user's lra-run) holds the run folder: this job leaves it alone
            return {"key": self.key, "status": "running elsewhere", "test_acc": None}
        job = current_job()
        job_id = job.get("job", "")
        folder.set_state(self.key, "running", **job, pid=os.getpid(), started=time.time(),
                         start_step=progress.step, log=str(folder.log(self.key)))
        rc = self.launch(folder.log(self.key), job_id)
        after = run_progress(folder, entry)
        if after.done:
            folder.set_state(self.key, after.kind, **job)
            return {"key": self.key, "status": after.kind, "test_acc": after.test_acc}
        if rc == INTERRUPTED:
            folder.set_state(self.key, "stopped", **job, step=after.step)
            return {"key": self.key, "status": "stopped", "test_acc": None}
        line = last_line(folder.log(self.key))
        if rc < 0:
            line = f"lra-run was killed by {signal.Signals(-rc).name}" + (f" (last output: {line})" if line else "")
        folder.set_state(self.key, "failed", **job, error=line, exit_status=rc, log=str(folder.log(self.key)))
        if self.inprocess:
            # submitit's debug executor opens a debugger on a job's exception: the failure is returned
            return {"key": self.key, "status": f"failed: {line}", "test_acc": None}
        raise RunFailed(f"{self.key}: {line} (log: {folder.log(self.key)})")

    def launch(self, log: Path, job_id: str) -> int:
        """Run lra-run, its output appended to ``log``; its exit status (negative: killed by that signal)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with open(log, "ab") as out:
            out.write(f"== lra-run {' '.join(self.argv)}\n== {stamp} on {os.uname().nodename}, job {job_id}\n".encode())
            out.flush()
            if self.inprocess:
                return self.run_inprocess(out)
            self._child = subprocess.Popen(
                [sys.executable, "-c", "from lra.cli.run import entry; entry()", *self.argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.child_env(),
                preexec_fn=self.child_setup,
            )
            try:
                # polled, not Popen.wait(): the pre-emption handler (checkpoint) runs in this thread
                # while it waits, and Popen.wait would hold the lock that handler's own wait needs
                return wait_child(self._child, None)
            except KeyboardInterrupt:
                # Ctrl-C reached the child too (one process group): it saves a checkpoint and stops
                return self.stop_child()

    def run_inprocess(self, out: Any) -> int:
        import io

        from ..cli import call
        from ..cli.run import main

        import torch

        text = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
        threads = torch.get_num_threads()
        if self.threads and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(self.threads)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                rc = call("lra-run", main, self.argv)
        finally:
            torch.set_num_threads(threads)
        text.detach()
        return rc

    def child_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        threads = len(self.cores) if self.cores else env.get("SLURM_CPUS_PER_TASK")
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(threads)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env

    def child_setup(self) -> None:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if self.cores:
            os.sched_setaffinity(0, self.cores)

    def stop_child(self) -> int:
        """SIGTERM to the child, then wait (at most STOP_GRACE_S) for its checkpoint; its exit status."""
        child = self._child
        if child is None:
            return INTERRUPTED
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            if wait_child(child, STOP_GRACE_S) is None:
                child.kill()
                wait_child(child, 10)
        return INTERRUPTED if child.returncode is None else child.returncode

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit's pre-emption hook: let lra-run save and stop, note it, and requeue the same job."""
        rc = self.stop_child()
        folder = SweepFolder(Path(self.out))
        progress = run_progress(folder, folder.entry(self.key))
        if not progress.done:
            folder.set_state(self.key, "requeued", **current_job(), step=progress.step, exit_status=rc)
        return submitit.helpers.DelayedSubmission(RunJob(self.out, self.key, self.argv, self.cores, self.gpus,
                                                         self.inprocess, self.threads))


def wait_child(child: subprocess.Popen, timeout: Optional[float]) -> Optional[int]:
    """The child's exit status once it exits, polling; None if ``timeout`` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while child.poll() is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return child.returncode


def current_job() -> Dict[str, str]:
    """The submitit job this process runs: {"cluster": "slurm" | "local" | "debug", "job": its id}, or
    {} outside a job."""
    try:
        env = submitit.JobEnvironment()
        return {"cluster": env.cluster, "job": str(env.job_id)}
    except RuntimeError:
        return {}


def last_line(log: Path) -> str:
    """The last non-empty line of ``log`` (the error of a run that failed), at most 300 characters, cut
    between words."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line and not line.startswith("== ")]
    return clip(lines[-1], 300) if lines else ""
