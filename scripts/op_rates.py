"""Each C operator's time, FLOP rate and share of the measured matmul rate, at the shapes the backends give it.

MiTA, MoBA and Top-k run one forward and backward at ``lra-bench attention``'s shapes (batch, heads
and head dim: its defaults; each backend's values from lra/configs/attn/<name>.yaml; no padding) at
each length, float32 on the CPU. Every ``lra::`` operator they call (attentions/ops/*/cpu.py) is
recorded with its inputs; each distinct call is then timed alone, the median of ``--repeats`` after
a warm-up (lra/bench/measure.py; a call shorter than 10 ms repeated within each timed run), and an
operator's time in the step is the sum over its calls.
FLOPs are counted from the inputs' shapes (a multiply-add is 2): grouped attention 4 D (S + M) a
(query, expert) pair forward and twice that backward, the landmark pass 4 m N D a head forward and
twice that backward, routing 2 N m D, the block gate 2 N (N / block) D, the k-row products 2 k D a
row. Selection, pooling, row copies and merges count none (memory-bound, like the softmax and top-k
in lra/bench/flops.py): their rate is elements per second (the elements they read). The share is
GFLOP/s over lra-bench's GEMM point (``--gemm-size``), measured in the same process and threads.

    python scripts/op_rates.py --lengths 1k,4k,16k,64k --out results/op_rates/NAME

Writes op_rates.json and op_rates.md into --out.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the installed (or PYTHONPATH's) lra first, so another checkout can be timed; this one otherwise
if importlib.util.find_spec("lra") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attentions import build_attention  # noqa: E402
from lra.bench.cli import MODEL_DEFAULTS, parse_lengths, parser as bench_parser  # noqa: E402
from lra.bench.measure import measure  # noqa: E402
from lra.bench.report import fmt_length, fmt_time  # noqa: E402
from lra.bench.workloads import gemm_modes  # noqa: E402
from lra.config import backend_values  # noqa: E402
from lra.files import output_folder, write_atomic_set  # noqa: E402
from lra.machine import describe, git_commit, hardware, load_average  # noqa: E402

BACKENDS = ("mita", "moba", "topk")
CPU = torch.device("cpu")
# (FLOPs or None where none are counted, elements read) of one call, from its arguments
Count = Callable[[Tuple[Any, ...]], Tuple[Optional[float], float]]


def grouped_sizes(args: Tuple[Any, ...]) -> Tuple[int, int, int]:
    """(pairs with an expert, keys a pair attends to: S routed + M shared, D) of grouped_forward/backward."""
    q, keys, rows, shared_keys, offsets = args[0], args[1], args[5], args[3], args[9]
    width = (rows.shape[1] if rows is not None else keys.shape[1]) + (0 if shared_keys is None else shared_keys.shape[1])
    return int(offsets[-1]), width, q.shape[1]


def landmark_sizes(args: Tuple[Any, ...]) -> float:
    """G m N D of the landmark pass: marks [G, m, D], keys [G, N, D]."""
    g, m, d = args[0].shape
    return float(g * m * args[1].shape[1] * d)


def flops_and_elements(flops: Callable[[Tuple[Any, ...]], float], elements: Callable[[Tuple[Any, ...]], float]) -> Count:
    return lambda args: (flops(args), elements(args))


def elements_only(elements: Callable[[Tuple[Any, ...]], float]) -> Count:
    return lambda args: (None, elements(args))


# each query's scores against the landmarks: q [G, N, D], marks [G, m, D]
ROUTING = flops_and_elements(lambda a: 2.0 * a[0].numel() * a[1].shape[1], lambda a: a[0].numel())

COUNTS: Dict[str, Count] = {
    "grouped_forward": flops_and_elements(lambda a: 4.0 * math.prod(grouped_sizes(a)), lambda a: a[0].numel()),
    "grouped_backward": flops_and_elements(lambda a: 8.0 * math.prod(grouped_sizes(a)), lambda a: a[0].numel()),
    "landmark_forward": flops_and_elements(lambda a: 4.0 * landmark_sizes(a), lambda a: a[1].numel()),
    "landmark_backward": flops_and_elements(lambda a: 8.0 * landmark_sizes(a), lambda a: a[1].numel()),
    "landmark_backward_add": flops_and_elements(lambda a: 8.0 * landmark_sizes(a), lambda a: a[1].numel()),
    # MiTA's layer backward: the grouped backward and the landmark pass's (marks [G, m, D], keys [G N, D])
    "mita_backward": flops_and_elements(
        lambda a: 8.0 * math.prod(grouped_sizes(a)) + 8.0 * a[3].numel() * (a[1].shape[0] // a[3].shape[0]),
        lambda a: a[0].numel()),
    # MiTA's layer forward before its grouped attention: the landmark pass 4 m N D and the routing
    # 2 N m D a head (q, k, v [G, N, D], args[5] landmarks; pooling, selection and sort count none)
    "mita_prepare": flops_and_elements(lambda a: 6.0 * a[0].numel() * a[5], lambda a: a[0].numel()),
    # route_order then sorts the queries by expert (no FLOPs)
    "route_best": ROUTING,
    "route_order": ROUTING,
    # q [B, H, N, D] against the block means [B, H, blocks, D]
    "block_gate": flops_and_elements(lambda a: 2.0 * a[0].numel() * a[1].shape[2], lambda a: a[0].numel()),
    # w [R, k], idx [R, k], table [G N, D]
    "mix_rows": flops_and_elements(lambda a: 2.0 * a[0].numel() * a[2].shape[1], lambda a: a[0].numel() * a[2].shape[1]),
    # x [R, D], idx [R, k]
    "dot_rows": flops_and_elements(lambda a: 2.0 * a[1].numel() * a[0].shape[1], lambda a: a[1].numel() * a[0].shape[1]),
    # w [R, k], idx, x [R, D]
    "scatter_outer": flops_and_elements(lambda a: 2.0 * a[0].numel() * a[2].shape[1], lambda a: a[0].numel() * a[2].shape[1]),
    "topk_select": elements_only(lambda a: a[0].numel()),
    # q [B, H, C, D], k_t [B, H, D, N], v, bias, keys: the scores 2 C N D and the mix 2 C k D (the
    # selection counts none); elements: the scores
    "topk_attention": flops_and_elements(lambda a: 2.0 * a[0].numel() * (a[1].shape[-1] + a[4]),
                                         lambda a: a[0].numel() // a[0].shape[-1] * a[1].shape[-1]),
    "pool_bins": elements_only(lambda a: a[0].numel()),
    "pool_bins_backward": elements_only(lambda a: a[0].shape[0] * a[4] * a[0].shape[2]),
    "pool_bins_backward_add": elements_only(lambda a: a[4].numel()),
    "take_rows": elements_only(lambda a: a[1].numel() * a[0].shape[1]),
    "merge_parts": elements_only(lambda a: a[0].numel()),
    "merge_parts_backward": elements_only(lambda a: a[0].numel()),
}


def first_tensor_elements(args: Tuple[Any, ...]) -> Tuple[Optional[float], float]:
    """An operator without a count here: no FLOPs, the elements of its first tensor."""
    return None, float(next((a.numel() for a in args if isinstance(a, torch.Tensor)), 0))


def signature(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """What makes two calls of one operator the same work: the inputs' shapes and the other arguments."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


