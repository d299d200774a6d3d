"""The efficiency table: training time (each seed's and the mean, against full attention's where the
runs compare), throughput, peak memory, each run's machine speed and load; and the published figures."""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Dict, List, Tuple

from ..format import MISSING, Table, backend_order, fmt_count, fmt_duration
from .summary import AVG_TASKS, SOURCES, TITLES, grouped, summarize, task_list

MEMORY_KINDS = {"cpu_peak_rss": "CPU peak RSS", "cuda_max_allocated": "CUDA max allocated"}


def devices(records: List[Dict[str, Any]]) -> str:
    return ", ".join(sorted({str(r["device_name"]) for r in records}))


def efficiency_row(task: str, preset: str, attn: str, rs: List[Dict[str, Any]], full: List[Dict[str, Any]]
                   ) -> Tuple[List[str], Dict[str, Any]]:
    """The display row and the CSV row of one (task, preset, backend); only completed runs give numbers."""
    rs = sorted(rs, key=lambda r: r["seed"])  # per-seed cells in seed order
    time, speed, memory = (summarize(rs, key) for key in ("train_time_s", "tokens_per_s", "peak_memory_mb"))
    full_time = summarize(full, "train_time_s")
    # a ratio only between runs on the same hardware
    ratio = time.mean / full_time.mean if time.mean is not None and full_time.mean and devices(rs) == devices(full) else None
    if ratio is not None and not same_speed(rs + full):
        ratio = None
    kinds = ", ".join(sorted({MEMORY_KINDS.get(r["memory_kind"], r["memory_kind"]) for r in rs if r["status"] == "completed"}))
    loads = load_text(rs)
    rates = [r.get("matmul_gflops") for r in rs]
    rate_text = " / ".join(MISSING if x is None else f"{x:.0f}" for x in rates) if any(rates) else MISSING
    steps = round(statistics.fmean(r["steps"] for r in rs))
    budget = ", ".join(sorted({str(r["attn_budget"]) for r in rs}))
    # each seed's own time: a mean over runs from machines of different speed would hide it
    per_seed = [f"{r['train_time_s']:.0f}" for r in rs if r["status"] == "completed" and r.get("train_time_s") is not None]
    row = [
        TITLES.get(task, task), attn, preset, str(len(rs)), str(steps), budget,
        fmt_duration(time.mean) if time.mean is not None else time.text(),
        " / ".join(per_seed) if len(per_seed) > 1 else MISSING,
        f"{ratio:.2f}×" if ratio is not None else MISSING,
        fmt_count(speed.mean) if speed.mean is not None else speed.text(),
        f"{memory.mean:,.0f} MB ({kinds})" if memory.mean is not None else memory.text(),
        devices(rs), rate_text, loads,
    ]
    csv_row = {"task": task, "model": attn, "preset": preset, "seeds": len(rs), "diverged": time.diverged, "steps": steps,
               "attn_budget": budget,
               "train_time_s": time.mean, "train_time_s_per_seed": "; ".join(per_seed), "train_time_vs_full": ratio, "tokens_per_s": speed.mean,
               "peak_memory_mb": memory.mean, "memory_kind": kinds, "device_name": devices(rs),
               "matmul_gflops": None if rate_text == MISSING else rate_text,
               "load_average": None if loads == MISSING else loads}
    return row, csv_row


def same_speed(rs: List[Dict[str, Any]], tolerance: float = 1.2) -> bool:
    """Whether the runs' train times compare: all from one machine in one boot (one boot_id; their
    stamps then differ by load, which the table shows), or machine-speed stamps (matmul_gflops) within
    ``tolerance``x of each other; otherwise their times measure the machines as much as the backends.
    Runs without a stamp (version 1 records may lack it) cannot be checked and pass."""
    boots = {r.get("boot_id") for r in rs}
    if len(boots) == 1 and None not in boots:
        return True
    rates = [r["matmul_gflops"] for r in rs if r.get("matmul_gflops")]
    return not rates or max(rates) <= tolerance * min(rates)


def load_text(rs: List[Dict[str, Any]]) -> str:
    """Each run's 1 / 5 / 15 minute load average when its training ended ("; " between seeds), or
    missing when no record stores it (version 1 records may lack it)."""
    loads = [r.get("load_average") for r in rs]
    if not any(loads):
        return MISSING
    return "; ".join(MISSING if not load else " / ".join(f"{x:.2f}" for x in load) for load in loads)


def efficiency_table(records: List[Dict[str, Any]]) -> Table:
    table = Table("Training time and memory", ["Task", "Model", "Preset", "Seeds", "Steps", "Budget", "Train time", "Per seed (s)",
                                               "vs full", "Tokens/s", "Peak memory", "Device", "Matmul GFLOP/s",
                                               "Load (1/5/15 min)"])
    table.records = []
    groups = grouped(records)
    # (preset, attn) -> task -> mean train time, for the five-task totals
    totals: Dict[Tuple[str, str], Dict[str, float]] = defaultdict(dict)
    for task in task_list(records):
        table.breaks.append(len(table.rows))
        for preset in sorted({p for p, _, t in groups if t == task}):
            for attn in backend_order(a for p, a, t in groups if t == task and p == preset):
                full = groups.get((preset, "full", task), [])
                row, csv_row = efficiency_row(task, preset, attn, groups[(preset, attn, task)], full)
                table.rows.append(row)
                table.records.append(csv_row)
                if csv_row["train_time_s"] is not None and task in AVG_TASKS:
                    totals[(preset, attn)][task] = csv_row["train_time_s"]
    complete = sorted((key, sum(t.values())) for key, t in totals.items() if len(t) == len(AVG_TASKS))
    if complete:
        table.breaks.append(len(table.rows))
    for (preset, attn), seconds in complete:
        table.rows.append(["LRA total (5 tasks)", attn, preset, *[MISSING] * 3, fmt_duration(seconds), *[MISSING] * 7])
    table.notes = ["Budget: keys one query attends to, as the backend reports it for the run's settings; "
                   "train time: wall-clock of the training steps (evaluation excluded), mean over completed seeds, and each "
                   "seed's in seed order (runs of one row may come from machines of different speed: compare them); "
                   "vs full: train time over full attention's on the same task, preset and device, left out (—) "
                   "where the runs' matmul stamps differ by more than 1.2x, unless they all ran on one machine in one "
                   "boot (the records' boot_id; version 1 records may lack it); "
                   "peak memory: CUDA max allocated on a GPU, the process's peak RSS on the CPU; "
                   "matmul GFLOP/s: each seed's machine speed, a float32 1024 x 1024 matmul at the run's thread "
                   "count when training ended (machines of one name can differ 2x; — = not in the record); "
                   "load: the machine's load averages when training ended, the run's own threads included "
                   "(train times compare only at similar loads; — = not in the record)."]
    return table


def published_efficiency_table(rows: List[Dict[str, str]], reference: str) -> Table:
    table = Table("Published training time, memory and throughput", ["Source", "Hardware", "What", "Model", "Value", "Notes"])
    for row in rows:
        table.rows.append([SOURCES.get(row["source"], row["source"]), row["hardware"], row["what"], row["model"],
                           f"{row['value']} {row['unit']}", row.get("notes", "")])
    table.notes = [f"From {reference}."]
    return table
