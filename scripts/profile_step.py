"""Where the time of one benchmark step goes: torch.profiler over the point lra-bench would time.

    python scripts/profile_step.py model --attn full,mita --lengths 64k --batch 32 --out results/gpu/profile

It takes lra-bench's arguments (level, backends, lengths, options, dtype, device, warm-up; the
model level needs --batch: there is no batch search here) and three of its own: --steps (default
5), --mode train|forward (default train) and --top (rows per table, default 15). For each backend
and length it builds the point as lra-bench does (lra/bench/workloads.py), in this process, runs
the warm-up steps, times --steps steps unprofiled, then profiles --steps more. Per step it reports

  wall     the unprofiled step time (CUDA events on a GPU, the wall clock on the CPU), median; and
           the profiled steps' mean wall time, which the profiler's own work makes longer
  kernels  CUDA: the summed duration of the kernels the step ran; busy = kernels / profiled wall, and far
           under 100% means the host (Python, launches, synchronisations) sets the pace.
           CPU: the time spent inside aten operators and the suite's C kernels (self time; the C
           kernels are the torch.library operators lra::<name>); the rest is Python
  calls    aten and lra operators per step, and CUDA kernels launched

and the operators and kernels that took the most of it: on CUDA an operator's time is that of the
kernels it launched itself (Triton kernels are launched by no operator: see the kernel table).
Writes profile.md and profile.json into --out (default results/profile/<level>-<device>-<time>)
once every point has run.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lra.machine.allocator import keep_freed_memory  # noqa: E402
from lra.bench.cli import parse, settings_from  # noqa: E402
from lra.bench.measure import timed  # noqa: E402
from lra.bench.point import DTYPES  # noqa: E402
from lra.bench.sweep import Settings, child_spec  # noqa: E402
from lra.bench.workloads import attention_modes, attention_module, build_model, model_modes  # noqa: E402
from lra.cli import Parser, call  # noqa: E402
from lra.errors import UserError  # noqa: E402
from lra.files import output_folder, write_atomic, write_json_atomic  # noqa: E402
from lra.machine import describe, hardware, load_average, versions  # noqa: E402

PROG = "profile_step.py"


def step_of(spec: Dict[str, Any], device: torch.device, dtype: torch.dtype, mode: str) -> Callable[[], None]:
    """The callable lra-bench times for this point and mode."""
    if spec["level"] == "model":
        return model_modes(build_model(spec, device), spec, device, dtype)[mode]
    attn = attention_module(spec, device, dtype)
    return attention_modes(attn, attn, spec, spec["length"], device, dtype)[mode]


def rows(events: List[Any], time_of: Callable[[Any], float], steps: int, top: int) -> List[Dict[str, Any]]:
    """The ``top`` events by time, per step: name, calls, ms and share of all the events' time."""
    total = sum(time_of(e) for e in events) or 1.0
    ranked = sorted(events, key=time_of, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count / steps, "ms": time_of(e) / 1e3 / steps, "share": time_of(e) / total}
            for e in ranked if time_of(e) > 0]


def profile_point(spec: Dict[str, Any], mode: str, steps: int, top: int) -> Dict[str, Any]:
    device, dtype = torch.device(spec["device"]), DTYPES[spec["dtype"]]
    torch.manual_seed(spec["seed"])
    step = step_of(spec, device, dtype, mode)
    for _ in range(max(1, spec["warmup"])):  # at least one: kernels compile on the first call
        step()
    wall = statistics.median(timed(step, device) for _ in range(steps))
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize(device)
        profiled_s = (time.perf_counter() - begin) / steps
    events = prof.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.key.startswith(("aten::", "lra::"))]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    op_time = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    busy_us = sum(e.self_device_time_total for e in kernels) if gpu else sum(e.self_cpu_time_total for e in ops)
    return {
        "backend": spec["backend"], "length": spec["length"], "batch": spec["batch"],
        "wall_ms": wall * 1e3, "profiled_wall_ms": profiled_s * 1e3, "busy_ms": busy_us / 1e3 / steps,
        "busy": busy_us / 1e6 / steps / profiled_s,
        "ops_per_step": sum(e.count for e in ops) / steps,
        "kernels_per_step": sum(e.count for e in kernels) / steps if gpu else None,
        "operators": rows(ops, op_time, steps, top),
        "kernels": rows(kernels, lambda e: e.self_device_time_total, steps, top) if gpu else [],
    }


