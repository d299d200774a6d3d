"""Command lines: lra-run, lra-data (and the entry points of lra-bench, lra-table, lra-check-attn).

Bad input is one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, List, NoReturn, Optional

from attentions import AttentionError, list_attentions, load_attention_module

from .errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def guarded(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; turn user errors into one line and exit status 2."""
    try:
        return body()
    except (UserError, AttentionError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def run_parser() -> Parser:
    from .config import list_presets
    from .tasks import list_tasks

    p = Parser(
        prog="lra-run",
        description="Train one attention backend on one LRA task and write a result record.",
        epilog="example: lra-run --task listops --attn mita --preset cpu --set train.lr=3e-4 attn.topk=32",
    )
    p.add_argument("--task", required=True, help=f"one of: {', '.join(list_tasks())}")
    p.add_argument("--attn", required=True, help=f"one of: {', '.join(list_attentions())} (or one from --attn-module)")
    p.add_argument("--preset", default="paper", help=f"one of: {', '.join(list_presets())} (default: paper)")
    p.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config values, e.g. train.lr=3e-4 model.num_layers=4 attn.topk=64")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model and the batch order (default 0)")
    p.add_argument("--data-dir", help="an existing folder holding the task's files (default ./data); a missing "
                   "ListOps set is generated into it either way")
    p.add_argument("--out", default="runs", help="folder for run folders and records (default ./runs; the committed "
                   "reference records are in results/runs, which lra-table reads by default)")
    p.add_argument("--resume", action="store_true", help="continue the unfinished run of this config in --out")
    p.add_argument("--attn-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering more backends with @register (may repeat)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (training, data generation and reading)")
    return p


def run(argv: Optional[List[str]] = None) -> int:
    args = run_parser().parse_args(argv)
    for path in args.attn_module:
        load_attention_module(path)
    from .config import resolve
    from .tasks import get_task
    from .train import Interrupted, train

    get_task(args.task)
    cfg = resolve(args.task, args.attn, args.preset, args.sets, seed=args.seed)
    # DIR/ and ./DIR name the same folder as DIR
    cfg.out = str(Path(args.out))
    if args.data_dir is not None:
        # a mistyped folder would otherwise receive minutes of generated ListOps data
        if not Path(args.data_dir).is_dir():
            raise UserError(f"--data-dir {args.data_dir} is not a folder; give the folder that holds the task's files "
                            "(create it first to have ListOps generated there)")
        cfg.data.data_dir = args.data_dir
    if get_task(args.task).spec.padded and os.environ.get("RANK", "0") == "0":
        warning = mask_warning(cfg.attn)
        if warning:
            print(f"lra-run: warning: {warning}", file=sys.stderr)
    try:
        record = train(cfg, resume=args.resume, quiet=args.quiet)
    except Interrupted as err:
        print(f"lra-run: {err}", file=sys.stderr)
        return 130
    if record["status"] != "completed":
        print(f"lra-run: run {record['status']}: {record['message']}; record: {record['run_dir']}/record.json", file=sys.stderr)
        return 1
    print(
        f"{cfg.task}/{cfg.attn}: test acc {record['test_acc']:.4f} (majority {record['majority_acc']:.4f}), "
        f"best val {record['val_acc']:.4f} at step {record['best_step']}, train {record['train_time_s']:.0f}s, "
        f"{record['tokens_per_s']:.0f} tok/s, peak {record['peak_memory_mb']:.0f} MB; "
        f"record: {record['run_dir']}/record.json"
    )
    return 0


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


def data_parser() -> Parser:
    p = Parser(prog="lra-data", description="Generate the synthetic LRA tasks offline, or check which task data is present.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="generate ListOps, Pathfinder-32 or Path-X in the official file layout")
    gen.add_argument("what", help="listops | pathfinder32 | pathx")
    gen.add_argument("--data-dir", default="data", help="where to write (default ./data; created when missing)")
    gen.add_argument("--size", type=int, default=0, help="examples to generate (default: the official size)")
    gen.add_argument("--level", default="", help="Pathfinder difficulty: curv_baseline, curv_contour_length_9, curv_contour_length_14")
    gen.add_argument("--seed", type=int, default=0,
                     help="seed of the generator (default 0); ListOps sets other than the official size and seed 0 "
                     "go to listops_n<size>_seed<seed>/")
    gen.add_argument("--workers", type=int, default=1, help="parallel processes (default 1)")
    chk = sub.add_parser("check", help="say, for every task, whether its data is present and what is missing")
    chk.add_argument("--data-dir", help="the data folder to look in (default ./data; an explicit folder must exist)")
    return p


GENERATED = {"listops": "listops", "pathfinder32": "pathfinder", "pathx": "pathx"}


def check_data(data_dir: Optional[str]) -> int:
    """Print, for every task, each data set found (where, split sizes) or what is missing.

    The first line of a task starts with its name; further sets it has are indented beneath it."""
    from .tasks import get_task, list_tasks

    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder; give the folder that holds the task files")
    folder = data_dir or "data"
    if not Path(folder).is_dir():
        print(f"the data folder ./{folder} does not exist yet (lra-run generates ListOps into it on first use), "
              "so every task is missing")
    for name in list_tasks():
        st = get_task(name).status(folder)
        if not st.present:
            print(f"{name:<11} MISSING   {st.missing}")
            continue
        for i, found in enumerate([st, *st.also]):
            sizes = " / ".join(f"{k} {v:,}" for k, v in found.split_sizes.items())
            print(f"{name if i == 0 else '':<11} present   {found.source}  ({sizes})")
        if st.note:
            print(f"{'':<11} {st.note}")
    return 0


def data(argv: Optional[List[str]] = None) -> int:
    args = data_parser().parse_args(argv)
    from .config import DataConfig
    from .tasks import get_task
    from .tasks.base import generate_task_data

    if args.command == "check":
        return check_data(args.data_dir)
    if args.what not in GENERATED:
        raise UserError(f"cannot generate {args.what!r}; valid: {', '.join(GENERATED)} (the other tasks are read from files)")
    if args.size < 0 or args.workers < 1 or args.seed < 0:
        raise UserError("--size must be 0 (official size) or more, --seed 0 or more and --workers at least 1; "
                        f"got --size {args.size} --seed {args.seed} --workers {args.workers}")
    cfg = DataConfig(data_dir=args.data_dir, size=args.size, level=args.level, seed=args.seed, workers=args.workers)
    try:
        folder = generate_task_data(get_task(GENERATED[args.what]), cfg)
    except OSError as err:
        raise UserError(f"cannot write to {args.data_dir}: {err.strerror}")
    print(f"{args.what}: written to {folder}")
    return 0


def run_main() -> None:
    sys.exit(guarded("lra-run", run))


def data_main() -> None:
    sys.exit(guarded("lra-data", data))


def bench_main() -> None:
    from .bench import main

    sys.exit(guarded("lra-bench", main))


def table_main() -> None:
    from .tables import main

    sys.exit(guarded("lra-table", main))


def check_attn_main() -> None:
    from .check_attn import main

    sys.exit(guarded("lra-check-attn", main))
