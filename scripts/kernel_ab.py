"""The C kernels of a git revision against the working tree's, on the backends' attention layers, in one process.

Every kernel library (attentions/csrc/*.c) is built twice with the flags the suite builds with
(attentions/ops/native.py, LRA_KERNEL_WIDTH included): from the revision's sources and from the
working tree's. Each backend's attention layer, forward and backward (B x H x N x D float32, padded
rows as in step_compare.py: lengths drawn from N/2..N, the first row N), then runs on one set and
the other in alternation, A B B A, so that a change of the machine's speed hits both alike; the
report gives each set's median, the median of the paired ratios (working tree / revision) with
their quartiles, and whether the two sets give the same output and gradients bit for bit. On a
noisy machine the paired ratio is the figure to read: step_compare.py's model steps vary by more
than a kernel change often moves them.

    python scripts/kernel_ab.py --base HEAD~1 --attn mita,moba,topk --lengths 1024,4096 --batch 8 --rounds 40

About 20 s per backend and length at 1K (40 rounds, 2 threads). The Python side is the working
tree's: a revision whose kernels take other argument blocks (a `typedef struct` of a .c file that
differs) is refused."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# the installed (or PYTHONPATH's) package first; this checkout otherwise
if importlib.util.find_spec("attentions") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attentions import build_attention, list_attentions  # noqa: E402
from attentions.ops import native  # noqa: E402
from lra.cli import Parser, console  # noqa: E402
from lra.errors import UserError  # noqa: E402
from lra.machine import describe, git_commit, hardware  # noqa: E402
from lra.machine.allocator import keep_all_freed_memory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CSRC = "attentions/csrc"
STRUCT = re.compile(r"typedef struct \{.*?\} \w+;", re.S)
COMMENT = re.compile(r"/\*.*?\*/", re.S)
# a function the library exports: defined at the start of a line, not static
EXPORTED = re.compile(r"^(?:int|void|float|double|int64_t)\s+\**(\w+)\s*\(", re.M)


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"git {args[0]} failed")
    return done.stdout


def commit_of(rev: str) -> str:
    """The full hash of --base's commit, or a UserError saying it is not one."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()
    except UserError:
        raise UserError(f"--base {rev!r} is not a commit of this repository (see `git log`)") from None


def revision_sources(rev: str, into: Path) -> str:
    """The revision's kernel sources written into ``into``; its full commit hash."""
    commit = commit_of(rev)
    names = [line for line in git("ls-tree", "--name-only", f"{commit}:{CSRC}").splitlines()
             if line.endswith((".c", ".h"))]
    if not names:
        raise UserError(f"revision {rev} has no kernel sources in {CSRC}")
    into.mkdir(parents=True)
    for name in names:
        (into / name).write_bytes(subprocess.run(["git", "show", f"{commit}:{CSRC}/{name}"], cwd=ROOT,
                                                 capture_output=True, check=True).stdout)
    return commit


def blocks(source: str) -> List[str]:
    """The argument blocks (typedef structs) of a C source, without comments or layout."""
    return [" ".join(COMMENT.sub(" ", block).split()) for block in STRUCT.findall(source)]


def check_blocks(base: Path, tree: Path, libraries: Sequence[str]) -> None:
    """Refuse a revision whose kernels the working tree's Python cannot call: other argument blocks,
    or a function the working tree's library has and the revision's lacks."""
    for name in libraries:
        old, new = base / f"{name}.c", tree / f"{name}.c"
        if not old.exists():
            raise UserError(f"the revision has no {name}.c: its kernels cannot stand in for the working tree's")
        old_text, new_text = old.read_text(), new.read_text()
        if blocks(old_text) != blocks(new_text):
            raise UserError(f"{name}.c's argument blocks (typedef struct) differ between the revision and the "
                          f"working tree: the working tree's Python cannot drive the revision's build")
        missing = sorted(set(EXPORTED.findall(new_text)) - set(EXPORTED.findall(old_text)))
        if missing:
            raise UserError(f"the revision's {name}.c lacks {', '.join(missing)}, which the working tree's Python "
                          f"calls: pick a later revision")


