"""lra-check-attn: run the attention contract battery (``attentions.check``) on a user's backends.

    lra-check-attn path/to/my_attention.py [--name NAME ...] [--task TASK [--preset PRESET]] [--set KEY=VALUE ...]

Prints PASS / FAIL (with why) / SKIP for every check of every backend the file registers (or of the
named ones; built-in names are fine), at the battery's small sizes with the backend's own defaults or,
with ``--task``, at the length, heads and head width a task's preset trains with and the backend options
that run resolves to (its YAML, with the task's section). ``--set`` changes backend options on top. Exit status 0 when every check passes, 1 when one fails,
2 for bad input (not a .py file, an import error, no backend registered, an unknown --name).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from attentions import AttentionError, build_config, is_timing_reference, list_attentions, load_attention_module, origin
from attentions.check import FAIL, Report, Sizes, check_backend

from . import Parser, console
from ..errors import UserError


def parser() -> Parser:
    p = Parser(
        prog="lra-check-attn",
        description="Check that attention backends keep the contract: shapes, finite gradients, padding invariance "
                    "(of outputs and gradients), taxonomy.",
        epilog="example: lra-check-attn examples/my_attention.py",
    )
    p.add_argument("file", nargs="?", metavar="FILE.py", help="a Python file that registers backends with @register")
    p.add_argument("--name", dest="names", action="append", default=[], metavar="NAME",
                   help="check only this backend (may repeat; a built-in name is fine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument("--task", help="check at this task's sequence length, heads and head width (default: the "
                   "battery's B=3 H=2 N=64 D=16)")
    p.add_argument("--preset", default="paper", help="with --task: the preset whose sizes are used (default paper)")
    p.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="a backend option for the check, e.g. dwc=true or attn.topk=32 (may repeat)")
    return p


def option_sets(items: List[str]) -> List[str]:
    """``--set`` items as lra-run's ``attn.key=value``; anything else is a one-line error."""
    sets = []
    for item in items:
        key = item.split("=", 1)[0]
        if "=" not in item or not key or (key.count(".") and not key.startswith("attn.")):
            raise UserError(f"--set {item!r} must be a backend option KEY=VALUE (or attn.KEY=VALUE), e.g. topk=32")
        sets.append(item if key.startswith("attn.") else f"attn.{item}")
    return sets


def task_setting(name: str, task: Optional[str], preset: str, sets: List[str]) -> Tuple[Sizes, Dict[str, Any]]:
    """The battery's sizes and backend ``name``'s options: the battery's small sizes and the --set options;
    with a task, the length (a cls token included), heads and head width it trains with under
    ``preset`` and the options that run resolves to, --set applied last."""
    from ..config import parse_set, resolve
    from ..tasks import get_task

    if task is None:
        # the --set options alone, checked against the backend's Config (unknown key, wrong type)
        options = {key: value for _, key, value in map(parse_set, sets)}
        try:
            build_config(name, options)
        except AttentionError as err:
            raise UserError(str(err)) from err
        return Sizes(), options
    cfg = resolve(task, name, preset, sets=sets)
    length = get_task(task).max_len(cfg.data) + (1 if cfg.model.pooling == "cls" else 0)
    return Sizes(heads=cfg.model.num_heads, length=length, head_dim=(cfg.model.qkv_dim or cfg.model.dim) // cfg.model.num_heads), cfg.attn_options


def print_report(report: Report, sizes: Sizes, options: Dict[str, Any]) -> None:
    note = f"; {report.dtype_note}" if report.dtype_note else ""
    shown = f", {' '.join(f'{k}={v}' for k, v in options.items())}" if options else ""
    print(f"{report.name} ({origin(report.name)}): {report.dtype}, "
          f"B={sizes.batch} H={sizes.heads} N={sizes.length} D={sizes.head_dim}{shown}{note}")
    for result in report.results:
        print(f"  {result.line()}")
    failed = sum(r.status == FAIL for r in report.results)
    verdict = f"{failed} of {len(report.results)} checks failed" if failed else "every check passed"
    print(f"  -> {report.name}: {verdict}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.file is None and not args.names:
        raise UserError("give the Python file that registers your backend (lra-check-attn examples/my_attention.py) or --name NAME")
    if args.file is not None and (not Path(args.file).is_file() or Path(args.file).suffix != ".py"):
        raise UserError(f"{args.file!r} is not a Python file; give the path of a .py file that registers backends")
    new = load_attention_module(args.file) if args.file is not None else []
    if args.file is not None and not new:
        raise UserError(f"{args.file} registers no new backend; decorate a subclass of attentions.Attention with @register(name)")
    known = list_attentions()
    for name in args.names:
        if is_timing_reference(name):
            raise UserError(f"--name {name!r} is a timing reference (the model without attention), not a backend to "
                            f"check; known: {', '.join(known)}")
        if name not in known:
            raise UserError(f"unknown --name {name!r}; known: {', '.join(known)}")
    sets = option_sets(args.sets)
    passed = True
    for name in args.names or new:
        sizes, options = task_setting(name, args.task, args.preset, sets)
        report = check_backend(name, sizes, seed=args.seed, overrides=options)
        print_report(report, sizes, options)
        passed = passed and report.passed
    return 0 if passed else 1


def entry() -> None:
    console("lra-check-attn", main)


if __name__ == "__main__":
    entry()
