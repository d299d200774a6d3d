"""The estimate lra-run prints before a long run (lra/run/estimate.py) against the time the same run
takes here. For each case the estimate is made as lra-run makes it (the run's model on made-up rows of
the task's shape, before any data), then the run trains, in this process, and its record's times give
the real cost; the two are compared on what both count: the training steps and the validations (the
final test is in neither of the record's times).

    python scripts/estimate_check.py                        # every case: about 11 minutes on 2 cores
    python scripts/estimate_check.py --cases smoke          # the cases whose name holds "smoke" (seconds)
    python scripts/estimate_check.py --out results/estimate/intel-xeon-2c   # record.json and table.md there

The cases: ListOps and MQAR at the smoke, cpu and paper presets, with full attention and MiTA. A
smoke case trains its whole run. A cpu or paper case trains only the run's first steps (``steps`` of
its case; a cpu run takes minutes, a paper run hours) with one validation, at the last of them, and
the whole run is extrapolated from them as the estimate extrapolates from its own timed steps:

    real = first step + (steps - 1) x later step + evaluations x validation rows x validated row

with the protocol's steps, evaluations and validation rows; the first step (which pays what a run
pays once), the mean of the later ones and the validated row (``eval_time_s`` over the rows) as the
loop timed them in the trained part. Every step of a run has the same shapes and every row is padded
to the task's length, so the first steps cost what every later one does. The comparison is made on
the whole run, and shown for each part: the step and the validated row. The trained part's test is one
batch (neither side counts the test), MQAR's paper validation 2 of its 12 batches, and ListOps' paper
case generates a set of 4,608 rows instead of 100,000 (minutes): neither changes a step's or a row's
cost.

``--tolerance`` (default 0.3): the largest |estimate / real - 1| a case may show, or, for a run of a few
seconds, an error of ``FLOOR_S`` (1 s): MQAR's smoke run takes 0.1 s, and a stall of the machine or the
run's first calls (one-time costs the estimate leaves out by design) of a few tenths of a second,
on either side, is most of it. The exit status is 1 when a case shows more, or when the estimate's line (said at ``NOTICE_S`` or more) is wrong by more
than the tolerance about the run's real length (test included). The record holds the machine, the
load average before and after each case, the commit and the verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

# the installed (or PYTHONPATH's) lra first; this checkout otherwise
if importlib.util.find_spec("lra") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from lra.config import resolve  # noqa: E402
from lra.files import write_atomic, write_json_atomic  # noqa: E402
from lra.format import fmt_duration  # noqa: E402
from lra.machine import describe, git_commit, hardware, load_average  # noqa: E402
from lra.run import loop  # noqa: E402
from lra.run.estimate import NOTICE_S, ROUGH_MARGIN, Estimate, estimate  # noqa: E402
from lra.run.loop import evaluation_due  # noqa: E402
from lra.run.setup import prepare  # noqa: E402
from lra.run.train import train  # noqa: E402

# torch's thread count in a fresh process
DEFAULT_THREADS = torch.get_num_threads()
# the error allowed a run of a few seconds, whatever its share (the module docstring)
FLOOR_S = 1.0
MITA_MQAR_SMOKE = ["attn.landmarks=8", "attn.topk=8"]
# ListOps' paper case: a set generated in seconds whose size changes no step's cost (val and test 96
# rows each: three whole batches)
LISTOPS_PAPER_DATA = ["data.size=4608"]
# MQAR's paper case: a validation of 2 of the split's 12 batches (a row costs as much in either)
MQAR_PAPER_VALIDATION = ["train.eval_batches=2"]
# every part-trained case: a test of one batch (neither side counts the test; the run ends with one)
PART_TEST = ["train.test_batches=1"]
# (name, task, preset, attn, --set values of the run, --set values of the trained part only, steps trained:
# None = the whole run)
Case = Tuple[str, str, str, str, List[str], List[str], Optional[int]]
CASES: List[Case] = [
    ("listops-smoke-full", "listops", "smoke", "full", [], [], None),
    ("listops-smoke-mita", "listops", "smoke", "mita", [], [], None),
    ("mqar-smoke-full", "mqar", "smoke", "full", [], [], None),
    ("mqar-smoke-mita", "mqar", "smoke", "mita", MITA_MQAR_SMOKE, [], None),
    ("mqar-cpu-full", "mqar", "cpu", "full", [], [], 100),
    ("mqar-cpu-mita", "mqar", "cpu", "mita", [], [], 100),
    ("listops-cpu-full", "listops", "cpu", "full", [], [], 100),
    ("listops-cpu-mita", "listops", "cpu", "mita", [], [], 100),
    ("mqar-paper-full", "mqar", "paper", "full", [], MQAR_PAPER_VALIDATION, 4),
    ("mqar-paper-mita", "mqar", "paper", "mita", [], MQAR_PAPER_VALIDATION, 4),
    ("listops-paper-full", "listops", "paper", "full", [], LISTOPS_PAPER_DATA, 10),
    ("listops-paper-mita", "listops", "paper", "mita", [], LISTOPS_PAPER_DATA, 10),
]


def as_lra_run(prepared: Any, sizes: Dict[str, int]) -> Tuple[Estimate, bool]:
    """The estimate timed in full, and whether lra-run prints its line: lra-run stops at a rough
    estimate for a run far under NOTICE_S, which is then timed in full for the comparison."""
    est = estimate(prepared, sizes, 0)
    said = est.total_s >= NOTICE_S
    if est.total_s * ROUGH_MARGIN < NOTICE_S:
        est = estimate(prepared, sizes, 0, precise=True)
    return est, said


@contextlib.contextmanager
def step_times() -> Iterator[List[float]]:
    """The seconds of each training step of the runs trained inside, as the loop counts them
    (``state.train_time``): the loop's own ``train_step``, wrapped to read its clock."""
    steps: List[float] = []
    original = loop.train_step

    def recorded(run: Any, state: Any) -> float:
        before = state.train_time
        loss = original(run, state)
        steps.append(state.train_time - before)
        return loss

    loop.train_step = recorded
    try:
        yield steps
    finally:
        loop.train_step = original