def build(source_dir: Path, out_dir: Path, libraries: Sequence[str]) -> Dict[str, ctypes.CDLL]:
    """Each library built from source_dir as ops/native.py builds it, loaded."""
    cc, extra = native.compiler(), native.width_flags()
    if cc is None:
        raise UserError(native.why_not("grouped_cpu") or "no C compiler found (set CC)")
    if extra is None:
        raise UserError(f"LRA_KERNEL_WIDTH={os.environ.get('LRA_KERNEL_WIDTH')!r} is not a width the kernels build "
                      f"at: use 8, 16 or native")
    libs = {}
    for name in libraries:
        target = out_dir / f"{name}.so"
        error = native._build(source_dir / f"{name}.c", cc, target, extra)
        if error:
            raise UserError(f"{name}.c does not build from {source_dir}: {error}")
        libs[name] = ctypes.CDLL(str(target))
    return libs


def use(libs: Dict[str, ctypes.CDLL]) -> None:
    """The operators call these libraries from now on (ops/native.py's cache of loaded libraries)."""
    for name, lib in libs.items():
        native._loaded[name] = lib


def layer_step(name: str, n: int, batch: int, heads: int, head_dim: int, seed: int):
    """One forward and backward of backend ``name``'s layer on a fixed padded batch; returns the
    step and a function giving its output and gradients."""
    attn = build_attention(name, num_heads=heads, head_dim=head_dim, max_len=n)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).requires_grad_() for _ in range(3))
    lengths = torch.randint(n // 2, n + 1, (batch,), generator=gen)
    lengths[0] = n
    mask = torch.arange(n)[None] < lengths[:, None]

    def results() -> List[torch.Tensor]:
        out = attn(q, k, v, mask)
        return [out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))]

    def step() -> None:
        out = attn(q, k, v, mask)
        torch.autograd.grad(out.sum(), (q, k, v))

    return step, results


def same_results(a: List[torch.Tensor], b: List[torch.Tensor]) -> str:
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return "same bits"
    return f"max diff {max(float((x - y).abs().max()) for x, y in zip(a, b)):.2e}"


def compare(sets: Sequence[Dict[str, ctypes.CDLL]], name: str, n: int, batch: int, heads: int, head_dim: int,
            rounds: int, seed: int) -> Tuple[List[List[float]], str]:
    """Times of the layer step per set (A B B A over the rounds) and how the two sets' results compare."""
    step, results = layer_step(name, n, batch, heads, head_dim, seed)
    outs = []
    for libs in sets:
        use(libs)
        outs.append(results())
        step()  # warm
    times: List[List[float]] = [[] for _ in sets]
    for r in range(rounds):
        for i in (range(len(sets)) if r % 2 == 0 else reversed(range(len(sets)))):
            use(sets[i])
            start = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - start)
    return times, same_results(outs[0], outs[1])


def quartiles(x: Sequence[float]) -> Tuple[float, float, float]:
    s = sorted(x)
    return s[len(s) // 4], s[len(s) // 2], s[(3 * len(s)) // 4]


def parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"--{what} {text!r}: give positive whole numbers, comma-separated (e.g. 1024,4096)")
    return values


@dataclass
class Settings:
    """What an A/B run times: the backends' layers at each length, and how."""

    base: str
    backends: List[str]
    lengths: List[int]
    batch: int
    heads: int
    head_dim: int
    rounds: int
    threads: int
    seed: int
    json: Optional[str]


def settings(prog: str, doc: str, base_help: str, default_attn: str, default_rounds: str,
             argv: Optional[List[str]]) -> Settings:
    """The command line both A/B scripts take (kernel_ab.py, revision_ab.py), checked."""
    p = Parser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--base", required=True, help=base_help)
    p.add_argument("--attn", default=default_attn, help="backends, comma-separated")
    p.add_argument("--lengths", default="1024", help="sequence lengths, comma-separated")
    p.add_argument("--batch", default="8", help="batch size")
    p.add_argument("--heads", default="2")
    p.add_argument("--head-dim", default="32")
    p.add_argument("--rounds", default=default_rounds, help="timed steps per side (A B B A)")
    p.add_argument("--threads", default="2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the times, ratios and the machine as JSON")
    args = p.parse_args(argv)
    backends = [b for b in args.attn.split(",") if b]
    unknown = [b for b in backends if b not in list_attentions()]
    if unknown or not backends:
        raise UserError(f"--attn {args.attn!r}: unknown backend(s) {', '.join(unknown) or '(none given)'}; "
                        f"known: {', '.join(list_attentions())}")
    lengths = parse_ints(args.lengths, "lengths")
    (batch,), (heads,), (head_dim,) = (parse_ints(args.batch, "batch"), parse_ints(args.heads, "heads"),
                                       parse_ints(args.head_dim, "head-dim"))
    (rounds,), (threads,) = parse_ints(args.rounds, "rounds"), parse_ints(args.threads, "threads")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UserError(f"--json {args.json}: its folder does not exist")
    return Settings(args.base, backends, lengths, batch, heads, head_dim, rounds, threads, args.seed, args.json)


