"""What the lra-sweep tests share: a tiny ListOps protocol as sweep flags, and a run's outcome without
its timings (what neither the executor nor a pre-emption may change)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

# timings, process measurements and where the run was written: what may differ between two sweeps
VOLATILE = ("train_time_s", "eval_time_s", "tokens_per_s", "peak_memory_mb", "started_at", "finished_at",
            "load_average", "matmul_gflops")
# 1 layer of width 16 on the smoke set cut to 128 tokens; 20 steps, checkpoints every 4, one thread
# (the thread count changes float sums: two sweeps compare only at the same count)
TINY_SETS = ["model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "data.max_len=128", "train.steps=20",
             "train.eval_every=7", "train.checkpoint_every=4", "train.log_every=3", "train.threads=1"]


def sweep_flags(data_dir: Path, attn: str = "full,mita", seeds: str = "0,1", extra_sets: List[str] = ()) -> List[str]:
    """The tiny protocol as lra-sweep run flags; ``extra_sets`` replace the values of the keys they name."""
    named = {item.split("=", 1)[0] for item in extra_sets}
    sets = [item for item in TINY_SETS if item.split("=", 1)[0] not in named] + list(extra_sets)
    return ["--task", "listops", "--attn", attn, "--seeds", seeds, "--preset", "smoke", "--data-dir", str(data_dir),
            "--set", *sets, "--quiet"]


def executor_flags(data_dir: Path) -> List[str]:
    """A grid whose thread count the executor sets (--cpus-per-run): the smoke preset as it is, no
    train.threads, full attention and MiTA at seed 0."""
    return ["--task", "listops", "--attn", "full,mita", "--seeds", "0", "--preset", "smoke", "--data-dir",
            str(data_dir), "--cpus-per-run", "1", "--quiet"]


def outcome(run_dir: Path) -> Dict[str, object]:
    """The record without timings (and without the --out it was written under), the metrics log, the
    best weights and the file names of a finished run."""
    record = json.loads((run_dir / "record.json").read_text())
    record = {k: v for k, v in record.items() if k not in VOLATILE}
    record["config"] = {k: v for k, v in record["config"].items() if k != "out"}
    best = torch.load(run_dir / "best_model.pt", weights_only=True)
    return {
        "record": record,
        "metrics": (run_dir / "metrics.jsonl").read_bytes(),
        "best": {k: v.tolist() for k, v in best.items()},
        "files": sorted(p.name for p in run_dir.iterdir() if p.name != ".lock"),
    }


def outcomes(out: Path) -> Dict[str, Dict[str, object]]:
    """Every finished run folder in a sweep folder, by name."""
    return {p.name: outcome(p) for p in sorted(out.iterdir()) if (p / "record.json").exists()}


def wait_until(test: Callable[[], bool], timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.time() + timeout
    while not test():
        assert time.time() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(poll)
