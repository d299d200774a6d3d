"""lra-table: result records -> accuracy, efficiency, recall, taxonomy and throughput tables, and plots.

    lra-table [--runs results/runs ...] [--include-smoke] [--out results/tables] [--reference DIR] [--attn-module FILE.py ...]

Reads ``<runs>/*/record.json`` (schema in ``lra/run/record.py``; by default the committed reference
records in results/runs, never a user's ./runs unless named) and prints our numbers beside the
published ones (``lra/reference/published_lra.csv`` and ``published_efficiency.csv``, package data). Writes
``<out>/{accuracy,efficiency,taxonomy,throughput}.{md,csv,tex}``, ``published.{md,csv,tex}`` (each
published row under the suite's backend of the same mechanism, with its protocol and notes:
``published.py``), two PNG plots of the LRA records, ``lra_table2.{md,csv,tex}`` and
``lra_table2-<record folder>.png`` when the throughput records hold an interleaved Text sweep (the LRA
paper's Table 2 regenerated beside its published rows: ``table2.py``), and, when MQAR records are among them, ``recall.{md,csv,tex}``, ``recall_vs_pairs.png``
(accuracy per backend and number of key-value pairs; ``recall.py``) and ``recall_by_family.png`` (every backend's
recall, grouped by the taxonomy's scaling strategy), each file atomically, and
prints the Markdown tables. A diverged run shows as "diverged", never as a number. The accuracy,
efficiency and recall tables name every record they used and every one they left out (unreadable,
unfinished, an older run of the same seed, a smoke run), each also one line on stderr.
"""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from attentions import load_attention_module

from ..cli import Parser, console
from ..errors import UserError
from .efficiency import efficiency_table, published_efficiency_table
from ..format import MISSING, Table, backend_order, fmt_number, markdown, model, write_tables
from ..files import check_folder_arg, package_data
from .published import published_table
from .recall import TASK as RECALL_TASK, recall_cells, recall_table
from .records import load_records, shown
from .summary import SOURCES, TITLES, Summary, average, grouped, published_value, seeds_text, summarize, task_list
from .taxonomy import taxonomy_table
from .table2 import published_rows, table2_tables
from .throughput import throughput_tables
from .tuning import tuning_table

REFERENCE_FILES = ("published_lra.csv", "published_efficiency.csv")
# the notes on published rows (what their code did that moves their numbers), beside them
NOTES_FILE = "published_notes.csv"


def find_reference(explicit: Optional[str]) -> Tuple[Optional[Path], List[Path]]:
    """The folder of the published CSVs, and the places searched."""
    if explicit is not None:
        folder = Path(explicit)
        if not (folder / REFERENCE_FILES[0]).is_file():
            raise UserError(
                f"--reference {explicit}: no {REFERENCE_FILES[0]} there; give the folder that holds {' and '.join(REFERENCE_FILES)}"
            )
        return folder, [folder]
    # shipped with the package (lra/reference); absent only from a broken installation
    places = [package_data("reference")]
    return next((p for p in places if (p / REFERENCE_FILES[0]).is_file()), None), places


def read_csv(path: Path) -> List[Dict[str, str]]:
    if not path.is_file():
        return []
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except (OSError, csv.Error) as err:
        raise UserError(f"cannot read {path}: {err}")