class Report:
    """The A/B table, printed row by row, and the record --json writes."""

    def __init__(self, kind: str, base_commit: str, s: Settings) -> None:
        self.kind, self.base_commit, self.s, self.rows = kind, base_commit, s, []
        self.load = os.getloadavg()
        print(f"| backend | N | base {base_commit[:7]} | working tree | tree / base (quartiles) | results |")
        print("|---|---:|---:|---:|---:|---|")

    def row(self, name: str, n: int, times: List[List[float]], same: str) -> None:
        ratio = quartiles([t / b for t, b in zip(times[1], times[0])])
        med = [quartiles(t)[1] for t in times]
        self.rows.append({"backend": name, "length": n, "median_s": {"base": med[0], "tree": med[1]},
                          "ratio_quartiles": list(ratio), "results": same})
        print(f"| {name} | {n} | {med[0] * 1e3:.2f} ms | {med[1] * 1e3:.2f} ms | {ratio[1]:.3f} "
              f"({ratio[0]:.3f}-{ratio[2]:.3f}) | {same} |", flush=True)

    def finish(self, how: str, extra: Dict[str, object]) -> None:
        """The footer (``how``: what ran, after the layer's shape) and the JSON record with ``extra``."""
        s, end = self.s, os.getloadavg()
        machine = describe(hardware(torch.device("cpu")))
        print(f"\nlayer forward + backward, batch {s.batch}, {s.heads} heads of {s.head_dim}, float32, {how}; "
              f"{machine}; {s.threads} torch threads, torch {torch.__version__}; working tree at {git_commit()}; "
              f"load average (1 min) {self.load[0]:.2f} at start, {end[0]:.2f} at end")
        if s.json:
            record = {"kind": self.kind, "base": self.base_commit, "tree": git_commit(), "backends": s.backends,
                      "batch": s.batch, "heads": s.heads, "head_dim": s.head_dim, "rounds": s.rounds, "seed": s.seed,
                      "machine": machine, "torch_threads": s.threads, **extra, "torch": torch.__version__,
                      "load_average": {"start": [round(x, 2) for x in self.load], "end": [round(x, 2) for x in end]},
                      "rows": self.rows}
            Path(s.json).write_text(json.dumps(record, indent=1) + "\n")


def run(argv: Optional[List[str]] = None) -> int:
    s = settings("kernel_ab", __doc__, "the git revision whose kernels are timed against the working tree's",
                 "mita,moba,topk", "40", argv)
    libraries = sorted(path.stem for path in (ROOT / CSRC).glob("*.c"))
    torch.set_num_threads(s.threads)
    keep_all_freed_memory()
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        base_commit = revision_sources(s.base, Path(tmp) / "base")
        check_blocks(Path(tmp) / "base", ROOT / CSRC, libraries)
        sets = [build(Path(tmp) / "base", Path(tmp) / "base-build", libraries),
                build(ROOT / CSRC, Path(tmp) / "tree-build", libraries)]
        report = Report("kernel_ab", base_commit, s)
        for name in s.backends:
            for n in s.lengths:
                report.row(name, n, *compare(sets, name, n, s.batch, s.heads, s.head_dim, s.rounds, s.seed))
    width = native.vector_width("grouped_cpu")
    report.finish(f"{s.rounds} rounds per set, kernels {width} floats wide", {"vector_width": width})
    return 0


if __name__ == "__main__":
    console("kernel_ab", run)
