"""The run folder: its name, the claim (chosen and locked by one process), its config and its metrics log.

A run folder ``<out>/<task>_<attn>_<preset>_seed<seed>[-N]/`` holds:
    config.json      the resolved config (a resume must match it)
    checkpoint.pt    model, optimizer, step, RNG state, best-validation state, counters, the open
                     loss window and how many bytes of metrics.jsonl it covers (run/checkpoint.py)
    metrics.jsonl    one line per logged step and per evaluation
    record.json      the result record, once the run ends (completed or diverged)
    .lock            held by the one process running in the folder (lra/files.py: FolderLock)
Every file but metrics.jsonl is written to a temporary name and renamed; metrics.jsonl is cut back to
what the checkpoint covers when a run resumes, and started afresh when there is no checkpoint. So a
run killed at any moment and run again ends with the same files as one never killed.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import IO, Any, Dict, Optional, Tuple

import torch

from ..config import RunConfig, fill_optimizer
from ..errors import UserError
from ..files import FolderLock, WriteError, remove_temporaries, write_json_atomic
from . import distributed


RUN_FILES = ("config.json", "checkpoint.pt", "metrics.jsonl", "record.json", "best_model.pt")
# what to do when a file of the run folder cannot be written
RESUME = "the run stopped; free some space and run the same command again to continue it (from its last checkpoint, if any)"
BUSY = "{folder} is in use by another lra-run (pid {pid}); wait for it to end or stop it, then run the command again"


def run_name(cfg: RunConfig) -> str:
    """``<task>_<attn>_<preset>_seed<seed>``, with the task's level tag after its name where it has
    levels (``mqar-L128-p32_full_cpu_seed0``: ``Task.run_tag``), and ``_from-<source folder>`` for a run
    started from another run's weights (--init-from)."""
    from ..tasks import get_task

    try:
        tag = get_task(cfg.task).run_tag(cfg.data)
    except UserError:  # a task this process has not registered: named by itself
        tag = ""
    base = f"{cfg.task}{'-' + tag if tag else ''}_{cfg.attn}_{cfg.preset}_seed{cfg.seed}"
    return f"{base}_from-{Path(cfg.init_from).name}" if cfg.init_from else base


