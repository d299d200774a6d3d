"""lra-run: train one backend on one task and write its result record."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from attentions import list_attentions, load_attention_module

from ..errors import UserError
from ..files import WriteError, check_folder_arg
from . import Parser, console


def parser() -> Parser:
    from ..config import list_presets
    from ..tasks import list_tasks

    p = Parser(
        prog="lra-run",
        description="Train one attention backend on one LRA task and write a result record.",
        epilog="example: lra-run --task listops --attn mita --preset cpu --set train.lr=3e-4 attn.topk=32",
    )
    p.add_argument("--task", required=True, help=f"one of: {', '.join(list_tasks())}")
    p.add_argument("--attn", required=True, help=f"one of: {', '.join(list_attentions())} (or one from --attn-module)")
    p.add_argument("--preset", default="paper", help=f"one of: {', '.join(list_presets())} (default: paper)")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="FILE.yaml",
                   help="your own YAML layer (sections model, train, data, attn), applied after the preset and "
                   "before --set; may repeat")
    p.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config values, e.g. train.lr=3e-4 model.num_layers=4 attn.topk=64")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model and the batch order (default 0)")
    p.add_argument("--data-dir", help="an existing folder holding the task's files (default ./data); a missing "
                   "ListOps set is generated into it either way")
    p.add_argument("--out", default="runs", help="folder for run folders and records (default ./runs; the committed "
                   "reference records are in results/runs, which lra-table reads by default)")
    p.add_argument("--resume", action="store_true", help="continue the unfinished run of this config in --out")
    p.add_argument("--init-from", metavar="RUN_DIR",
                   help="start from the best weights of a finished run (any backend, same model shape): tensors of "
                   "the same name and shape are loaded, the others stay new; applied on a fresh start only, and "
                   "part of the run's identity (its folder is <name>_from-<RUN_DIR's name>)")
    p.add_argument("--attn-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering more backends with @register (may repeat)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (training, data generation and reading)")
    # lra-sweep's tuned runs: the tuning they belong to (lra/tuning.py), kept in config.json and the record
    p.add_argument("--tuning", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--no-estimate", action="store_true",
                   help="skip the line that says, before the data are read or generated, what a run of 10 minutes or "
                   "more will take here (its steps timed on made-up rows of the task's shape, lra/run/estimate.py)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    for path in args.attn_module:
        load_attention_module(path)
    from ..config import resolve
    from ..tasks import get_task
    from ..run.loop import Interrupted
    from ..run.train import train

    get_task(args.task)
    check_folder_arg(args.out, "--out")
    cfg = resolve(args.task, args.attn, args.preset, args.sets, seed=args.seed, configs=args.configs)
    # DIR/ and ./DIR name the same folder as DIR
    cfg.out = str(Path(args.out))
    if args.init_from is not None:
        cfg.init_from = str(Path(args.init_from))
    if args.tuning is not None:
        cfg.tuning = tuning_block(args.tuning)
    if args.data_dir is not None:
        # a mistyped folder would otherwise receive minutes of generated ListOps data
        if not Path(args.data_dir).is_dir():
            raise UserError(f"--data-dir {args.data_dir} is not a folder; give the folder that holds the task's files "
                            "(create it first to have ListOps generated there)")
        cfg.data.data_dir = args.data_dir
    warnings = []
    if os.environ.get("RANK", "0") == "0":
        warnings = [w for w in [warmup_warning(cfg.train), mask_warning(cfg.attn) if get_task(args.task).spec.padded else ""]
                    if w]
    try:
        record = train(cfg, resume=args.resume, quiet=args.quiet, estimate=not args.no_estimate, warnings=warnings)
    except Interrupted as err:
        print(f"lra-run: {err}", file=sys.stderr)
        return 130
    except WriteError as err:
        # the run started and stopped on a file it could not write (a full disk): status 1, as a run
        # that diverged; bad input (status 2) is refused before anything is written
        print(f"lra-run: error: {err}", file=sys.stderr)
        return 1
    if record["status"] != "completed":
        print(f"lra-run: run {record['status']}: {record['message']}; record: {record['run_dir']}/record.json", file=sys.stderr)
        return 1
    print(last_line(record, f"{record['run_dir']}/record.json"))
    return 0


def tuning_block(text: str) -> Dict[str, Any]:
    """--tuning's JSON, checked to name a grid (lra/tuning.py)."""
    from ..tuning import Grid

    try:
        block = json.loads(text)
        if not isinstance(block, dict):
            raise ValueError("not a JSON object")
        Grid.from_block(block)
    except ValueError as err:
        raise UserError(f"--tuning {text[:60]!r}: {err}; it is set by lra-sweep, as a JSON object with grid, select and seed")
    return block


def last_line(record: Dict[str, Any], path: str) -> str:
    """The line a completed run ends with: its accuracy, time, speed and memory, and where its record is."""
    # train.steps=0 trains nothing: no training time or speed to report
    speed = "no training (train.steps=0)" if record["steps"] == 0 else \
        f"train {record['train_time_s']:.0f}s, {record['tokens_per_s']:.0f} tok/s"
    return (f"{record['task']}/{record['attn']}: test acc {record['test_acc']:.4f} (majority {record['majority_acc']:.4f}), "
            f"best val {record['val_acc']:.4f} at step {record['best_step']}, {speed}, peak {record['peak_memory_mb']:.0f} MB; "
            f"record: {path}")


def warmup_warning(tc: Any) -> str:
    """Why a run that ends inside its learning-rate warm-up is not what its preset meant ("" otherwise)."""
    if 0 < tc.steps < tc.warmup_steps:
        return (f"train.steps ({tc.steps:,}) is less than train.warmup_steps ({tc.warmup_steps:,}): the run ends in its "
                f"warm-up, its learning rate never reaching train.lr ({tc.lr:g}); set train.warmup_steps below the steps "
                "for a run that does")
    return ""


def mask_warning(attn: str) -> str:
    """Why ``attn`` fails lra-check-attn's padding-invariance check at its default settings, or "" when it
    passes (or declares supports_mask = False, which the trainer refuses for a padded task). A backend
    that raises or gives non-finite output gets no warning here: the trainer's first-call check names
    what is broken. A few
    milliseconds: the battery's sizes are B=3, H=2, N=64, D=16."""
    import torch
    from attentions import get_attention
    from attentions.check import Battery, CheckFailed, Sizes

    if not get_attention(attn).supports_mask:
        return ""
    battery = Battery(attn, Sizes(), seed=0)
    try:
        with torch.random.fork_rng(devices=[]):
            battery.finite()
    except Exception:  # noqa: BLE001 - reported by the trainer's first-call check, in its own words
        return ""
    try:
        with torch.random.fork_rng(devices=[]):
            battery.padding_invariance()
    except CheckFailed as err:
        return (f"attention {attn!r} fails lra-check-attn's padding check ({err}); "
                "its accuracy on this padded task may depend on padding")
    except Exception:  # noqa: BLE001 - reported by the trainer's first-call check, in its own words
        return ""
    return ""


def entry() -> None:
    console("lra-run", main)


if __name__ == "__main__":
    entry()
