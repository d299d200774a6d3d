"""Each baseline against its authors' PyTorch code at the same settings, forward and backward, in one process.

For every pair of scripts/authors_pairs.py (performer / performer-pytorch, reformer's chunked form /
transformers' LSHSelfAttention, local / local-attention, longformer, bigbird and nystromformer /
transformers, nystromformer / nystrom-attention) and every batch and length: both sides are built
with the same weights, features, rotations or landmarks, their outputs and input gradients compared
(or how they differ said), then one forward and backward of each is timed in alternation, A B B A,
for the rounds, float32 on the CPU. The report gives each side's median, ours / theirs of the medians
and the quartiles of the paired ratios, as a Markdown table and, with --json, a record with the
machine, the torch threads and the load average at the start and the end.

    python scripts/authors_ab.py --lengths 1024,2048,4096,8192,16384 --batch 1,4 --rounds 7 \\
        --json results/throughput/authors-ab.json --markdown results/throughput/authors-ab.md

Needs the ``[authors]`` extra (pip install -e ".[authors]"). Run it on an idle machine: every other
process's load moves both sides' times, and their ratio less only because the sides alternate."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

# the installed (or PYTHONPATH's) package first; this checkout otherwise
if importlib.util.find_spec("attentions") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_pairs import PAIRS, Pair, check, step  # noqa: E402
from kernel_ab import parse_ints, quartiles  # noqa: E402
from lra.cli import Parser, console  # noqa: E402
from lra.errors import UserError  # noqa: E402
from lra.machine import describe, git_commit, hardware  # noqa: E402
from lra.machine.allocator import keep_all_freed_memory  # noqa: E402

# the packages each pair needs (the [authors] extra)
NEEDS = {"performer": "performer_pytorch", "reformer": "transformers", "local": "local_attention",
         "longformer": "transformers", "bigbird": "transformers", "nystromformer": "transformers"}


def time_pair(pair: Pair, rounds: int) -> Tuple[List[float], List[float]]:
    """Seconds per forward and backward of ours and theirs, alternating A B B A, after one warm step each."""
    sides = [step(pair.ours, pair.inputs), step(pair.theirs, pair.inputs)]
    for run in sides:
        run()
    times: List[List[float]] = [[], []]
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            sides[i]()
            times[i].append(time.perf_counter() - start)
    return times[0], times[1]


def markdown(rows: List[Dict[str, Any]], footer: str) -> str:
    lines = ["| baseline | authors' code | B | N | ours | theirs | ours / theirs (paired quartiles) | results |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        q = r["paired_ratio_quartiles"]
        lines.append(f"| {r['baseline']} | {r['theirs']} | {r['batch']} | {r['length']} | {r['ours_s'] * 1e3:.1f} ms | "
                     f"{r['theirs_s'] * 1e3:.1f} ms | {r['ratio']:.2f} ({q[0]:.2f}-{q[2]:.2f}) | {r['results']} |")
    return "\n".join(lines) + "\n\n" + footer + "\n"


def run(argv: Optional[List[str]] = None) -> int:
    p = Parser(prog="authors_ab", description=__doc__.splitlines()[0])
    p.add_argument("--attn", default=",".join(PAIRS), help=f"baselines, comma-separated (of {', '.join(PAIRS)})")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="sequence lengths, comma-separated")
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--heads", default="4")
    p.add_argument("--head-dim", default="32")
    p.add_argument("--rounds", default="7", help="timed steps per side (A B B A)")
    p.add_argument("--threads", default="2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    args = p.parse_args(argv)
    names = [n for n in args.attn.split(",") if n]
    unknown = [n for n in names if n not in PAIRS]
    if unknown or not names:
        raise UserError(f"--attn {args.attn!r}: no pair for {', '.join(unknown) or '(none given)'}; pairs: {', '.join(PAIRS)}")
    missing = sorted({NEEDS[n] for n in names if importlib.util.find_spec(NEEDS[n]) is None})
    if missing:
        raise UserError(f"{', '.join(missing)} not installed: pip install -e '.[authors]' (the authors' packages)")
    lengths, batches = parse_ints(args.lengths, "lengths"), parse_ints(args.batch, "batch")
    (heads,), (head_dim,) = parse_ints(args.heads, "heads"), parse_ints(args.head_dim, "head-dim")
    (rounds,), (threads,) = parse_ints(args.rounds, "rounds"), parse_ints(args.threads, "threads")
    for path in (args.json, args.markdown):
        if path and not Path(path).resolve().parent.is_dir():
            raise UserError(f"{path}: its folder does not exist")
    torch.set_num_threads(threads)
    keep_all_freed_memory()
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    load = os.getloadavg()
    rows: List[Dict[str, Any]] = []
    print("| baseline | authors' code | B | N | ours | theirs | ours / theirs (paired quartiles) | results |")
    print("|---|---|---:|---:|---:|---:|---:|---|", flush=True)
    for name in names:
        for build in PAIRS[name]:
            for b in batches:
                for n in lengths:
                    pair = build(b, heads, n, head_dim, torch.Generator().manual_seed(args.seed))
                    results = check(pair)
                    ours, theirs = time_pair(pair, rounds)
                    paired = quartiles([a / t for a, t in zip(ours, theirs)])
                    row = {"baseline": name, "theirs": pair.theirs_name, "batch": b, "length": n,
                           "ours_s": quartiles(ours)[1], "theirs_s": quartiles(theirs)[1],
                           "ratio": quartiles(ours)[1] / quartiles(theirs)[1], "paired_ratio_quartiles": list(paired),
                           "results": results, "ours_times_s": ours, "theirs_times_s": theirs}
                    rows.append(row)
                    print(markdown([row], "").splitlines()[2], flush=True)
    end = os.getloadavg()
    machine = describe(hardware(torch.device("cpu")))
    worst = max(rows, key=lambda r: r["ratio"])
    verdict = (f"Largest ours / theirs: {worst['ratio']:.2f} ({worst['baseline']} against {worst['theirs']}, "
               f"B {worst['batch']}, N {worst['length']}).")
    footer = (f"Forward + backward to the inputs, float32, {heads} heads of {head_dim}, median of {rounds} rounds per side "
              f"(alternating A B B A); ours / theirs: ratio of the medians (paired: quartiles of the per-round "
              f"ratios). {machine}; {threads} torch threads, torch {torch.__version__}; checkout {git_commit()}; "
              f"load average (1 / 5 / 15 min) {' / '.join(f'{x:.2f}' for x in load)} at the start, "
              f"{' / '.join(f'{x:.2f}' for x in end)} at the end. " + verdict)
    print("\n" + footer)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, footer))
    if args.json:
        versions = {}
        for module in sorted(set(NEEDS[n] for n in names)):
            versions[module] = getattr(importlib.import_module(module), "__version__", "?")
        record = {"kind": "authors_ab", "tree": git_commit(), "machine": machine, "torch": torch.__version__,
                  "packages": versions, "torch_threads": threads, "heads": heads, "head_dim": head_dim, "rounds": rounds,
                  "seed": args.seed, "load_average": {"start": [round(x, 2) for x in load], "end": [round(x, 2) for x in end]},
                  "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    console("authors_ab", run)
