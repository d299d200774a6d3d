"""lra-bench: throughput of the attention backends from 1K to 1M tokens, on the CPU or one GPU.

    lra-bench attention --attn full,mita --lengths 16k,64k        # one attention call [B, H, N, D]
    lra-bench model --lengths 64k,256k,1m                         # the MiTA paper's speed setup
    lra-bench model --preset lra-table2                           # the LRA paper's Table 2, every backend interleaved
    lra-bench report results/throughput/NAME/record.json          # table and plot again

Every point runs in its own process (lra/bench/point.py) under a time budget and, on the CPU, a
memory cap; points that run out of memory or time are recorded as ``oom`` / ``timeout``. Full and
top-k attention too slow to run whole are estimated from a slice of the queries (marked ``~``).
``--interleaved`` runs every backend of one length in one process instead, timed in rounds
(lra/bench/interleaved.py); ``--task`` times the model of a task's configuration (lra/bench/task_model.py).
The sweep writes record.json, table.md and throughput.png to --out (see lra/bench/sweep.py,
lra/bench/report.py). The record is saved after every point; the same command on the same --out
finishes an unfinished one, keeping what it measured (lra/bench/resume.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import yaml

from attentions import build_attention, list_attentions

from ..machine.allocator import setting as allocator_setting
from ..config import MAX_BATCH, MAX_LAYERS, MAX_PROCESSES, MAX_WIDTH
from ..machine import hardware, meminfo_gb, versions
from .flops import efficiency
from .record import read_record
from .plot import plot
from .report import markdown, slopes
from .resume import check_same, kept_points, unfinished
from .sweep import Settings, recorded_settings, sweep
from .task_model import task_settings
from ..cli import Parser, console
from ..errors import UserError
from ..files import output_folder, write_atomic, write_atomic_set

LENGTH = re.compile(r"^(\d+)([km]?)$")
# the longest sequence a point may take: 16 times the MiTA paper's 1M
MAX_LENGTH = 1 << 24
DEFAULT_LENGTHS = {"attention": "1k,4k,16k,64k,256k,1m", "model": "64k,256k,1m"}
# lra-bench model --preset NAME: defaults for the model-level flags (flags given still win).
# "lra": the encoder of the LRA paper protocol (configs/tasks/listops.yaml: 2 layers, width 64,
# 2 heads, FFN 128, dropout 0.1) at LRA's lengths, padded batches of 8 on float32 CPU threads
# "lra-table2": the LRA paper's efficiency benchmark (Tay et al. 2021, Table 2): the official Text model
# (configs/tasks/text.yaml presets.official) at 1K-4K, batch 32 where every backend fits, every backend
# interleaved with full attention in one process a length (docs/benchmarks.md says what differs)
MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "lra": {"layers": 2, "width": 64, "heads": 2, "ffn_dim": 128, "dropout": 0.1, "lengths": "1k,2k,4k",
            "batch": 8, "padded": True, "threads": 2},
    "lra-table2": {"task": "text", "task_preset": "official", "lengths": "1k,2k,3k,4k", "batch": 32, "padded": True,
                   "interleaved": True, "repeats": 3},
}
# the model level's encoder when neither --task nor a preset gives one (the MiTA paper's speed setup)
MODEL_DEFAULTS: Dict[str, Any] = {"layers": 3, "width": 128, "heads": 4, "ffn_dim": 256, "dropout": 0.0}


def parse_length(text: str) -> int:
    """'4096', '4k' (4 x 1024) or '1m' (1024 x 1024) -> tokens."""
    match = LENGTH.match(text.strip().lower())
    if match is None or int(match.group(1)) == 0:
        raise UserError(f"--lengths: {text!r} is not a length; use positive numbers with an optional k or m "
                        "suffix (k = 1024), e.g. 1k,4k,16k,64k,256k,1m")
    length = int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[match.group(2)]
    if length > MAX_LENGTH:
        raise UserError(f"--lengths: {text!r} is {length:,} tokens; the longest is {MAX_LENGTH:,} (16m)")
    return length


def parse_lengths(text: str) -> List[int]:
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise UserError("--lengths needs at least one length, e.g. 1k,4k,16k,64k,256k,1m")
    return sorted({parse_length(part) for part in parts})


def parse_backends(text: Optional[str]) -> List[str]:
    """The backends named (``none``, the model without attention, only when named), or every one."""
    if text is None:
        return list_attentions()
    known = list_attentions(timing=True)
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in known:
            raise UserError(f"--attn: unknown attention {name!r}; known: {', '.join(known)}")
    if not names:
        raise UserError(f"--attn needs at least one backend; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def parse_attn_opts(items: List[str], backends: List[str]) -> Dict[str, Dict[str, Any]]:
    """['mita.topk=32', ...] -> {'mita': {'topk': 32}}, values read as YAML."""
    options: Dict[str, Dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        backend, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise UserError(f"--attn-opt {item!r} must look like backend.key=value, e.g. mita.topk=32")
        if backend not in backends:
            raise UserError(f"--attn-opt {item!r}: {backend!r} is not among the benchmarked backends ({', '.join(backends)})")
        options.setdefault(backend, {})[name] = yaml.safe_load(raw)
    return options


def parser() -> Parser:
    p = Parser(prog="lra-bench", description="Measure attention throughput from 1K to 1M tokens, every point in its own process.")
    sub = p.add_subparsers(dest="level", required=True, parser_class=Parser)
    attention = sub.add_parser("attention", help="one attention call on [B, H, N, D]: forward, forward + backward")
    model = sub.add_parser("model", help="3-layer encoder of width 128: inference step, training step, batch searched")
    for level, q in (("attention", attention), ("model", model)):
        q.add_argument("--attn", help=f"backends, comma-separated (default: all registered: {', '.join(list_attentions())}); "
                       "none: the model without attention, whose time full's is divided by for the ceiling")
        q.add_argument("--lengths", default=DEFAULT_LENGTHS[level], help=f"k = 1024, m = 1024^2 (default {DEFAULT_LENGTHS[level]})")
        q.add_argument("--heads", type=int, help="attention heads (default 4)")
        q.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: cuda if present")
        q.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"), help="default: bf16 on CUDA, fp32 on the CPU")
        q.add_argument("--budget-s", type=float, default=600.0, help="seconds a point may take (default 600)")
        q.add_argument("--max-mem-gb", type=float, help="memory a point may add, GiB (default on the CPU: 80%% of available; 0 = no cap)")
        q.add_argument("--warmup", type=int, default=1, help="warm-up runs of each mode (default 1)")
        q.add_argument("--repeats", type=int, default=5, help="timed runs of each mode, fewer if the budget is short (default 5)")
        q.add_argument("--estimate", default="auto", choices=("auto", "always", "never"),
                       help="full/topk from a slice of queries: when a whole run would overrun the budget (auto)")
        q.add_argument("--slice-queries", type=int, default=1024, help="queries in an estimate's slice (default 1024)")
        q.add_argument("--attn-opt", action="append", default=[], metavar="BACKEND.KEY=VALUE", help="e.g. mita.topk=32 (may repeat)")
        q.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
        q.add_argument("--gemm-size", type=int, default=4096, help="side of the GEMM that gives the machine's matmul rate (0 = skip)")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--out", help="output folder (default results/throughput/<level>-<device>-<time>)")
        q.add_argument("--quiet", action="store_true", help="no progress bar")
        q.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    report = sub.add_parser("report", help="rewrite a sweep's table.md and throughput.png from its record.json")
    report.add_argument("record", help="a record.json written by lra-bench")
    report.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    attention.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    attention.add_argument("--head-dim", type=int, default=32, help="head dim D (default 32)")
    model.add_argument("--batch", type=int, help="fixed batch (default: searched per point, doubling from 1)")
    model.add_argument("--max-batch", type=int, default=64, help="largest batch the search tries (default 64)")
    model.add_argument("--min-gain", type=float, default=0.05, help="stop doubling below this throughput gain (default 0.05)")
    model.add_argument("--layers", type=int, help="encoder layers (default 3)")
    model.add_argument("--width", type=int, help="model width C (default 128)")
    model.add_argument("--ffn-dim", type=int, help="FFN hidden width (default 256)")
    model.add_argument("--dropout", type=float, help="dropout in the training step (default 0)")
    model.add_argument("--padded", action="store_true",
                       help="padded batches: row lengths drawn from N/2..N (the first row N), with the padding mask")
    model.add_argument("--task", help="the model, optimizer and each backend's options of this task's configuration "
                       "(--task-preset) in place of the layer flags; the length stays --lengths")
    model.add_argument("--task-preset", default="paper", help="the preset of --task's configuration (default paper)")
    model.add_argument("--interleaved", action="store_true",
                       help="every backend at one length in one process: each one's memory step, then --repeats "
                            "rounds of one training step of each (ratios to full from the same rounds); the batch "
                            "is --batch, halved for every backend while one runs out of memory; --budget-s is a "
                            "backend's at one length")
    model.add_argument("--preset", choices=sorted(MODEL_PRESETS),
                       help="defaults for the other flags; lra: LRA training shapes (2 layers, width 64, 2 heads, "
                            "FFN 128, dropout 0.1, lengths 1k,2k,4k, padded batches of 8, 2 threads); lra-table2: "
                            "the LRA paper's Table 2 (--task text --task-preset official, lengths 1k,2k,3k,4k, "
                            "padded batches of 32, --interleaved, 3 rounds)")
    return p


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    """Arguments; a model --preset sets the defaults of the flags it names, then they are read again."""
    p = parser()
    args = p.parse_args(argv)
    preset = MODEL_PRESETS.get(getattr(args, "preset", None) or "")
    if preset:
        model = next(a for a in p._subparsers._group_actions if a.dest == "level").choices["model"]
        model.set_defaults(**preset)
        args = p.parse_args(argv)
    return args


# (flag, lowest, highest): whole-number flags; the highest lies far past any machine's reach, so that
# a typo is refused at once instead of a point being started for it
WHOLE_RANGES = [
    ("heads", 1, 4_096), ("repeats", 1, 1_000), ("slice_queries", 1, MAX_LENGTH), ("batch", 1, MAX_BATCH),
    ("head_dim", 1, 4_096), ("max_batch", 1, MAX_BATCH), ("layers", 1, MAX_LAYERS), ("width", 1, MAX_WIDTH),
    ("ffn_dim", 1, 16 * MAX_WIDTH), ("warmup", 0, 1_000), ("threads", 0, MAX_PROCESSES), ("gemm_size", 0, 65_536),
]
# a week: a point's budget past it is a typo
MAX_BUDGET_S = 7 * 24 * 3600.0


def check_ranges(args: argparse.Namespace) -> None:
    for name, low, high in WHOLE_RANGES:
        value = getattr(args, name, None)
        if value is not None and not low <= value <= high:
            raise UserError(f"--{name.replace('_', '-')} must be {low} to {high:,}, got {value}")
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        raise UserError(f"--budget-s must be more than 0 and at most {MAX_BUDGET_S:,.0f} (a week), got {args.budget_s}")
    if args.max_mem_gb is not None and not 0 <= args.max_mem_gb <= 1 << 20:
        raise UserError(f"--max-mem-gb must be 0 (no cap) to {1 << 20:,}, got {args.max_mem_gb}")


def model_values(args: argparse.Namespace, backends: List[str], options: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The encoder's settings: the layer flags (MODEL_DEFAULTS where not given), or --task's
    configuration (lra/bench/task_model.py), which a layer flag may not contradict."""
    given = [name for name in MODEL_DEFAULTS if getattr(args, name, None) is not None]
    if args.level == "model" and args.task:
        if given:
            flags = " and ".join(f"--{name.replace('_', '-')}" for name in given)
            raise UserError(f"{flags}: with --task {args.task} the model is its configuration's "
                            f"(--task-preset {args.task_preset}); drop {flags} or --task")
        return task_settings(args.task, args.task_preset, backends, options)
    values = {name: MODEL_DEFAULTS[name] if getattr(args, name, None) is None else getattr(args, name)
              for name in MODEL_DEFAULTS}
    if args.level == "model" and values["width"] % values["heads"]:
        raise UserError(f"--width ({values['width']}) must be divisible by --heads ({values['heads']})")
    head_dim = args.head_dim if args.level == "attention" else values["width"] // values["heads"]
    return {**values, "head_dim": head_dim, "attn_options": options}


