"""Training-step time of several backends side by side in one process, at LRA's lengths, with the ceiling.

The encoder of the LRA paper protocol (2 layers, width 64, 2 heads, FFN 128, dropout 0.1), padded
batches (row lengths drawn from N/2..N, the first row N, with the padding mask), one step = forward,
cross-entropy, backward, AdamW (the trainer's, fused where torch has it). The backends' steps are
interleaved (one of each per round), so a change of machine load hits them alike; the median of the
rounds is reported with full's median divided by each backend's. Full and ``none`` (the model
without attention: out = v, what the rest of the step costs) are timed in every round, named or
not: full / none is the ceiling, the largest ratio any backend can reach, and each backend's share
of it, (t_full - t_backend) / (t_full - t_none), is the fraction of the attention's time the
backend removes (100% = as fast as no attention). Unlike ``lra-bench model --preset lra`` (a
process per point, records and tables), this is the quick A/B tool: point PYTHONPATH at another
checkout to time its code.

    python scripts/step_compare.py --attn full,mita,moba,topk --lengths 1024,2048,4096 --batch 8 --json step.json

``--compile`` adds each named backend's model under torch.compile (``<backend>+compiled``, timed
after the warm-up step that compiles it) to the same rounds, so eager and compiled steps are
measured side by side; ``--compile aot_eager`` names another torch.compile backend than inductor.
``floor`` is read as ``none``."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

# the installed (or PYTHONPATH's) lra first, so another checkout can be timed; this one otherwise
if importlib.util.find_spec("lra") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lra.machine.allocator import keep_all_freed_memory, setting_now  # noqa: E402
from lra.config import ModelConfig  # noqa: E402
from lra.machine import describe, git_commit, hardware  # noqa: E402
from lra.model import LRAModel  # noqa: E402
from lra.run.setup import adamw  # noqa: E402

VOCAB, CLASSES = 20, 10
FULL, NONE = "full", "none"
# another name of the model without attention
ALIASES = {"floor": NONE}
COMPILED = "+compiled"


def make_step(backend: str, n: int, batch: int, seed: int, compiler: str = "inductor") -> Callable[[], None]:
    """One training step of the LRA encoder with ``backend`` on a fixed padded batch; backend
    "none": the model without attention (out = v), what the rest of the model costs, which no
    backend can go below; a name ending in "+compiled": that backend's model under
    torch.compile(backend=compiler)."""
    compiled = backend.endswith(COMPILED)
    backend = backend[: -len(COMPILED)] if compiled else backend
    backend = ALIASES.get(backend, backend)
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, dim=64, num_heads=2, ffn_dim=128, dropout=0.1)
    model = LRAModel(cfg, backend, {}, vocab_size=VOCAB, num_classes=CLASSES, max_len=n)
    optimizer = adamw(model.parameters(), lr=1e-4)  # the trainer's AdamW
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


def timed_backends(named: List[str], compile_: bool) -> List[str]:
    """The backends of each round: full first, the named ones, their compiled forms, none last."""
    names = [ALIASES.get(b, b) for b in named if b]
    eager = [FULL] + [b for b in dict.fromkeys(names) if b not in (FULL, NONE)]
    return eager + ([b + COMPILED for b in eager] if compile_ else []) + [NONE]


def summary(med: Dict[str, float]) -> Dict[str, Dict[str, Optional[float]]]:
    """Per backend (full and none aside): full / backend and its share of the ceiling,
    (t_full - t_backend) / (t_full - t_none), None where full is not slower than none."""
    full, none = med[FULL], med[NONE]
    return {b: {"ratio": full / t, "share": (full - t) / (full - none) if full > none else None}
            for b, t in med.items() if b not in (FULL, NONE)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default="full,mita,moba,topk",
                   help="backends, comma-separated; full and none (the model without attention) are always timed")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--batch", default="8", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time each backend's model under torch.compile (default backend inductor)")
    p.add_argument("--json", metavar="PATH", help="also write the medians, ratios and shares with the machine as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # as lra-bench's timed runs: no page faults after the first step (memory is not measured here)
    keep_all_freed_memory()
    backends = timed_backends(args.attn.split(","), bool(args.compile))
    others = [b for b in backends if b not in (FULL, NONE)]
    load = os.getloadavg()
    print("| batch | N | " + " | ".join(f"{b} step" for b in backends) + " | "
          + " | ".join(f"full/{b}" for b in others) + " | ceiling full/none | "
          + " | ".join(f"{b} share" for b in others) + " |")
    print("|---|---:|" + "---:|" * (len(backends) + 2 * len(others) + 1))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            med = compare(backends, n, batch, args.rounds, args.seed, args.compile or "inductor")
            each = summary(med)
            rows.append({"batch": batch, "length": n, "median_s": med, "ceiling": med[FULL] / med[NONE],
                         "ratio": {b: each[b]["ratio"] for b in others}, "share": {b: each[b]["share"] for b in others}})
            print(f"| {batch} | {n} | " + " | ".join(f"{med[b] * 1000:.0f} ms" for b in backends) + " | "
                  + " | ".join(f"{each[b]['ratio']:.2f}x" for b in others)
                  + f" | {med[FULL] / med[NONE]:.2f}x | "
                  + " | ".join("n/a" if each[b]["share"] is None else f"{each[b]['share']:.0%}" for b in others)
                  + " |", flush=True)
    end = os.getloadavg()
    machine = describe(hardware(torch.device("cpu")))
    print("\nshare = (full step - backend step) / (full step - none step): the part of full's attention time the "
          "backend removes (100%: as fast as the model without attention; below 0: slower than full).")
    print(f"{machine}; {torch.get_num_threads()} torch threads, torch {torch.__version__}; load average (1 min) "
          f"{load[0]:.2f} at start, {end[0]:.2f} at end; allocator: {setting_now()}")
    if args.json:
        record = {"kind": "step_compare", "backends": backends, "rounds": args.rounds, "seed": args.seed,
                  "compile": args.compile, "machine": machine, "torch_threads": torch.get_num_threads(),
                  "torch": torch.__version__, "commit": git_commit(), "allocator": setting_now(),
                  "load_average": {"start": [round(x, 2) for x in load], "end": [round(x, 2) for x in end]},
                  "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