def our_accuracy_rows(records: List[Dict[str, Any]], tasks: List[str], table: Table,
                      tuned: Sequence[Any] = ()) -> List[Dict[str, Any]]:
    """Append one row per (preset, backend) and a majority-class row per preset; return the CSV rows.
    With tuned cells (lra/tables/tuning.py), the rows end with the chosen values, task by task."""
    from .tuning import setting_text, tuned_keys

    long: List[Dict[str, Any]] = []
    groups = grouped(records)
    keys = tuned_keys(tuned)
    by_key = {c.key: c for c in tuned}
    for preset in sorted({r["preset"] for r in records}):
        table.breaks.append(len(table.rows))
        protocol = f"preset {preset}"
        for attn in backend_order(model(r) for r in records if r["preset"] == preset):
            cells = {t: summarize(groups[(preset, attn, t)], "test_acc", 100.0) for t in tasks if groups.get((preset, attn, t))}
            avg = average(cells)
            present = [t for t in tasks if groups.get((preset, attn, t))]
            chosen = [setting_text([groups[(preset, attn, t)] for t in present], by_key, keys)] if keys else []
            table.rows.append([attn, "this suite", protocol, seeds_text(cells),
                               *(cells[t].text() if t in cells else MISSING for t in tasks), fmt_number(avg), *chosen])
            for t, s in cells.items():
                long.append({"source": "this suite", "protocol": protocol, "model": attn, "task": t,
                             "acc_mean": s.mean, "acc_std": s.std, "seeds": len(s.values), "diverged": s.diverged})
            long.append({"source": "this suite", "protocol": protocol, "model": attn, "task": "avg", "acc_mean": avg})
        # the majority class depends on the test split only, so any record of the task gives it
        majority = {t: Summary([100.0 * rs[0]["majority_acc"]]) for (p, _, t), rs in groups.items() if p == preset}
        table.rows.append(["majority class", "this suite", protocol, MISSING,
                           *(majority[t].text() if t in majority else MISSING for t in tasks), fmt_number(average(majority)),
                           *([MISSING] if keys else [])])
    return long


def published_accuracy_rows(published: List[Dict[str, str]], tasks: List[str], table: Table,
                            tuned: bool = False) -> List[Dict[str, Any]]:
    """Append the published rows grouped by protocol (an empty cell stays missing); return the CSV rows."""
    long: List[Dict[str, Any]] = []
    for protocol in dict.fromkeys(row["protocol"] for row in published):
        table.breaks.append(len(table.rows))
        for row in (r for r in published if r["protocol"] == protocol):
            values = {t: published_value(row, t) for t in [*tasks, "avg"]}
            table.rows.append([row["model"], SOURCES.get(row["source"], row["source"]), protocol, MISSING,
                               *(fmt_number(values[t]) for t in [*tasks, "avg"]), *([MISSING] if tuned else [])])
            long += [{"source": row["source"], "protocol": protocol, "model": row["model"], "task": t, "acc_mean": value}
                     for t, value in values.items()]
    return long


def accuracy_table(records: List[Dict[str, Any]], published: List[Dict[str, str]], reference: str,
                   tuned: Sequence[Any] = ()) -> Table:
    """Our rows, then the published ones; with tuned cells, a last column of each row's chosen values
    (lra/tables/tuning.py), task by task in the order of the tasks it has."""
    from .tuning import tuned_keys

    tasks = task_list(records)
    keys = tuned_keys(tuned)
    chosen = [f"{', '.join(keys)} chosen"] if keys else []
    table = Table("Test accuracy (%)", ["Model", "Source", "Protocol", "Seeds", *(TITLES.get(t, t) for t in tasks), "Avg",
                                        *chosen])
    table.records = our_accuracy_rows(records, tasks, table, tuned) + published_accuracy_rows(published, tasks, table,
                                                                                              bool(keys))
    table.notes = [
        "Test accuracy of the best-validation checkpoint; mean ± sample std over seeds where several. "
        "Avg: mean of the five tasks without Path-X, given only when all five are present.",
        f"{MISSING} = not run or not reported (the MiTA paper's per-task numbers are not public). Published rows: {reference}.",
    ]
    if keys:
        table.notes.append(f"{', '.join(keys)} chosen: the value each backend's tasks ran at, task by task (/); a tuned "
                           "cell at the grid point with the best validation accuracy at the tuning seed (ties: the smaller "
                           "value; every point in tuning.md), the others marked (not tuned).")
    table.notes += differences_from_full(records)
    return table


