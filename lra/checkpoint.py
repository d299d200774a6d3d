"""Resumable checkpoints and the run folder they live in.

A run folder ``<out>/<task>_<attn>_<preset>_seed<seed>[-N]/`` holds:
    config.json      the resolved config (a resume must match it)
    checkpoint.pt    model, optimizer, step, RNG state, best-validation state, counters
    metrics.jsonl    one line per logged step and per evaluation
    record.json      the result record, once the run ends (completed or diverged)
Every file is written to a temporary name and renamed, so a kill never leaves a truncated file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .config import RunConfig
from .errors import UserError
from .record import write_json_atomic


def run_name(cfg: RunConfig) -> str:
    return f"{cfg.task}_{cfg.attn}_{cfg.preset}_seed{cfg.seed}"


def choose_run_dir(cfg: RunConfig, resume: bool) -> Path:
    """The folder this run writes to: an unfinished run of the same config is continued;
    a finished one is never overwritten (a new ``-N`` folder is made instead)."""
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-")
        probe.close()
    except OSError as err:
        raise UserError(f"cannot write to the output folder {out}: {err.strerror}; choose another with --out")
    base = run_name(cfg)
    index = 1
    while True:
        folder = out / (base if index == 1 else f"{base}-{index}")
        if not folder.exists():
            if resume and index == 1:
                raise UserError(f"--resume: no run folder {folder} to resume; run without --resume to start one")
            return folder
        # a record is written when a run ends (completed or diverged): such a folder is never reused
        finished = (folder / "record.json").exists()
        if not finished and (folder / "config.json").exists():
            saved = json.loads((folder / "config.json").read_text())
            if saved == cfg.to_dict():
                return folder
            if resume:
                raise UserError(f"--resume: {folder} holds a run with a different config; drop --resume or use another --out")
        index += 1


def save_checkpoint(path: Path, state: Dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: Path) -> Optional[Dict[str, Any]]:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file
        raise UserError(f"the checkpoint {path} is unreadable ({type(err).__name__}); delete it to start over")


def write_config(folder: Path, cfg: RunConfig) -> None:
    write_json_atomic(folder / "config.json", cfg.to_dict())


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines logged after ``step`` (they will be logged again after a resume)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