def settings_from(args: argparse.Namespace) -> Settings:
    check_ranges(args)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu")
    dtype = {"fp32": "float32", "bf16": "bfloat16", "auto": "bfloat16" if device == "cuda" else "float32"}[args.dtype]
    level = args.level
    interleaved = getattr(args, "interleaved", False)
    if interleaved and args.batch is None:
        raise UserError("--interleaved needs --batch: the batch every backend starts at (halved while one runs out of memory)")
    backends = parse_backends(args.attn)
    values = model_values(args, backends, parse_attn_opts(args.attn_opt, backends))
    for backend in backends:
        # unknown or invalid options fail here, in one line, before any point runs
        build_attention(backend, num_heads=values["heads"], head_dim=values["head_dim"], max_len=64,
                        **values["attn_options"].get(backend, {}))
    max_mem = args.max_mem_gb
    if max_mem is None and device == "cpu":
        max_mem = round(0.8 * (meminfo_gb("MemAvailable") or 8.0), 1)
    return Settings(
        level=level, backends=backends, lengths=parse_lengths(args.lengths), device=device, dtype=dtype,
        batch=args.batch, budget_s=args.budget_s, max_mem_gb=max_mem or None, warmup=args.warmup, repeats=args.repeats,
        estimate=args.estimate, slice_queries=args.slice_queries, threads=args.threads, gemm_size=args.gemm_size,
        max_batch=getattr(args, "max_batch", 1), min_gain=getattr(args, "min_gain", 0.0), seed=args.seed,
        padded=getattr(args, "padded", False), interleaved=interleaved, **values,
    )