def differences_from_full(records: List[Dict[str, Any]]) -> List[str]:
    """The significance footnote: for each (preset, task) where full and another backend both have at
    least two completed seeds, the backends whose mean differs from full's by more than twice the
    standard error of that difference. The error adds the seed spreads and the test split's sampling
    error of two accuracies (seeds share one test split, so their spread alone can be zero while the
    split still decides a point or two); no line when nothing can be compared."""
    groups = grouped(records)
    marked, compared = [], 0
    for preset, task in sorted({(p, t) for p, _, t in groups}):
        full_records = groups.get((preset, "full", task), [])
        full = summarize(full_records, "test_acc", 100.0)
        for attn in backend_order(a for p, a, t in groups if (p, t) == (preset, task) and a != "full"):
            ours = summarize(groups[(preset, attn, task)], "test_acc", 100.0)
            if len(ours.values) < 2 or len(full.values) < 2:
                continue
            compared += 1
            n = min(r["test_examples"] for r in groups[(preset, attn, task)] + full_records)
            p = (ours.mean + full.mean) / 200.0  # type: ignore[operator]
            split = 2 * p * (1 - p) / n * 100.0**2
            se = math.sqrt(ours.std**2 / len(ours.values) + full.std**2 / len(full.values) + split)  # type: ignore[operator]
            diff = ours.mean - full.mean  # type: ignore[operator]
            if abs(diff) > 2 * se:
                marked.append(f"{attn} on {TITLES.get(task, task)} ({preset}) {diff:+.1f} points (2 SE {2 * se:.1f})")
    if not compared:
        return []
    return [f"Differences from full larger than twice their standard error (|mean - mean_full| > "
            f"2 √(s²/n + s_full²/n_full + 2 p(1-p)/N_test), p the two means' average, N_test the test examples; "
            f"{compared} backend-task pairs compared): {'; '.join(marked) or 'none'}. A screen, not a test at 5%: "
            "with 3 seeds the spread is itself uncertain, and the test-split term treats the two accuracies as "
            "independent, which the shared split makes conservative."]