def validated_rows(cfg: Any, sizes: Dict[str, int]) -> int:
    """Rows of one validation of a run of ``cfg``."""
    tc = cfg.train
    return sizes["val"] if not tc.eval_batches else min(sizes["val"], tc.eval_batches * tc.batch_size)


def check(name: str, task: str, preset: str, attn: str, sets: List[str], data_dir: str, out: Path,
          trained: Optional[int] = None, trained_sets: Optional[List[str]] = None,
          tolerance: float = 0.3) -> Dict[str, Any]:
    """One case: the estimate of the run of ``sets``, then the run itself (``trained`` = None) or its
    first ``trained`` steps with ``trained_sets`` added, extrapolated to the whole run."""
    began, load = time.perf_counter(), load_average()
    # a run of train.threads=0 keeps the process's thread count: torch's own, as in a fresh lra-run
    torch.set_num_threads(DEFAULT_THREADS)
    cfg = resolve(task, attn, preset, sets)
    cfg.data.data_dir = data_dir
    prepared = prepare(cfg)
    sizes = prepared.task.split_sizes(cfg.data)
    if sizes is None:
        raise SystemExit(f"{task}: its split sizes are known only from its data; not a case of this check")
    timing = time.perf_counter()
    est, said = as_lra_run(prepared, sizes)
    took = time.perf_counter() - timing
    part_sets = [*(trained_sets or []), *PART_TEST, f"train.steps={trained}"] if trained else []
    part = resolve(task, attn, preset, [*sets, *part_sets])
    part.out, part.data.data_dir = str(out / name), data_dir
    rows = validated_rows(part, prepared.task.split_sizes(part.data))
    del prepared
    with step_times() as times:
        record = train(part, quiet=True, estimate=False)

    steps = record["steps"]
    rows *= sum(1 for s in range(1, steps + 1) if evaluation_due(s, part.train))
    # a step after the first (the first pays what the run pays once), and a validated row
    step_real = statistics.fmean(times[1:] or times)
    row_real = record["eval_time_s"] / max(rows, 1)
    # the whole run: as measured when it ran whole, else the first step, the rest of its steps at the
    # measured step, and its validations' rows at the measured row
    if trained is None:
        real = record["train_time_s"] + record["eval_time_s"]
    else:
        real = times[0] + (est.steps - 1) * step_real + est.evaluations * est.val_rows * row_real
    real_total = real + est.test_rows * row_real
    predicted = est.train_s + est.eval_s
    # the line is right when said of a run at NOTICE_S or more (not said under it), or when the run is
    # within the tolerance of NOTICE_S, where an estimate within the tolerance may fall either side
    line_right = said == (real_total >= NOTICE_S) or abs(real_total / NOTICE_S - 1) <= tolerance
    ratio = predicted / real
    return {
        "case": name, "task": task, "preset": preset, "attn": attn, "set": sets, "trained_set": part_sets,
        "steps": est.steps, "steps_trained": steps, "evaluations": est.evaluations, "val_rows": est.val_rows,
        "estimate_s": round(predicted, 2), "estimate_train_s": round(est.train_s, 2), "estimate_eval_s": round(est.eval_s, 2),
        "estimate_step_s": round(est.step_s, 4), "estimate_row_s": round(est.row_s, 6), "estimate_took_s": round(took, 2),
        "real_s": round(real, 2), "real_first_step_s": round(times[0], 4), "real_step_s": round(step_real, 4), "real_row_s": round(row_real, 6),
        "real_train_s": record["train_time_s"], "real_eval_s": record["eval_time_s"], "rows_validated": rows,
        "ratio": round(ratio, 3), "step_ratio": round(est.step_s / step_real, 3),
        "row_ratio": round(est.row_s / row_real, 3) if rows and row_real > 0 else None,
        # the line lra-run prints (the whole run, test included) beside the run's real length
        "estimate_total_s": round(est.total_s, 2), "real_total_s": round(real_total, 2), "said": said,
        "line_right": line_right, "passed": abs(predicted - real) <= max(tolerance * real, FLOOR_S) and line_right,
        "load_average_before": load, "load_average_after": load_average(), "took_s": round(time.perf_counter() - began, 1),
    }