def read_config(path: Path) -> Dict[str, Any]:
    """A run folder's config.json; anything but a JSON object is a one-line error naming the file."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({err}); it should hold the run's config as JSON: delete that run "
                        "folder, or choose another --out")
    if not isinstance(saved, dict):
        raise UserError(f"{path} holds a JSON {type(saved).__name__}, not a run's config; delete that run folder, "
                        "or choose another --out")
    return saved


def same_run(saved: Dict[str, Any], cfg: RunConfig) -> bool:
    """Whether a saved config is this run's (``out`` aside: a folder may be moved, or named as DIR/). A key
    the saved config lacks, at the top or inside a section (written before the key existed, e.g. a
    model field added since), counts as its default."""
    merged = with_defaults(RunConfig().to_dict(), saved)
    # a config.json written before the optimizer's values were part of it: its optimizer's
    merged["train"] = fill_optimizer(merged["train"])
    return identity(merged) == identity(cfg.to_dict())


def with_defaults(defaults: Dict[str, Any], saved: Dict[str, Any]) -> Dict[str, Any]:
    """``saved`` with every key it lacks taken from ``defaults``, section by section."""
    merged = dict(defaults)
    for key, value in saved.items():
        default = defaults.get(key)
        merged[key] = with_defaults(default, value) if isinstance(value, dict) and isinstance(default, dict) else value
    return merged


def identity(config: Dict[str, Any]) -> Dict[str, Any]:
    """What makes two configs the same run: all but where it is written, where its scalars are tracked
    and the tuning it belongs to."""
    train = {k: v for k, v in (config.get("train") or {}).items() if k != "tracker"}
    return {**{k: v for k, v in config.items() if k not in ("out", "tuning")}, "train": train}


def abandoned(folder: Path) -> bool:
    """A folder holding only a lock and temporaries: a run killed while claiming it (before its config.json)."""
    return not (folder / "config.json").exists() and all(p.name.startswith(".") for p in folder.iterdir())


def choose_run_dir(cfg: RunConfig, resume: bool) -> Path:
    """The folder this run writes to: an unfinished run of the same config is continued;
    a finished one is never overwritten (a new ``-N`` folder is made instead)."""
    base = run_name(cfg)
    finished: Optional[Path] = None
    for index in itertools.count(1):
        folder = Path(cfg.out) / (base if index == 1 else f"{base}-{index}")
        if not folder.exists():
            if resume and finished is not None:
                raise UserError(f"--resume: the run in {finished} has finished (it has a record.json); nothing to "
                                f"resume; run without --resume to start a new run (in {folder})")
            if resume:
                raise UserError(f"--resume: no run folder {folder} to resume; run without --resume to start one")
            return folder
        # a record is written when a run ends (completed or diverged): such a folder is never reused
        if (folder / "record.json").exists():
            finished = finished or folder
        elif abandoned(folder):
            return folder
        elif (folder / "config.json").exists():
            if same_run(read_config(folder / "config.json"), cfg):
                return folder
            if resume:
                raise UserError(f"--resume: {folder} holds a run with a different config; drop --resume or use another --out")
    raise AssertionError("unreachable")


def claim_run_dir(cfg: RunConfig, resume: bool) -> Tuple[Path, FolderLock]:
    """Choose the run folder and lock it (the caller releases the lock); a new folder gets its config.json.

    The choice is made under a lock on ``--out``, so two commands started together cannot both pick
    a new folder: the second finds the first's folder and is told which process holds it.
    """
    out = Path(cfg.out)
    if resume and not out.is_dir():
        raise UserError(f"--resume: no run folder {out / run_name(cfg)} to resume; run without --resume to start one")
    out_lock = FolderLock(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        out_lock.acquire(wait=True)
    except OSError as err:
        raise UserError(f"cannot write to the output folder {out}: {err.strerror}; choose another with --out")
    with out_lock:
        folder = choose_run_dir(cfg, resume)
        folder.mkdir(exist_ok=True)
        lock = FolderLock(folder)
        lock.acquire(wait=False, busy=BUSY)
        try:
            remove_temporaries(folder, RUN_FILES)
            if not (folder / "config.json").exists():
                write_config(folder, cfg)
        except BaseException:
            lock.release()
            raise
    return folder, lock


def write_config(folder: Path, cfg: RunConfig) -> None:
    write_json_atomic(folder / "config.json", cfg.to_dict(), RESUME)


def open_metrics(path: Path, covered: Optional[int]) -> IO[bytes]:
    """metrics.jsonl, open for appending: cut back to the ``covered`` bytes a checkpoint vouches for,
    or (no checkpoint) started afresh, dropping whatever a killed earlier attempt logged."""
    # unbuffered: a line that does not fit on the disk fails in append_metric, not at a later flush
    if covered is None:
        return open(path, "wb", buffering=0)
    size = path.stat().st_size if path.exists() else 0
    if size < covered:
        raise UserError(f"{path} holds {size} bytes but the checkpoint covers the first {covered}: the log was "
                        "cut or replaced; delete the run folder to start over")
    os.truncate(path, covered)
    return open(path, "ab", buffering=0)


def append_metric(log: IO[bytes], row: Dict[str, Any]) -> None:
    """One line of metrics.jsonl, written through: a kill loses at most the line being written, and a
    line that does not fit on the disk is cut off again (the log ends with its last whole line) and
    raised as a WriteError."""
    line = memoryview((json.dumps(row) + "\n").encode())
    start = log.tell()
    try:
        while line:
            line = line[log.write(line):]
    except OSError as err:
        os.ftruncate(log.fileno(), start)
        log.seek(start)
        raise WriteError(Path(log.name), err, RESUME) from None


def claim(cfg: RunConfig, resume: bool, d: distributed.Dist, held: contextlib.ExitStack) -> Path:
    """Rank 0 chooses and locks the run folder (unlocked when ``held`` closes); every rank gets its path.
    A refusal (the folder in use, say) is rank 0's one line; the other ranks end with it."""

    def on_main() -> Any:
        run_dir, lock = claim_run_dir(cfg, resume)
        held.callback(lock.release)
        return run_dir

    run_dir = distributed.on_main(on_main, d)
    if d.enabled:
        holder = [run_dir]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    assert run_dir is not None
    return run_dir