class Recorder(TorchDispatchMode):
    """Records each distinct ``lra::`` call (its inputs copied, so that it can run again alone) and how
    many times the step makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Dict[Tuple[str, Tuple[Any, ...]], Dict[str, Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if func.namespace == "lra":
            key = (func.__name__.split(".")[0], signature(args))
            if key in self.calls:
                self.calls[key]["count"] += 1
            else:
                copied = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
                self.calls[key] = {"op": func, "args": copied, "kwargs": dict(kwargs), "count": 1}
        return func(*args, **kwargs)


def record_step(backend: str, n: int, batch: int, heads: int, head_dim: int, seed: int
                ) -> Dict[Tuple[str, Tuple[Any, ...]], Dict[str, Any]]:
    """The lra:: calls of one forward and backward of ``backend`` on q, k, v [B, H, N, D] (no mask)."""
    values = {k: v for k, v in backend_values(backend).items() if k != "tasks"}
    attn = build_attention(backend, num_heads=heads, head_dim=head_dim, max_len=n, **values)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(batch, heads, n, head_dim, generator=gen)
    recorder = Recorder()
    with recorder:
        attn(q, k, v).backward(grad_out)
    return recorder.calls


# a timed run of a short call repeats it until the run takes about this long (the clock's and the
# thread pool's start-up then weigh little)
RUN_S = 0.01


def calls_per_run(call: Dict[str, Any]) -> int:
    """How many times one timed run makes ``call``: enough for about RUN_S seconds, at most 1000."""
    once = time.perf_counter()
    call["op"](*call["args"], **call["kwargs"])
    return max(1, min(1000, int(RUN_S / max(time.perf_counter() - once, 1e-9))))


def time_calls(calls: Dict[Tuple[str, Tuple[Any, ...]], Dict[str, Any]], warmup: int, repeats: int
               ) -> Dict[str, Dict[str, Any]]:
    """Per operator: calls in the step, FLOPs (None: not counted), elements, seconds in the step (each
    distinct call's median times its count) and the distinct calls' timings."""
    loops = [calls_per_run(c) for c in calls.values()]
    modes = {str(i): (lambda c=c, k=k: [c["op"](*c["args"], **c["kwargs"]) for _ in range(k)])
             for i, (c, k) in enumerate(zip(calls.values(), loops))}
    stats = measure(modes, warmup, repeats, math.inf, CPU)
    ops: Dict[str, Dict[str, Any]] = {}
    for i, ((name, _), call) in enumerate(calls.items()):
        flops, elements = COUNTS.get(name, first_tensor_elements)(call["args"])
        op = ops.setdefault(name, {"calls": 0, "flops": 0.0 if flops is not None else None, "elements": 0.0,
                                   "seconds": 0.0, "timings": []})
        count, median = call["count"], float(stats[str(i)]["median_s"]) / loops[i]
        op["calls"] += count
        op["elements"] += count * float(elements)
        op["seconds"] += count * median
        if op["flops"] is not None and flops is not None:
            op["flops"] += count * float(flops)
        op["timings"].append({"shapes": [list(s) if isinstance(s, tuple) else s for s in signature(call["args"])
                                         if isinstance(s, tuple)], "count": count, "median_s": median,
                              "spread": stats[str(i)]["spread"], "calls_per_run": loops[i]})
    return ops


def gemm_rate(size: int, warmup: int, repeats: int) -> Dict[str, Any]:
    """lra-bench's GEMM point in this process: a float32 [size, size] matmul's FLOP/s (median)."""
    modes, flops = gemm_modes(size, CPU, torch.float32)
    stats = measure(modes, warmup, repeats, math.inf, CPU)["matmul"]
    return {"size": size, "dtype": "float32", "flops": flops, "median_s": stats["median_s"],
            "flops_per_s": flops / stats["median_s"]}


def rows_of(backend: str, n: int, ops: Dict[str, Dict[str, Any]], rate: float) -> List[Dict[str, Any]]:
    rows = []
    for name, op in ops.items():
        per_s = None if op["flops"] is None else op["flops"] / op["seconds"]
        rows.append({"backend": backend, "length": n, "op": f"lra::{name}", "calls": op["calls"], "flops": op["flops"],
                     "elements": op["elements"], "seconds": op["seconds"], "flops_per_s": per_s,
                     "gemm_fraction": None if per_s is None else per_s / rate,
                     "elements_per_s": op["elements"] / op["seconds"], "timings": op["timings"]})
    return rows


def markdown(record: Dict[str, Any]) -> str:
    s, gemm = record["settings"], record["gemm"]
    lines = [
        f"## C operators at lra-bench attention's shapes: B={s['batch']}, H={s['heads']}, D={s['head_dim']}, float32",
        "",
        f"{record['machine']} ({record['torch_threads']} torch threads); torch {record['torch']}; commit "
        f"{record['commit']}; load average (1 min) {record['load_average']['start'][0]} at start, "
        f"{record['load_average']['end'][0]} at end. Median of {s['repeats']} timed runs of each distinct call after "
        f"{s['warmup']} warm-up; time = the operator's calls in one forward + backward of the backend.",
        f"GEMM: {gemm['size']}x{gemm['size']} float32, {gemm['flops_per_s'] / 1e9:.1f} GFLOP/s (lra-bench's GEMM point). "
        "FLOPs counted from the shapes (a multiply-add is 2; scripts/op_rates.py); `-` = not counted (memory-bound: "
        "selection, pooling, row copies, merges), its rate in elements read per second.",
        "",
        "| backend | operator | N | calls | GFLOP | time | GFLOP/s | of GEMM | Melem/s (not counted) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in sorted(record["rows"], key=lambda r: (BACKENDS.index(r["backend"]) if r["backend"] in BACKENDS else 99,
                                                      r["op"], r["length"])):
        counted = row["flops"] is not None
        lines.append(
            f"| {row['backend']} | {row['op']} | {fmt_length(row['length'])} | {row['calls']} | "
            f"{row['flops'] / 1e9:.3g} | " if counted else
            f"| {row['backend']} | {row['op']} | {fmt_length(row['length'])} | {row['calls']} | - | "
        )
        lines[-1] += (f"{fmt_time(row['seconds'])} | "
                      + (f"{row['flops_per_s'] / 1e9:.3g} | {row['gemm_fraction']:.1%} | - |" if counted else
                         f"- | - | {row['elements_per_s'] / 1e6:.3g} |"))
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    bench = bench_parser().parse_args(["attention"])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn", default=",".join(BACKENDS), help=f"backends (default {','.join(BACKENDS)})")
    p.add_argument("--lengths", default="1k,4k,16k,64k", help="k = 1024 (default 1k,4k,16k,64k)")
    p.add_argument("--batch", type=int, default=bench.batch, help=f"default {bench.batch}, as lra-bench attention")
    # lra-bench attention leaves --heads unset and takes the model's default
    heads = bench.heads or MODEL_DEFAULTS["heads"]
    p.add_argument("--heads", type=int, default=heads, help=f"default {heads}, as lra-bench attention")
    p.add_argument("--head-dim", type=int, default=bench.head_dim, help=f"default {bench.head_dim}, as lra-bench attention")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--gemm-size", type=int, default=bench.gemm_size, help=f"default {bench.gemm_size}, as lra-bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (default results/op_rates/cpu-<date>-<time>)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backends = [b.strip() for b in args.attn.split(",") if b.strip()]
    lengths = parse_lengths(args.lengths)
    out = output_folder(args.out, "results/op_rates/cpu")
    start = load_average()
    gemm = gemm_rate(args.gemm_size, args.warmup, args.repeats)
    rows = []
    for n in lengths:
        for backend in backends:
            calls = record_step(backend, n, args.batch, args.heads, args.head_dim, args.seed)
            rows += rows_of(backend, n, time_calls(calls, args.warmup, args.repeats), gemm["flops_per_s"])
            print(f"{backend} N={fmt_length(n)}: {len(calls)} distinct lra:: calls timed", file=sys.stderr, flush=True)
    record = {
        "kind": "op_rates", "settings": {"backends": backends, "lengths": lengths, "batch": args.batch,
                                         "heads": args.heads, "head_dim": args.head_dim, "warmup": args.warmup,
                                         "repeats": args.repeats, "seed": args.seed},
        "machine": describe(hardware(CPU)), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "commit": git_commit(), "load_average": {"start": start, "end": load_average()}, "gemm": gemm, "rows": rows,
    }
    text = markdown(record)
    write_atomic_set([(out / "op_rates.json", (json.dumps(record, indent=1) + "\n").encode()),
                      (out / "op_rates.md", text.encode())])
    print(text)
    print(f"record: {out / 'op_rates.json'} table: {out / 'op_rates.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