def table(rows: List[Dict[str, Any]], tolerance: float, head: List[str]) -> str:
    lines = [*head, "",
             "| case | steps (trained) | estimate | real | estimate / real | step: estimate / real (s) | "
             "validated row: estimate / real (ms) | line said (real length) | load before / after | verdict |",
             "|---|---:|---:|---:|---:|---|---|---|---|---|"]
    for r in rows:
        row = "-" if r["row_ratio"] is None else f"{1e3 * r['estimate_row_s']:.2f} / {1e3 * r['real_row_s']:.2f}"
        line = f"{'yes' if r['said'] else 'no'} ({fmt_duration(r['real_total_s'])}{'' if r['line_right'] else ', wrong'})"
        lines.append(f"| {r['case']} | {r['steps']:,} ({r['steps_trained']:,}) | {fmt_duration(r['estimate_s'])} "
                     f"| {fmt_duration(r['real_s'])} | {r['ratio']:.2f} | {r['estimate_step_s']:.3f} / {r['real_step_s']:.3f} "
                     f"| {row} | {line} | {r['load_average_before'][0]} / {r['load_average_after'][0]} "
                     f"| {'pass' if r['passed'] else 'FAIL'} |")
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
    machine, commit, load, began = describe(hardware(torch.device("cpu"))), git_commit(), load_average(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="estimate-check-") as tmp:
        for name, task, preset, attn, sets, trained_sets, trained in cases:
            r = check(name, task, preset, attn, sets + args.sets, args.data_dir, Path(tmp), trained, trained_sets, args.tolerance)
            rows.append(r)
            print(f"{r['case']}: estimate {r['estimate_s']:.1f} s, real {r['real_s']:.1f} s, ratio {r['ratio']:.2f}, "
                  f"{'pass' if r['passed'] else 'FAIL'} (load {r['load_average_before'][0]} -> "
                  f"{r['load_average_after'][0]}; {r['took_s']:.0f} s)", file=sys.stderr, flush=True)
    passed = all(r["passed"] for r in rows)
    took = time.perf_counter() - began
    head = [f"Estimate against the run, {len(rows)} cases: {'pass' if passed else 'FAIL'} (|estimate / real - 1| <= "
            f"{args.tolerance:g}, or within {FLOOR_S:g} s for a run of a few seconds, and the line said of runs of {fmt_duration(NOTICE_S)} or more). {machine}; "
            f"torch {torch.__version__}; checkout {commit}; load average {load} at the start, "
            f"{load_average()} at the end; {fmt_duration(took)} in all."
            + (f" Every case with --set {' '.join(args.sets)}." if args.sets else "")]
    text = table(rows, args.tolerance, head)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        write_json_atomic(out / "record.json", {
            "kind": "estimate_check", "machine": machine, "hardware": hardware(torch.device("cpu")),
            "torch": torch.__version__, "git_commit": commit, "tolerance": args.tolerance, "set": args.sets,
            "load_average": {"start": load, "end": load_average()}, "took_s": round(took, 1), "passed": passed,
            "cases": rows})
        write_atomic(out / "table.md", text.encode())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