def parser() -> Parser:
    p = Parser(prog="lra-table", description="Build comparison tables and plots from result records, beside the published "
               "numbers: accuracy, efficiency, taxonomy and throughput tables, and, when MQAR runs are among the records, "
               "recall.{md,csv,tex} (test accuracy per backend and number of key-value pairs, with each backend's keys "
               "per query), recall_vs_pairs.png and recall_by_family.png.")
    p.add_argument("--runs", action="append", metavar="FOLDER",
                   help="folder of run folders holding record.json (default results/runs, the committed reference "
                   "records; lra-run writes to ./runs); may repeat to put several folders in one table")
    p.add_argument("--include-smoke", action="store_true",
                   help="keep smoke-preset runs in the tables and plots (left out by default: their few steps show "
                   "that the pipeline runs, not what a backend learns)")
    p.add_argument("--out", default="results/tables", help="where to write the tables and plots (default results/tables)")
    p.add_argument("--reference", help="folder of published_lra.csv and published_efficiency.csv (default: the published numbers shipped with the package, lra/reference/)")
    p.add_argument("--throughput", help="folder of lra-bench sweep records (default: throughput/ beside the first --runs)")
    p.add_argument("--attn-module", action="append", default=[], metavar="FILE.py",
                   help="a Python file registering more backends (for the taxonomy table; may repeat)")
    p.add_argument("--no-plots", action="store_true", help="write the tables only")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    for path in args.attn_module:
        load_attention_module(path)
    folders, out = [Path(f) for f in args.runs or ["results/runs"]], Path(args.out)
    # every argument is checked before any record is read: a bad one is the only line printed
    check_folder_arg(out, "--out")
    reference, places = find_reference(args.reference)
    if args.throughput is not None and Path(args.throughput).exists() and not Path(args.throughput).is_dir():
        raise UserError(f"--throughput {args.throughput} is a file, not a folder; give the folder of lra-bench sweep records")
    records, selection = load_records(folders, args.include_smoke)
    if reference is None:
        looked = ", ".join(map(str, places))
        print(f"lra-table: no published numbers found (looked in {looked}); tables without them", file=sys.stderr)
    for path, why in selection.left_out:
        print(f"lra-table: skipped {path}: {why}", file=sys.stderr)
    if not records:
        absent = [str(f) for f in folders if not f.is_dir()]
        print(f"no run records in {', '.join(map(str, folders))}"
              + (f" ({', '.join(absent)}: no such folder)" if absent else "")
              + (f" to tabulate ({len(selection.left_out)} left out, listed on stderr)" if selection.left_out else ""))
    acc_file, eff_file = ((reference / name) if reference is not None else None for name in REFERENCE_FILES)
    published_acc = read_csv(acc_file) if acc_file is not None else []
    published_eff = read_csv(eff_file) if eff_file is not None else []

    # MQAR's levels (pairs, N, vocabulary) are columns of the recall table, not one task of the LRA tables
    lra = [r for r in records if r["task"] != RECALL_TASK]
    recall = recall_cells(records)
    outputs: Dict[str, List[Table]] = {}
    if lra:
        outputs["accuracy"] = [accuracy_table(lra, published_acc, shown(acc_file) if published_acc else "none found",
                                              [c for c in selection.tuned if c.key[2] != RECALL_TASK])]
        outputs["efficiency"] = [efficiency_table(lra)]
        for stem in ("accuracy", "efficiency"):
            outputs[stem][0].notes += selection.of_tasks(lambda task: task != RECALL_TASK).notes()
        if published_eff:
            outputs["efficiency"].append(published_efficiency_table(published_eff, shown(eff_file)))
    notes = read_csv(reference / NOTES_FILE) if reference is not None else []
    if published_acc:
        outputs["published"] = [published_table(lra, published_acc, notes, shown(acc_file))]
    if recall:
        outputs["recall"] = [recall_table(recall, selection.tuned)]
        outputs["recall"][0].notes += selection.of_tasks(lambda task: task == RECALL_TASK).notes()
    if selection.tuned:
        outputs["tuning"] = [tuning_table(selection.tuned)]
    outputs["taxonomy"] = [taxonomy_table()]
    bench_folder = Path(args.throughput) if args.throughput else folders[0].parent / "throughput"
    throughput, not_records = throughput_tables(bench_folder, published_eff)
    for why in not_records:
        print(f"lra-table: skipped {why}", file=sys.stderr)
    if throughput:
        outputs["throughput"] = throughput
    # the LRA paper's Table 2 regenerated, from the interleaved Text records among them
    table2 = table2_tables(bench_folder, published_eff, notes)
    if table2:
        outputs["lra_table2"] = [table for _, _, table in table2]

    written: List[Path] = []
    try:
        for stem, tables in outputs.items():
            written += write_tables(out, stem, tables)
        if not args.no_plots and lra:
            from .plots import plot_all

            written += plot_all(lra, out, backend_order(model(r) for r in lra), published_acc)
        if not args.no_plots and table2:
            from .table2_plot import table2_plot

            for path, record, _ in table2:
                written.append(table2_plot(record, published_rows(published_eff), out / f"lra_table2-{path.parent.name}.png"))
        if not args.no_plots and recall:
            from .plots import recall_by_family, recall_vs_pairs

            written.append(recall_vs_pairs(recall, out / "recall_vs_pairs.png"))
            written.append(recall_by_family(recall, out / "recall_by_family.png"))
    except OSError as err:
        raise UserError(f"cannot write to {out}: {err.strerror or err}; choose another folder with --out")
    # printed once every file is written: a reader that stops early (| head) cuts no file short
    for tables in outputs.values():
        for table in tables:
            print(markdown(table))
    print(f"wrote {len(written)} files to {out}: {', '.join(sorted(p.name for p in written))}")
    return 0


def entry() -> None:
    console("lra-table", main)


if __name__ == "__main__":
    entry()
