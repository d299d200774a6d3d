"""lra-analyze: MiTA's findings on a finished run (``lra-run``'s folder, with its best_model.pt).

    lra-analyze budget RUN_DIR --set attn.landmarks=16,32,64,128 attn.topk=16,32,64,128
    lra-analyze tokens RUN_DIR [--examples N] [--show K]
    lra-analyze recall RUN_DIR [--examples N]       (an MQAR run: where recall is lost)

Each prints its tables (Markdown) and writes them (md, csv, tex) with its plots (PNG) under --out
(default ./analyses/<run folder name>/). Bad input is one line on stderr, exit status 2, nothing written.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, NoReturn, Optional

import numpy as np

from attentions import load_attention_module

from ..cli import Parser, console
from ..config import MAX_BATCH, MAX_SIZE
from ..errors import UserError
from ..files import check_folder_arg
from ..run.finished import read_finished
from ..format import markdown, write_tables

# single examples drawn by `tokens` (a figure each)
MAX_SHOW = 1_000


class SubParser(Parser):
    """A subcommand's parser: its one-line errors start with lra-analyze, as every error of the command does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"lra-analyze: error: {message} (see {self.prog} --help)\n")


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished lra-run folder (config.json, record.json, best_model.pt)")
    p.add_argument("--data-dir", help="the folder holding the task's files (default: the run's own data.data_dir)")
    p.add_argument("--examples", type=int, help="the first N test examples (default: as many as the run's record tested)")
    p.add_argument("--batch-size", type=int, help="examples per forward pass (default: the run's train.batch_size)")
    p.add_argument("--out", help="where the tables and plots go (default ./analyses/<run folder name>)")
    p.add_argument("--attn-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering the run's backend, when it is not a built-in (may repeat)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parser() -> Parser:
    p = Parser(prog="lra-analyze", description="MiTA's findings on a finished run: accuracy at other attention budgets "
               "at inference (budget) and which tokens routed experts select (tokens); and where an MQAR run "
               "loses recall (recall).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=SubParser)
    budget = sub.add_parser("budget", help="test accuracy with attention options changed at inference, over a grid")
    common(budget)
    budget.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="attn.OPTION=V1,V2,...",
                        help="the options to vary and their values, e.g. attn.landmarks=16,32,64,128 attn.topk=16,32,64,128 "
                        "(only options that keep the trained parameters; the heat map draws one or two)")
    tokens = sub.add_parser("tokens", help="which keys the routed experts select, per layer (a backend with routed experts)")
    common(tokens)
    tokens.add_argument("--show", type=int, default=4, help="image tasks: single examples drawn with their selected pixels (default 4)")
    recall = sub.add_parser("recall", help="an MQAR run's test accuracy by the key's distance back and the pair asked "
                            "for, and how often it answers with one of the sequence's values (where recall is lost)")
    common(recall)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    for path in args.attn_module:
        load_attention_module(path)
    if args.batch_size is not None and not 1 <= args.batch_size <= MAX_BATCH:
        raise UserError(f"--batch-size must be 1 to {MAX_BATCH:,}, got {args.batch_size}")
    if args.examples is not None and not 1 <= args.examples <= MAX_SIZE:
        raise UserError(f"--examples must be 1 to {MAX_SIZE:,}, got {args.examples}")
    if args.command == "tokens" and not 0 <= args.show <= MAX_SHOW:
        raise UserError(f"--show must be 0 to {MAX_SHOW:,}, got {args.show}")
    if args.out:
        check_folder_arg(args.out, "--out")
    if args.command == "recall":
        return run_recall(args)
    return run_budget(args) if args.command == "budget" else run_tokens(args)


def finish(tables: list, stem: str, out: Path, plots: List[Path]) -> None:
    """Print the tables, write them, say where everything went."""
    written = write_tables(out, stem, tables)
    print("\n".join(markdown(t) for t in tables))
    print(f"lra-analyze: wrote {', '.join(str(p) for p in [*written, *plots])}")


def run_budget(args: argparse.Namespace) -> int:
    from .budget import evaluate_grid, parse_grid, tables
    from .loaded import load
    from .plots import budget_heatmap

    grid = parse_grid(args.sets)
    loaded = load(args.run_dir, args.data_dir, args.examples, args.quiet)
    cells, base = evaluate_grid(loaded, grid, args.batch_size or loaded.cfg.train.batch_size, args.quiet)
    out = Path(args.out) if args.out else Path("analyses") / loaded.run.name
    built = tables(loaded, grid, cells, base)
    plots = []
    if len(grid) <= 2:
        title = f"{loaded.run.name}: test accuracy at inference settings"
        plots.append(budget_heatmap(cells, grid, title, out / "budget.png"))
    finish(built, "budget", out, plots)
    if len(grid) > 2:
        print(f"lra-analyze: no heat map: it draws one or two options, and {len(grid)} vary")
    return 0


def run_tokens(args: argparse.Namespace) -> int:
    from .loaded import load
    from .tokens import capture, check_routed, tables

    check_routed(read_finished(args.run_dir, f"RUN_DIR {args.run_dir}").cfg.attn)
    loaded = load(args.run_dir, args.data_dir, args.examples, args.quiet)
    sel = capture(loaded, args.batch_size or loaded.cfg.train.batch_size)
    out = Path(args.out) if args.out else Path("analyses") / loaded.run.name
    built = tables(loaded, sel)
    plots: List[Path] = []
    if loaded.spec.image_side:
        from .plots import image_figures

        plots = image_figures(sel, np.asarray(loaded.test.labels), loaded.spec.image_side, args.show, loaded.run.name, out)
    finish(built, "tokens", out, plots)
    return 0


def run_recall(args: argparse.Namespace) -> int:
    from .loaded import load
    from .recall import score, tables

    run = read_finished(args.run_dir, f"RUN_DIR {args.run_dir}")
    if run.cfg.task != "mqar":
        raise UserError(f"recall probes MQAR runs (multi-query associative recall); {args.run_dir} ran {run.cfg.task!r}")
    loaded = load(args.run_dir, args.data_dir, args.examples, args.quiet)
    queries = score(loaded, args.batch_size or loaded.cfg.train.batch_size)
    out = Path(args.out) if args.out else Path("analyses") / loaded.run.name
    finish(tables(loaded, queries), "recall", out, [])
    return 0


def entry() -> None:
    console("lra-analyze", main)


if __name__ == "__main__":
    entry()
