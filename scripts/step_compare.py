"""Training-step time of several backends side by side in one process, at LRA's lengths.

The encoder of the LRA paper protocol (2 layers, width 64, 2 heads, FFN 128, dropout 0.1), padded
batches (row lengths drawn from N/2..N, the first row N, with the padding mask), one step = forward,
cross-entropy, backward, AdamW. The backends' steps are interleaved (one of each per round), so a
change of machine load hits them alike; the median of the rounds is reported with full's median
divided by each backend's. Unlike ``lra-bench model --preset lra`` (a process per point, records
and tables), this is the quick A/B tool: point PYTHONPATH at another checkout to time its code.

    python scripts/step_compare.py --attn full,mita,moba,topk,floor --lengths 1024,2048,4096 --batch 8

(``floor`` times the model with a pass-through attention: full / floor is the ceiling of any
backend's ratio.) ``--compile`` adds each backend's model under torch.compile (``<backend>+compiled``,
timed after the warm-up step that compiles it) to the same rounds, so eager and compiled steps are
measured side by side; ``--compile aot_eager`` names another torch.compile backend than inductor.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

# the installed (or PYTHONPATH's) lra first, so another checkout can be timed; this one otherwise
if importlib.util.find_spec("lra") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lra.machine.allocator import keep_all_freed_memory, setting_now  # noqa: E402
from lra.bench.estimate import PassThrough  # noqa: E402
from lra.config import ModelConfig  # noqa: E402
from lra.model import LRAModel  # noqa: E402

VOCAB, CLASSES = 20, 10
FLOOR = "floor"
COMPILED = "+compiled"


def make_step(backend: str, n: int, batch: int, seed: int, compiler: str = "inductor") -> Callable[[], None]:
    """One training step of the LRA encoder with ``backend`` on a fixed padded batch; backend
    "floor": the model with every attention replaced by a pass-through (output = v), i.e. what
    the rest of the model costs, which no backend can go below; a name ending in "+compiled": that
    backend's model under torch.compile(backend=compiler)."""
    compiled = backend.endswith(COMPILED)
    backend = backend[: -len(COMPILED)] if compiled else backend
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, dim=64, num_heads=2, ffn_dim=128, dropout=0.1)
    model = LRAModel(cfg, "full" if backend == FLOOR else backend, {}, vocab_size=VOCAB, num_classes=CLASSES,
                     max_len=n)
    if backend == FLOOR:
        for block in model.encoder.blocks:
            block.attn = PassThrough()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model, backend=compiler) if compiled else model
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, n), generator=gen)  # [B, N]
    lengths = torch.randint(n // 2, n + 1, (batch,), generator=gen)  # [B]
    lengths[0] = n
    labels = torch.randint(0, CLASSES, (batch,), generator=gen)

    def step() -> None:
        F.cross_entropy(forward(tokens, lengths), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compare(backends: List[str], n: int, batch: int, rounds: int, seed: int, compiler: str = "inductor"
            ) -> Dict[str, float]:
    """Median step time (s) of each backend over ``rounds`` interleaved rounds, after one warm-up."""
    steps = {name: make_step(name, n, batch, seed, compiler) for name in backends}
    for step in steps.values():
        step()
    times: Dict[str, List[float]] = {name: [] for name in backends}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default="full,mita,moba,topk",
                   help=f"backends, comma-separated; full first; {FLOOR!r}: the model without attention")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--batch", default="8", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time each backend's model under torch.compile (default backend inductor)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # as lra-bench's timed runs: no page faults after the first step (memory is not measured here)
    keep_all_freed_memory()
    backends = args.attn.split(",")
    if args.compile:
        backends += [b + COMPILED for b in backends]
    load = os.getloadavg()[0]
    print(f"| batch | N | " + " | ".join(f"{b} step" for b in backends) + " | "
          + " | ".join(f"full/{b}" for b in backends[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(backends) - 1))
    for batch in (int(b) for b in args.batch.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            med = compare(backends, n, batch, args.rounds, args.seed, args.compile or "inductor")
            base = med[backends[0]]
            print(f"| {batch} | {n} | " + " | ".join(f"{med[b] * 1000:.0f} ms" for b in backends) + " | "
                  + " | ".join(f"{base / med[b]:.2f}x" for b in backends[1:]) + " |", flush=True)
    print(f"\n{torch.get_num_threads()} torch threads, torch {torch.__version__}; load average (1 min) "
          f"{load:.2f} at start, {os.getloadavg()[0]:.2f} at end; allocator: {setting_now()}")


if __name__ == "__main__":
    main()
