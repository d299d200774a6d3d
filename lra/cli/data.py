"""lra-data: generate the synthetic tasks offline, or say which task data is present."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from ..errors import UserError
from ..files import check_folder_arg
from . import Parser, console


def parser() -> Parser:
    p = Parser(prog="lra-data", description="Generate the synthetic LRA tasks offline, or check which task data is present.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="generate ListOps, Pathfinder-32 or Path-X in the official file layout, "
                         "or MQAR examples as TSV to read")
    gen.add_argument("what", help="listops | pathfinder32 | pathx | mqar")
    gen.add_argument("--data-dir", default="data", help="where to write (default ./data; created when missing)")
    gen.add_argument("--size", type=int, default=0, help="examples to generate (default: the official size)")
    gen.add_argument("--level", default="", help="Pathfinder difficulty: curv_baseline, curv_contour_length_9, curv_contour_length_14; "
                     "MQAR formulation: two-token (zoology's, the default) or one-token")
    gen.add_argument("--seed", type=int, default=0,
                     help="seed of the generator (default 0); ListOps sets other than the official size and seed 0 "
                     "go to listops_n<size>_seed<seed>/")
    gen.add_argument("--workers", type=int, default=1, help="parallel processes (default 1)")
    gen.add_argument("--max-len", type=int, default=0, help="MQAR: sequence length (default: the task's, 256)")
    gen.add_argument("--pairs", type=int, default=0, help="MQAR: key-value pairs per sequence (default: the task's, 16)")
    gen.add_argument("--vocab", type=int, default=0, help="MQAR: vocabulary size (default: the task's, 8192)")
    chk = sub.add_parser("check", help="say, for every task, whether its data is present and what is missing")
    chk.add_argument("--data-dir", help="the data folder to look in (default ./data; an explicit folder must exist)")
    return p


GENERATED = {"listops": "listops", "pathfinder32": "pathfinder", "pathx": "pathx", "mqar": "mqar"}


def check_data(data_dir: Optional[str]) -> int:
    """Print, for every task, each data set found (where, split sizes) or what is missing.

    The first line of a task starts with its name; further sets it has are indented beneath it."""
    from ..tasks import get_task, list_tasks

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


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    from ..config import MAX_LEN, MAX_PROCESSES, MAX_SEED, MAX_SIZE, DataConfig
    from ..tasks import get_task
    from ..tasks.base import generate_task_data

    if args.command == "check":
        return check_data(args.data_dir)
    if args.what not in GENERATED:
        raise UserError(f"cannot generate {args.what!r}; valid: {', '.join(GENERATED)} (the other tasks are read from files)")
    if not (0 <= args.size <= MAX_SIZE and 1 <= args.workers <= MAX_PROCESSES and 0 <= args.seed <= MAX_SEED):
        raise UserError(f"--size must be 0 (official size) to {MAX_SIZE:,}, --seed 0 to {MAX_SEED:,} and --workers 1 to "
                        f"{MAX_PROCESSES:,}; got --size {args.size} --seed {args.seed} --workers {args.workers}")
    axes = {"--max-len": (args.max_len, MAX_LEN), "--pairs": (args.pairs, MAX_LEN), "--vocab": (args.vocab, MAX_SIZE)}
    for flag, (value, high) in axes.items():
        if value and args.what != "mqar":
            raise UserError(f"{flag} sets an axis of mqar only; {args.what} takes --size, --seed and --workers")
        if not 0 <= value <= high:
            raise UserError(f"{flag} must be 0 (the task's default) to {high:,}, got {value}")
    check_folder_arg(args.data_dir, "--data-dir")
    cfg = DataConfig(data_dir=args.data_dir, size=args.size, level=args.level, seed=args.seed, workers=args.workers,
                     max_len=args.max_len, pairs=args.pairs, vocab=args.vocab)
    try:
        folder = generate_task_data(get_task(GENERATED[args.what]), cfg)
    except OSError as err:
        raise UserError(f"cannot write to {args.data_dir}: {err.strerror}")
    print(f"{args.what}: written to {folder}")
    return 0


def entry() -> None:
    console("lra-data", main)


if __name__ == "__main__":
    entry()