def write(record: Dict[str, Any], out: Path, with_plot: bool) -> Dict[str, Path]:
    """record.json, table.md and throughput.png in ``out``, replaced together (a full disk: none)."""
    paths = {"record": out / "record.json", "table": out / "table.md"}
    files = [(paths["record"], record_bytes(record)), (paths["table"], (markdown(record) + "\n").encode())]
    if with_plot:
        paths["plot"] = out / "throughput.png"
        files.append((paths["plot"], plot(record)))
    write_atomic_set(files)
    return paths


def record_bytes(record: Dict[str, Any]) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()


def rewrite(path: str, with_plot: bool) -> int:
    """Tables and plot again from a record (after a change of the report, or of a record by hand)."""
    record = read_record(path)
    try:
        record["slopes"] = slopes(record)
        record["efficiency"] = efficiency(record)
        # built once before anything is written, so a malformed record changes no file
        markdown(record)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as err:
        raise UserError(f"{path}: a malformed lra-bench record ({type(err).__name__}: {err}); rerun the sweep that wrote it")
    paths = write(record, Path(path).parent, with_plot)
    print(" ".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if args.level == "report":
        return rewrite(args.record, not args.no_plot)
    settings = settings_from(args)
    allocator_setting()  # a bad LRA_MALLOC_TUNING says so before the output folder is made
    out = output_folder(args.out, f"results/throughput/{settings.level}-{settings.device}")
    partial = out / "record.json"
    # an unfinished record of this command (Ctrl-C, a kill, a pre-empted job): keep what it measured
    resume = unfinished(partial)
    if resume is not None:
        check_same(resume, recorded_settings(settings), hardware(torch.device(settings.device)), versions(), partial)
        kept = len(kept_points(resume, settings.interleaved)[0])
        print(f"lra-bench: resuming the unfinished sweep in {out}: {kept} of "
              f"{len(settings.backends) * len(settings.lengths)} points kept", file=sys.stderr)

    def save_partial(record: Dict[str, Any]) -> None:
        write_atomic(partial, record_bytes({**record, "complete": False}))

    record = sweep(settings, quiet=args.quiet, on_point=save_partial, resume=resume)
    record["command"] = "lra-bench " + " ".join(sys.argv[1:] if argv is None else argv)
    record["complete"] = True
    record["slopes"] = slopes(record)
    record["efficiency"] = efficiency(record)
    paths = write(record, out, not args.no_plot)
    print(markdown(record))
    print(" ".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def entry() -> None:
    console("lra-bench", main)


if __name__ == "__main__":
    entry()
