"""The estimate lra-run prints before a long run (lra/run/estimate.py) against the time the same run
really takes here: for each case, the estimate is made as lra-run makes it (its model on made-up rows
of the task's shape, before the data), then the run trains to its record, in this process, on this
machine, and the record's train_time_s + eval_time_s (the steps and the validations) is compared with
the estimate's same parts. The final test is not in the record's times, so neither side counts it.

    python scripts/estimate_check.py                       # every case (about 25 minutes on 2 idle cores)
    python scripts/estimate_check.py --cases smoke         # the cases whose name holds "smoke" (a minute)
    python scripts/estimate_check.py --out results/estimate/intel-xeon-2c   # record.json and table.md there

The cases: ListOps and MQAR at the smoke, cpu and paper presets, with full attention and MiTA. A
paper run takes hours on a CPU, so its case trains its first ``PAPER_STEPS`` steps (``train.steps``
set so, the rest of the protocol as it is): the estimate is per step and per evaluated row, so the
first steps of a paper run check it as the whole run would, with the last of them evaluated on the
whole validation split as the paper preset does. ``--tolerance`` (default 0.3): the largest
|estimate / real - 1| a case may show; the exit status is 1 when a case shows more. Data: ListOps is
generated into ``--data-dir`` once (the paper preset's 100,000 rows take minutes, not counted).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

# the installed (or PYTHONPATH's) lra first; this checkout otherwise
if importlib.util.find_spec("lra") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lra.config import resolve  # noqa: E402
from lra.files import write_atomic, write_json_atomic  # noqa: E402
from lra.machine import cpu_model, git_commit, load_average  # noqa: E402
from lra.run.estimate import NOTICE_S, estimate  # noqa: E402
from lra.run.setup import prepare  # noqa: E402
from lra.run.train import train  # noqa: E402

# steps of a paper-preset case: a minute or two of a CPU, the run's first steps
PAPER_STEPS = 20
MITA_MQAR_SMOKE = ["attn.landmarks=8", "attn.topk=8"]
# (name, task, preset, attn, --set values)
CASES: List[Tuple[str, str, str, str, List[str]]] = [
    ("listops-smoke-full", "listops", "smoke", "full", []),
    ("listops-smoke-mita", "listops", "smoke", "mita", []),
    ("mqar-smoke-full", "mqar", "smoke", "full", []),
    ("mqar-smoke-mita", "mqar", "smoke", "mita", MITA_MQAR_SMOKE),
    ("mqar-cpu-full", "mqar", "cpu", "full", []),
    ("mqar-cpu-mita", "mqar", "cpu", "mita", []),
    ("listops-cpu-full", "listops", "cpu", "full", []),
    ("listops-cpu-mita", "listops", "cpu", "mita", []),
    ("mqar-paper-full", "mqar", "paper", "full", [f"train.steps={PAPER_STEPS}"]),
    ("mqar-paper-mita", "mqar", "paper", "mita", [f"train.steps={PAPER_STEPS}"]),
    ("listops-paper-full", "listops", "paper", "full", [f"train.steps={PAPER_STEPS}"]),
    ("listops-paper-mita", "listops", "paper", "mita", [f"train.steps={PAPER_STEPS}"]),
]


def check(name: str, task: str, preset: str, attn: str, sets: List[str], data_dir: str, out: Path) -> Dict[str, Any]:
    """One case: the estimate, then the run; both as seconds of training steps and of validations."""
    cfg = resolve(task, attn, preset, sets)
    cfg.out, cfg.data.data_dir = str(out / name), data_dir
    load = load_average()
    prepared = prepare(cfg)
    sizes = prepared.task.split_sizes(cfg.data)
    if sizes is None:
        raise SystemExit(f"{task}: its split sizes are known only from its data; not a case of this check")
    began = time.perf_counter()
    est = estimate(prepared, sizes, 0, precise=True)
    took = time.perf_counter() - began
    del prepared
    record = train(cfg, quiet=True, estimate=False)
    real = record["train_time_s"] + record["eval_time_s"]
    predicted = est.train_s + est.eval_s
    return {
        "case": name, "task": task, "preset": preset, "attn": attn, "set": sets, "steps": record["steps"],
        "estimate_s": round(predicted, 2), "estimate_train_s": round(est.train_s, 2),
        "estimate_eval_s": round(est.eval_s, 2), "estimate_step_s": round(est.step_s, 4),
        "estimate_took_s": round(took, 2), "real_s": round(real, 2), "real_train_s": record["train_time_s"],
        "real_eval_s": record["eval_time_s"], "ratio": round(predicted / real, 3),
        # the whole run, the test included, beside the line's threshold: said only when long
        "estimate_total_s": round(est.total_s, 2), "said": est.total_s >= NOTICE_S,
        "load_average_before": load, "load_average_after": load_average(),
    }


def table(rows: List[Dict[str, Any]], tolerance: float) -> str:
    lines = ["| case | steps | estimate (s) | real (s) | estimate / real | step: estimate (s) | line said |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        flag = "" if abs(r["ratio"] - 1) <= tolerance else " (off)"
        real_step = r["real_train_s"] / max(r["steps"], 1)
        lines.append(f"| {r['case']} | {r['steps']:,} | {r['estimate_s']:.1f} | {r['real_s']:.1f} | {r['ratio']:.2f}{flag} "
                     f"| {r['estimate_step_s']:.3f} (real {real_step:.3f}) | {'yes' if r['said'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="", help="only the cases whose name holds one of these comma-separated words")
    p.add_argument("--data-dir", default="data", help="where ListOps is found or generated (default ./data)")
    p.add_argument("--tolerance", type=float, default=0.3, help="the largest |estimate / real - 1| (default 0.3)")
    p.add_argument("--out", help="a folder for record.json and table.md (default: print only)")
    p.add_argument("--set", dest="sets", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config values added to every case, e.g. train.threads=1 (on a machine other jobs share)")
    args = p.parse_args()
    words = [w for w in args.cases.split(",") if w]
    cases = [c for c in CASES if not words or any(w in c[0] for w in words)]
    if not cases:
        p.error(f"--cases {args.cases!r} matches none of: {', '.join(c[0] for c in CASES)}")
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="estimate-check-") as tmp:
        for case in cases:
            name, task, preset, attn, sets = case
            rows.append(check(name, task, preset, attn, sets + args.sets, data_dir=args.data_dir, out=Path(tmp)))
            r = rows[-1]
            print(f"{r['case']}: estimate {r['estimate_s']:.1f} s, real {r['real_s']:.1f} s, ratio {r['ratio']:.2f} "
                  f"(load {r['load_average_before'][0]} -> {r['load_average_after'][0]})", file=sys.stderr, flush=True)
    text = table(rows, args.tolerance)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        write_json_atomic(out / "record.json", {"cpu_model": cpu_model(), "git_commit": git_commit(),
                                                "tolerance": args.tolerance, "cases": rows})
        write_atomic(out / "table.md", text.encode())
    return 0 if all(abs(r["ratio"] - 1) <= args.tolerance for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
