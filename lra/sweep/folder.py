"""A sweep's folder: the run folders lra-run writes (so lra-table reads them as any runs), and beside
them ``sweep/`` with the sweep's own files::

    <out>/
      <task>_<attn>_<preset>_seed<seed>[-N]/   lra-run's run folders (lra/run/folder.py)
      sweep/
        spec.yaml        the spec (lra/sweep/spec.py): re-running the sweep must give the same one
        runs.json        the expanded run list: key, label and lra-run flags of each run
        state/<key>.json what the executor last said of each run (submitted, running, stopped, failed)
        logs/<key>.log   each run's lra-run output, every attempt appended
        submitit/        submitit's job files and logs
        .lock            held while an lra-sweep run submits (and, locally, runs) the sweep

The run folders are the truth of a run's progress (record.json, metrics.jsonl, the folder's lock);
state/ adds what only the executor knows: the job id, the host, when the attempt started, why it failed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from ..run.folder import run_name, same_run
from ..config import RunConfig
from ..errors import UserError
from ..files import write_atomic, write_json_atomic
from ..format import clip
from .spec import RunSpec, SweepSpec

META = "sweep"


class SweepFolder:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.meta = self.out / META
        self.spec_file = self.meta / "spec.yaml"
        self.runs_file = self.meta / "runs.json"
        self.state_dir = self.meta / "state"
        self.log_dir = self.meta / "logs"
        self.submitit_dir = self.meta / "submitit"

    def exists(self) -> bool:
        return self.spec_file.is_file() and self.runs_file.is_file()

    def require(self) -> None:
        """A folder that holds no sweep is a one-line error."""
        if not self.out.is_dir():
            raise UserError(f"{self.out}: no such folder; give the --out folder of an lra-sweep run")
        if not self.exists():
            raise UserError(f"{self.out} holds no sweep (no {META}/spec.yaml and {META}/runs.json); give the --out "
                            "folder of an lra-sweep run")

    def saved_spec(self) -> Dict[str, Any]:
        try:
            values = yaml.safe_load(self.spec_file.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise UserError(f"{self.spec_file} is unreadable ({clip(str(err), 200)}); delete {self.meta} to start the sweep's files over")
        if not isinstance(values, dict):
            raise UserError(f"{self.spec_file} holds no sweep spec; delete {self.meta} to start the sweep's files over")
        return values

    def runs(self) -> List[Dict[str, Any]]:
        try:
            runs = json.loads(self.runs_file.read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{self.runs_file} is unreadable ({clip(str(err), 200)}); re-run the sweep's lra-sweep run command to rewrite it")
        return runs

    def entry(self, key: str) -> Dict[str, Any]:
        """Run ``key``'s item of runs.json."""
        found = next((r for r in self.runs() if r["key"] == key), None)
        if found is None:
            raise UserError(f"{self.runs_file} has no run {key}; re-run the sweep's lra-sweep run command to rewrite it")
        return found

    def write(self, spec: SweepSpec, runs: List[RunSpec], argvs: List[List[str]]) -> None:
        """Write the spec and run list; a folder holding another sweep is refused."""
        saved = spec.to_dict()
        if self.spec_file.exists() and self.saved_spec() != saved:
            raise UserError(f"{self.out} holds another sweep (its spec is {self.spec_file}); give the same axes to "
                            "continue it, or another --out")
        write_atomic(self.spec_file, yaml.safe_dump(saved, sort_keys=False).encode())
        write_json_atomic(self.runs_file, {"runs": [
            {"key": r.key, "label": r.label, "task": r.task, "attn": r.attn, "preset": r.preset, "seed": r.seed,
             "set": list(r.sets), "argv": argv} for r, argv in zip(runs, argvs)]})
        for folder in (self.state_dir, self.log_dir, self.submitit_dir):
            folder.mkdir(parents=True, exist_ok=True)

    def state(self, key: str) -> Dict[str, Any]:
        """The executor's last word on run ``key`` ({} if none, or if the file is damaged)."""
        try:
            value = json.loads((self.state_dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def set_state(self, key: str, status: str, **fields: Any) -> None:
        write_json_atomic(self.state_dir / f"{key}.json",
                          {"status": status, "updated": time.time(), "host": os.uname().nodename, **fields})

    def log(self, key: str) -> Path:
        return self.log_dir / f"{key}.log"


def run_dir_of(out: Path, cfg: RunConfig) -> Optional[Path]:
    """The folder in ``out`` holding the run of ``cfg`` as lra-run chose it: ``<name>`` or ``<name>-N``
    whose config.json is this config (the latest such folder: a finished run that is run again gets a
    new one); None if the run never started."""
    base = run_name(cfg)
    found = None
    for index in range(1, 10_000):
        folder = out / (base if index == 1 else f"{base}-{index}")
        if not folder.is_dir():
            break
        try:
            saved = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and same_run(saved, cfg):
            found = folder
    return found