def fmt_table(title: str, entries: List[Dict[str, Any]]) -> List[str]:
    lines = [f"| {title} | calls/step | ms/step | share |", "|---|---:|---:|---:|"]
    for r in entries:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| `{name}` | {r['calls']:.0f} | {r['ms']:.3f} | {100 * r['share']:.1f}% |")
    return lines


def markdown(record: Dict[str, Any]) -> str:
    s, gpu = record["settings"], record["settings"]["device"] == "cuda"
    # on the CPU the rest of the wall time is Python
    busy, share = ("kernels", "busy") if gpu else ("in operators", "of profiled")
    out = [f"## Profile of one {s['mode']} step, {s['level']} level ({record['hardware_name']}, {s['dtype']})", "",
           f"{record['command']}  ", f"torch {record['versions']['torch']}, commit {record['versions']['git_commit']}; "
           f"load average (1 min) {record['load_average'][0]:.2f} at start; {s['steps']} steps timed, {s['steps']} "
           "profiled (scripts/profile_step.py's docstring says what each column is).", "",
           f"| backend | N | batch | wall ms/step | profiled | {busy} ms/step | {share} | ops/step | kernels/step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in record["points"]:
        kernels = "—" if p["kernels_per_step"] is None else f"{p['kernels_per_step']:.0f}"
        out.append(f"| {p['backend']} | {p['length']} | {p['batch']} | {p['wall_ms']:.2f} | "
                   f"{p['profiled_wall_ms']:.2f} | {p['busy_ms']:.2f} | {100 * p['busy']:.0f}% | "
                   f"{p['ops_per_step']:.0f} | {kernels} |")
    for p in record["points"]:
        out += ["", f"### {p['backend']}, N = {p['length']}, batch {p['batch']}", ""]
        title = "operator (device time of its own kernels)" if gpu else "operator or C kernel (self CPU time)"
        out += fmt_table(title, p["operators"])
        if gpu:
            out += [""] + fmt_table("kernel", p["kernels"])
    return "\n".join(out) + "\n"


def own_parser() -> Parser:
    p = Parser(prog=PROG, description="Profile one lra-bench point per backend and length; lra-bench's arguments "
               "follow (e.g. model --attn full,mita --lengths 64k --batch 32).")
    p.add_argument("--steps", type=int, default=5, help="steps timed, then profiled (default 5)")
    p.add_argument("--mode", choices=("train", "forward"), default="train", help="which step (default train)")
    p.add_argument("--top", type=int, default=15, help="rows in each operator / kernel table (default 15)")
    p.add_argument("--out", help="output folder (default results/profile/<level>-<device>-<time>)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    own, rest = own_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.steps < 1 or own.top < 1:
        raise UserError(f"--steps and --top must be at least 1, got {own.steps} and {own.top}")
    args = parse(rest)
    if args.level not in ("attention", "model"):
        raise UserError(f"profile_step.py profiles the attention or model level, not {args.level!r}")
    settings: Settings = settings_from(args)
    if settings.level == "model" and settings.batch is None:
        raise UserError("the model level needs --batch (no batch search here: give the batch the sweep chose)")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    keep_freed_memory()
    device = torch.device(settings.device)
    record: Dict[str, Any] = {
        "command": f"python scripts/{PROG} " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(device), "versions": versions(), "load_average": load_average(),
        "settings": {"level": settings.level, "mode": own.mode, "steps": own.steps, "device": settings.device,
                     "dtype": settings.dtype, "attn_options": settings.attn_options},
        "points": [],
    }
    record["hardware_name"] = describe(record["hardware"])
    for backend in settings.backends:
        for length in settings.lengths:
            spec = child_spec(settings, backend, length, settings.batch or 1)
            point = profile_point(spec, own.mode, own.steps, own.top)
            print(f"{backend} N={length}: {point['wall_ms']:.2f} ms/step", flush=True)
            record["points"].append(point)
    out = output_folder(own.out, f"results/profile/{settings.level}-{settings.device}")
    text = markdown(record)
    write_json_atomic(out / "profile.json", record)
    write_atomic(out / "profile.md", text.encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(call(PROG, main))
