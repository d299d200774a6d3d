"""A finished run's folder read back: its config, its record and its best weights.

lra-run --init-from and lra-analyze start from such a folder. Every problem (no folder, a run that
has not finished, a damaged file) is one UserError that names the folder and what is missing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import torch

from .folder import read_config

from .checkpoint import read_torch_file
from ..config import RunConfig, from_saved
from ..errors import UserError
from .record import validate_record

WEIGHTS = "best_model.pt"


@dataclass
class FinishedRun:
    folder: Path
    cfg: RunConfig
    record: Dict[str, Any]

    @property
    def name(self) -> str:
        return self.folder.name

    def weights(self) -> Dict[str, torch.Tensor]:
        """The best-validation weights (a state_dict on the CPU)."""
        return load_weights(self.folder / WEIGHTS)


def read_finished(path: str, label: str) -> FinishedRun:
    """The run in folder ``path``; ``label`` starts each error (e.g. "--init-from runs/x")."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"{label}: no such run folder; give the folder of a finished lra-run (it holds "
                        f"config.json, record.json and {WEIGHTS})")
    if not (folder / "config.json").is_file():
        raise UserError(f"{label}: not a run folder (no config.json); give the folder of a finished lra-run")
    if not (folder / WEIGHTS).is_file():
        state = "has not finished (no record.json yet)" if not (folder / "record.json").exists() else \
            f"kept no {WEIGHTS} (it did not complete, or the weights were not copied with it)"
        raise UserError(f"{label}: the run {state}; {WEIGHTS} is needed: finish the run (the same lra-run command "
                        "resumes it) or give another folder")
    record = read_record(folder / "record.json", label)
    if record["status"] != "completed":
        raise UserError(f"{label}: the run ended with status {record['status']!r}, not 'completed'; give a completed run")
    return FinishedRun(folder, from_saved(read_config(folder / "config.json"), str(folder / "config.json")), record)


def read_record(path: Path, label: str) -> Dict[str, Any]:
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        validate_record(record)
    except FileNotFoundError:
        raise UserError(f"{label}: no record.json; give the folder of a finished lra-run")
    except (OSError, ValueError) as err:
        raise UserError(f"{label}: record.json is unreadable ({err}); give the folder of a finished lra-run")
    return record


def load_weights(path: Path) -> Dict[str, torch.Tensor]:
    """A best_model.pt: a mapping of parameter names to tensors; anything else is a one-line error."""
    weights = read_torch_file(path, str(path), "it should hold the run's best weights")
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise UserError(f"{path} holds no model weights (a mapping of names to tensors)")
    return weights
