"""Where one run of a sweep stands, read from its run folder: finished (its record), running (an lra-run
holds the folder's lock), stopped part-way (a checkpoint, nobody running it) or not started."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional

from ..files import LOCK_NAME
from .folder import SweepFolder, run_dir_of


@dataclass
class Progress:
    # "completed", "diverged", "running", "stopped" or "pending"
    kind: str
    run_dir: Optional[Path] = None
    # the last step in metrics.jsonl, and the steps the run trains
    step: int = 0
    steps: int = 0
    test_acc: Optional[float] = None
    message: str = ""
    # whether the run folder holds a checkpoint (a stopped run resumes from it, or else starts over)
    checkpoint: bool = False

    @property
    def done(self) -> bool:
        return self.kind in ("completed", "diverged")


def run_progress(folder: SweepFolder, entry: Dict[str, Any]) -> Progress:
    """Where the run of run-list ``entry`` (an item of runs.json) stands."""
    cfg = run_config(str(folder.out), json.dumps(entry, sort_keys=True))
    run_dir = run_dir_of(folder.out, cfg)
    if run_dir is None:
        return Progress("pending", steps=cfg.train.steps)
    record = read_json(run_dir / "record.json")
    if record is not None and record.get("status") in ("completed", "diverged"):
        return Progress(record["status"], run_dir, int(record.get("steps") or 0), cfg.train.steps,
                        record.get("test_acc"), str(record.get("message") or ""))
    kind = "running" if lock_held(run_dir / LOCK_NAME) else "stopped"
    return Progress(kind, run_dir, last_step(run_dir / "metrics.jsonl"), cfg.train.steps,
                    checkpoint=(run_dir / "checkpoint.pt").is_file())


@lru_cache(maxsize=4096)
def run_config(out: str, entry_json: str) -> Any:
    """The resolved config of a run-list entry, as lra-run resolves it from the entry's flags."""
    from ..cli.run import parser
    from ..config import resolve

    entry = json.loads(entry_json)
    args = parser().parse_args(entry["argv"])
    cfg = resolve(args.task, args.attn, args.preset, args.sets, seed=args.seed, configs=args.configs)
    cfg.out = str(Path(args.out))
    if args.data_dir is not None:
        cfg.data.data_dir = args.data_dir
    return cfg


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def last_step(metrics: Path) -> int:
    """The step of the last complete line of a metrics.jsonl (0 if none)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return 0
    for line in reversed(tail.split("\n")[:-1]):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def lock_held(path: Path) -> bool:
    """Whether a process on this machine holds an flock on ``path`` (lra/files.py), from /proc/locks;
    False where the file or /proc/locks is missing."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return False
    # /proc/locks names a file as MAJOR:MINOR:INODE, the device numbers in hex
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF" (a blocked waiter has "->" after the number)
        if "FLOCK" not in parts:
            continue
        at = parts.index("FLOCK")
        if len(parts) > at + 4 and parts[at + 4] == file_id and "->" not in parts:
            return True
    return False
