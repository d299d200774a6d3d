"""A git revision's whole package (Python and C kernels) against the working tree's, on the backends' attention
layers: one worker process per tree, taking turns.

scripts/kernel_ab.py swaps kernel libraries under one Python, so it takes only revisions whose kernels
the working tree's Python can call; a change on the Python side, or a new kernel library, needs the
revision's own code. Here the revision is unpacked (git archive) into a temporary folder and each tree's
code runs in its own worker (PYTHONPATH; its kernels built and cached as its ops/native.py builds them).
Each backend's layer, forward and backward, on the inputs of kernel_ab.py (B x H x N x D float32,
lengths drawn from N/2..N, the first row N); the parent asks the workers for a turn at a time, A B B A,
each idle while the other runs, so that a change of the machine's speed hits both alike. A turn is two
steps, the second timed: the caches hold the other process's data when a turn starts (one timed step per
turn measured MiTA's layer at 1K 8% slower than in one process, its paired ratios spread 4x wider). The report
gives each tree's median, the median of the paired ratios (working tree / revision) with their
quartiles, and whether the two give the same output and gradients bit for bit.

    python scripts/revision_ab.py --base HEAD~1 --attn mita --lengths 1024,4096 --batch 8 --rounds 30

About 5 s per backend and length at 1K (30 rounds, 2 threads), plus the workers' start (a few seconds,
and the kernels' build on first use)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import ROOT, Report, commit_of, settings  # noqa: E402
from lra.cli import console  # noqa: E402
from lra.errors import UserError  # noqa: E402

# seconds between two steps (see compare)
PAUSE_S = 0.05

# one tree's worker: builds the layer and its inputs (kernel_ab.layer_step's, written out: the worker
# imports nothing but the tree's own package, which may predate the scripts), then answers "step" with the step's seconds,
# "save PATH" by writing the output and the q, k, v gradients there, and ends at end of input
WORKER = r"""
import sys, time, torch
from attentions import build_attention
name, n, batch, heads, head_dim, seed, threads = sys.argv[1], *map(int, sys.argv[2:8])
torch.set_num_threads(threads)
try:
    from lra.machine.allocator import keep_all_freed_memory
    keep_all_freed_memory()
except ImportError:
    pass
attn = build_attention(name, num_heads=heads, head_dim=head_dim, max_len=n)
gen = torch.Generator().manual_seed(seed)
q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).requires_grad_() for _ in range(3))
lengths = torch.randint(n // 2, n + 1, (batch,), generator=gen)
lengths[0] = n
mask = torch.arange(n)[None] < lengths[:, None]
def step():
    out = attn(q, k, v, mask)
    return [out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))]
step()
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("save "):
        torch.save(step(), line[5:].strip())
        print("saved", flush=True)
    else:
        step()  # the caches hold the other worker's data: one step to fill them, the next timed
        start = time.perf_counter()
        step()
        print(time.perf_counter() - start, flush=True)
"""


def unpack(rev: str, into: Path) -> str:
    """The revision's files unpacked into ``into``; its full commit hash."""
    commit = commit_of(rev)
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # the "data" filter where this Python has it (3.12, and 3.9-3.11 from their 2023 releases):
        # the archive is this repository's own, but no member may land outside the folder
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return commit


class Worker:
    """One tree's worker process for one backend and length."""

    def __init__(self, tree: Path, label: str, settings: List[str], log: Path) -> None:
        self.label, self.log = label, log
        env = {**os.environ, "PYTHONPATH": str(tree)}
        with log.open("w") as errors:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER, *settings], cwd=tree, env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        self.answer()

    def answer(self, request: Optional[str] = None) -> str:
        line = ""
        try:
            if request is not None:
                self.proc.stdin.write(request + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:  # it stopped since its last answer
            pass
        if not line:
            self.close()
            said = self.log.read_text().strip().splitlines()
            raise UserError(f"the {self.label}'s worker stopped: {said[-1] if said else 'no message'}")
        return line.strip()

    def step(self) -> float:
        return float(self.answer("step"))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # a request it did not read
            pass
        self.proc.wait()


def compare(trees: List[Tuple[Path, str]], settings: List[str], rounds: int, tmp: Path
            ) -> Tuple[List[List[float]], str]:
    """Times of the layer step per tree (A B B A over the rounds) and how the two trees' results compare."""
    workers = []
    try:
        for tree, label in trees:
            workers.append(Worker(tree, label, settings, tmp / f"{label.split()[0]}.log"))
        saved = []
        for i, worker in enumerate(workers):
            saved.append(tmp / f"results-{i}.pt")
            worker.answer(f"save {saved[-1]}")
        times: List[List[float]] = [[] for _ in workers]
        for r in range(rounds):
            for i in (range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))):
                # the other worker's threads spin a while after its step (OpenMP's wait policy) before
                # they sleep: a pause first, so that they do not take cores from this step
                time.sleep(PAUSE_S)
                times[i].append(workers[i].step())
    finally:
        for worker in workers:
            worker.close()
    a, b = (torch.load(path) for path in saved)
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return times, "same bits"
    return times, f"max diff {max(float((x - y).abs().max()) for x, y in zip(a, b)):.2e}"


def run(argv: Optional[List[str]] = None) -> int:
    s = settings("revision_ab", __doc__, "the git revision whose code is timed against the working tree's", "mita",
                 "30", argv)
    with tempfile.TemporaryDirectory(prefix="revision-ab-") as tmp:
        base = Path(tmp) / "base"
        base_commit = unpack(s.base, base)
        trees = [(base, f"base {base_commit[:7]}"), (ROOT, "working tree")]
        report = Report("revision_ab", base_commit, s)
        for name in s.backends:
            for n in s.lengths:
                worker_args = [name, *(str(x) for x in (n, s.batch, s.heads, s.head_dim, s.seed, s.threads))]
                report.row(name, n, *compare(trees, worker_args, s.rounds, Path(tmp)))
    report.finish(f"{s.rounds} rounds per tree, one worker process per tree", {})
    return 0


if __name__ == "__main__":
    console("revision_ab", run)
