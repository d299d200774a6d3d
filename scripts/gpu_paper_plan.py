"""The training plan of scripts/gpu_paper_listops.sh, and the summary of what it ran.

    python scripts/gpu_paper_plan.py plan --budget-s 380 --out OUT     # OUT/plan.tsv, plan.json
    python scripts/gpu_paper_plan.py report --out OUT                  # OUT/summary.md, summary.json

``plan`` gives each backend the protocol that fits ``--budget-s`` seconds of wall clock, the seven
runs sharing one GPU at once. The expected time of a run is

    startup + step_ms x contention x (steps + eval_cost x (evaluations x eval_batches + test_batches))

with the step times below (one run alone on an H200, batch 32 x 2,000 tokens, bf16; derived in
results/gpu-plan/README.md from the committed H200 records and the CPU step times measured there).
The protocol is cut in this order, each cut only when the one before does not fit:

    paper       configs/tasks/listops.yaml unchanged: 5,000 steps, evaluation every 50 steps on 62 batches
    eval-250    the same training (steps, schedule, model), evaluated every 250 steps (20 evaluations,
                not 100): only the choice of the best checkpoint is coarser
    steps-N     N steps (a multiple of 500, at least 500), warm-up N/5 (the paper's 1,000 of 5,000),
                20 evaluations: a shorter schedule, no longer the paper's protocol
    not run     not even 500 steps fit

Every backend that fits at all gets the same protocol, the one the slowest of them fits: accuracies
and train times of runs with different schedules would not compare.

``report`` reads OUT/status.tsv (one line per step of the script), OUT/plan.json, OUT/train-exit.tsv and
the run folders in OUT/runs, and writes what ran, what stopped at its limit (with the steps done and
the best validation accuracy of its metrics.jsonl: a partial result) and what was not run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lra.cli import Parser, call  # noqa: E402
from lra.errors import UserError  # noqa: E402
from lra.files import write_atomic, write_json_atomic  # noqa: E402

PROG = "gpu_paper_plan.py"
# ms per training step of one run alone on an H200 (results/gpu-plan/README.md: the model around
# the attention ~4 ms of host time, plus two attention calls forward + backward each)
STEP_MS = {"full": 6.0, "linear": 7.0, "linformer": 8.0, "agent": 8.0, "moba": 12.0, "mita": 12.0, "topk": 13.0}
# seven processes time-slice one GPU: each step takes this many times as long as alone
CONTENTION = 2.5
# import, CUDA start, the token cache read, Triton's compilation, the first-call check, best_model.pt
STARTUP_S = 45.0
# an evaluation batch (forward only) against a training step (forward, backward, AdamW): the
# committed H200 records' forward / train time (full 0.29 at the model level, MiTA 0.52 there, MoBA
# 0.58 and top-k 0.68 at the attention level); a third for the dense and linear backends
EVAL_COST = {"full": 0.3, "linear": 1 / 3, "linformer": 1 / 3, "agent": 1 / 3, "moba": 0.58, "mita": 0.52, "topk": 0.68}
# the paper protocol (configs/tasks/listops.yaml) and the test split: 2,000 rows in batches of 32
PAPER = {"steps": 5000, "warmup_steps": 1000, "eval_every": 50, "eval_batches": 62}
TEST_BATCHES = 63
MIN_STEPS = 500


def expected_s(attn: str, steps: int, eval_every: int, eval_batches: int, contention: float = CONTENTION,
               startup_s: float = STARTUP_S) -> float:
    """Expected wall clock of one run of ``attn``, in seconds (the formula of the module's docstring)."""
    batches = steps + EVAL_COST[attn] * ((steps // eval_every) * eval_batches + TEST_BATCHES)
    return startup_s + STEP_MS[attn] / 1e3 * contention * batches


def tiers() -> List[Tuple[str, Dict[str, int]]]:
    """The protocols from the paper's down to the shortest, in the order they are cut to."""
    out = [("paper", dict(PAPER)), ("eval-250", {**PAPER, "eval_every": 250})]
    for steps in range(PAPER["steps"] - MIN_STEPS, MIN_STEPS - 1, -MIN_STEPS):
        out.append((f"steps-{steps}", {"steps": steps, "warmup_steps": steps // 5, "eval_every": steps // 20,
                                       "eval_batches": PAPER["eval_batches"]}))
    return out


def fitting(attn: str, budget_s: float, contention: float, startup_s: float) -> Optional[int]:
    """Index in tiers() of the first protocol of ``attn`` that fits ``budget_s``, or None."""
    for index, (_, p) in enumerate(tiers()):
        if expected_s(attn, p["steps"], p["eval_every"], p["eval_batches"], contention, startup_s) <= budget_s:
            return index
    return None


def protocols(backends: List[str], budget_s: float, contention: float = CONTENTION,
              startup_s: float = STARTUP_S) -> List[Dict[str, Any]]:
    """One protocol for every backend that fits at all: the first that the slowest of them fits, so
    that their accuracies and train times compare; a backend that fits none is 'not run'."""
    fits = {b: fitting(b, budget_s, contention, startup_s) for b in backends}
    runnable = [i for i in fits.values() if i is not None]
    name, values = tiers()[max(runnable)] if runnable else ("not run", None)
    plans = []
    for b in backends:
        if fits[b] is None:
            need = expected_s(b, MIN_STEPS, MIN_STEPS // 20, PAPER["eval_batches"], contention, startup_s)
            plans.append({"attn": b, "protocol": "not run", "values": None, "expected_s": None,
                          "why": f"{MIN_STEPS} steps need ~{need:.0f} s, the budget is {budget_s:.0f} s"})
            continue
        plans.append({"attn": b, "protocol": name, "values": values, "fits_alone": tiers()[fits[b]][0],
                      "expected_s": round(expected_s(b, values["steps"], values["eval_every"], values["eval_batches"],
                                                     contention, startup_s), 1)})
    return plans


def sets_of(plan: Dict[str, Any]) -> str:
    """The run's --set values: the protocol's ``train.*`` keys."""
    return " ".join(f"train.{key}={value}" for key, value in plan["values"].items())


def make_plan(backends: List[str], budget_s: float, out: Path, contention: float, startup_s: float,
              extra_set: str = "") -> List[Dict[str, Any]]:
    unknown = [b for b in backends if b not in STEP_MS]
    if unknown or not backends:
        raise UserError(f"--backends: {', '.join(unknown) or 'none given'}; valid: {', '.join(STEP_MS)}")
    if budget_s <= 0 or contention <= 0 or startup_s < 0:
        raise UserError(f"--budget-s and --contention must be positive, --startup-s 0 or more; got "
                        f"{budget_s:g}, {contention:g}, {startup_s:g}")
    plans = protocols(backends, budget_s, contention, startup_s)
    # the extra values come after the protocol's: lra-run applies --set in order, the last one wins
    lines = [f"{p['attn']}\t{'not run' if p['values'] is None else 'run'}\t"
             + ("" if p["values"] is None else f"{sets_of(p)} {extra_set}".strip()) for p in plans]
    write_json_atomic(out / "plan.json", {"budget_s": budget_s, "contention": contention, "startup_s": startup_s,
                                          "step_ms": STEP_MS, "eval_cost": EVAL_COST, "extra_set": extra_set,
                                          "runs": plans})
    write_atomic(out / "plan.tsv", ("\n".join(lines) + "\n").encode())
    return plans


# ---- report ----

def read_tsv(path: Path) -> List[List[str]]:
    if not path.is_file():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line.strip()]


def partial(run_dir: Path) -> Dict[str, Any]:
    """Steps logged and the best validation accuracy in a run's metrics.jsonl (an unfinished run's result)."""
    steps, best = 0, None
    path = run_dir / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        steps = max(steps, int(row.get("step", 0)))
        if "val_acc" in row and (best is None or row["val_acc"] > best):
            best = row["val_acc"]
    return {"steps_logged": steps, "best_val_acc": best}


EXIT = {0: "completed", 1: "ended without completing (diverged: see its record)", 2: "refused its input (see its log)",
        124: "stopped at its time limit", 130: "stopped by a signal", 137: "killed at its time limit"}


def run_rows(out: Path) -> List[Dict[str, Any]]:
    """One row per planned backend: the protocol, how the process ended, the record's numbers or the partial ones."""
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {"runs": []}
    exits = {row[0]: int(row[1]) for row in read_tsv(out / "train-exit.tsv") if len(row) > 1 and row[1].lstrip("-").isdigit()}
    rows = []
    for p in plan["runs"]:
        row: Dict[str, Any] = {"attn": p["attn"], "protocol": p["protocol"], "expected_s": p["expected_s"]}
        run_dir = out / "runs" / f"listops_{p['attn']}_paper_seed0"
        if p["values"] is None:
            row["state"] = f"not run: {p['why']}"
        elif p["attn"] not in exits:
            row["state"] = "not run: the training step did not start (see status.tsv)"
        else:
            rc = exits[p["attn"]]
            row["state"] = EXIT.get(rc, f"failed (exit {rc}; see logs/train-{p['attn']}.log)")
        record = run_dir / "record.json"
        if record.is_file():
            r = json.loads(record.read_text())
            row.update({k: r.get(k) for k in ("status", "steps", "best_step", "val_acc", "test_acc", "train_time_s",
                                              "eval_time_s", "tokens_per_s", "peak_memory_mb")})
            row["config_steps"] = r.get("config", {}).get("train", {}).get("steps")
        elif run_dir.is_dir():
            row.update(partial(run_dir))
        rows.append(row)
    return rows


def fmt(value: Any, spec: str = "") -> str:
    return "" if value is None else format(value, spec)


def report(out: Path) -> str:
    gpu = (out / "gpu.txt").read_text().strip().splitlines() if (out / "gpu.txt").is_file() else []
    steps = read_tsv(out / "status.tsv")
    rows = run_rows(out)
    lines = [f"# ListOps, paper protocol, on {gpu[0] if gpu else 'an unnamed device'}", ""]
    lines += ["## Steps of the script", "", "| step | state | seconds | detail |", "|---|---|---:|---|"]
    lines += [f"| {' | '.join((s + ['', '', '', ''])[:4])} |" for s in steps]
    lines += ["", "## Training runs (one lra-run per backend, all at once)", "",
              "| backend | protocol | state | steps | best val | test | train s | eval s | expected s |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "steps" in r:
            done = f"{r['steps']} of {r['config_steps']}"
        else:
            done = f"{r['steps_logged']} (partial)" if "steps_logged" in r else ""
        lines.append(f"| {r['attn']} | {r['protocol']} | {r['state']} | {done} | {fmt(r.get('val_acc', r.get('best_val_acc')), '.4f')} | "
                     f"{fmt(r.get('test_acc'), '.4f')} | {fmt(r.get('train_time_s'), '.0f')} | {fmt(r.get('eval_time_s'), '.0f')} | "
                     f"{fmt(r['expected_s'], '.0f')} |")
    text = "\n".join(lines) + "\n"
    write_atomic(out / "summary.md", text.encode())
    write_json_atomic(out / "summary.json", {"gpu": gpu, "steps": steps, "runs": rows})
    return text


def parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    pl = sub.add_parser("plan", help="the protocol of each backend's run within a time budget")
    pl.add_argument("--budget-s", type=float, required=True, help="seconds each run may take (all run at once)")
    pl.add_argument("--backends", default=",".join(STEP_MS), help=f"comma-separated (default {','.join(STEP_MS)})")
    pl.add_argument("--contention", type=float, default=CONTENTION, help=f"slow-down of a step, the runs sharing the GPU (default {CONTENTION})")
    pl.add_argument("--startup-s", type=float, default=STARTUP_S, help=f"seconds a run takes besides its steps (default {STARTUP_S:g})")
    pl.add_argument("--extra-set", default="", help="--set values for every run after its protocol's (recorded in plan.json)")
    pl.add_argument("--out", required=True, help="folder for plan.tsv and plan.json")
    rp = sub.add_parser("report", help="summary.md and summary.json of what the script ran")
    rp.add_argument("--out", required=True, help="the script's output folder")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    if args.command == "plan":
        backends = [b for b in args.backends.split(",") if b]
        for p in make_plan(backends, args.budget_s, out, args.contention, args.startup_s, args.extra_set):
            print(f"{p['attn']:<10} {p['protocol']:<10} " + (f"~{p['expected_s']:.0f} s" if p["values"] else p["why"]))
        return 0
    if not out.is_dir():
        raise UserError(f"--out {out} is not a folder; give the output folder of scripts/gpu_paper_listops.sh")
    print(report(out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(call(PROG, main))
