"""Where the tuned MQAR matrix's failing cells lose recall: `lra-analyze recall` on each cell's seed-0 run
at its chosen learning rate, the tables written to results/mqar/probes/<backend>-p<pairs>/.

A cell is a backend (and its form) at one number of pairs; its run is the one lra-table reports for
seed 0 (the tuning's choice, lra/tables/tuning.py). The matrix commits only MiTA's weights, so a run
whose folder lacks best_model.pt is trained again first, with the record's own config (lra-run, one
torch thread, into --runs): one-thread runs repeat to the last digit, which the script checks
against the record's final training loss before it probes the weights.

    python scripts/mqar_probes.py local:8 local:16 sinkhorn:8 "reformer (chunked)":32
    python scripts/mqar_probes.py --failing          # every cell the failure rule names (docs/results.md)

About 2-4 minutes a cell that needs training (one core), 20 seconds for the probe itself.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from lra.config import RunConfig  # noqa: E402
from lra.format import model  # noqa: E402
from lra.run.folder import identity, with_defaults  # noqa: E402
from lra.tables.records import levels, load_records  # noqa: E402


def cells(records: List[Dict]) -> Dict[Tuple[str, int], List[Dict]]:
    """The reported MQAR records by (row, pairs)."""
    out: Dict[Tuple[str, int], List[Dict]] = {}
    for record in records:
        if record["task"] == "mqar" and record["preset"] == "cpu":
            out.setdefault((model(record), levels(record)["pairs"]), []).append(record)
    return out


def failing(found: Dict[Tuple[str, int], List[Dict]]) -> List[Tuple[str, int]]:
    """The cells whose mean test accuracy is within twice the guess level (200/P %), or whose seeds split
    by more than 25 points."""
    out = []
    for (row, pairs), records in sorted(found.items()):
        accs = [100 * r["test_acc"] for r in records if r["test_acc"] is not None]
        if not accs:
            continue
        if sum(accs) / len(accs) <= 200 / pairs or max(accs) - min(accs) > 25:
            out.append((row, pairs))
    return out


def train_again(record: Dict, runs: Path) -> Path:
    """A run of the record's config in ``runs`` that repeats the record: one found there, or lra-run's."""
    cfg = record["config"]
    for folder in sorted(runs.iterdir()) if runs.is_dir() else []:
        if (folder / "best_model.pt").exists() and (folder / "record.json").exists() \
                and same(json.loads((folder / "config.json").read_text()), cfg) \
                and json.loads((folder / "record.json").read_text())["final_train_loss"] == record["final_train_loss"]:
            return folder  # trained again before, and it repeated the record
    sets = [f"data.pairs={cfg['data']['pairs']}", f"train.lr={cfg['train']['lr']!r}", "train.threads=1"]
    sets += [f"attn.{k}={v}" for k, v in (cfg.get("attn_options") or {}).items() if k == "form"]
    argv = ["--task", "mqar", "--attn", record["attn"], "--preset", "cpu", "--seed", str(record["seed"]),
            "--out", str(runs), "--quiet", "--no-estimate", "--set", *sets]
    subprocess.run([sys.executable, "-m", "lra.cli.run", *argv], check=True, cwd=ROOT)
    found = [p for p in runs.iterdir() if (p / "record.json").exists() and same(json.loads((p / "config.json").read_text()), cfg)]
    again = json.loads((found[-1] / "record.json").read_text())
    if again["final_train_loss"] != record["final_train_loss"]:
        raise SystemExit(f"{found[-1]}: trained again, its final loss {again['final_train_loss']} is not the "
                         f"record's {record['final_train_loss']}: the code differs from the record's commit")
    return found[-1]


def same(a: Dict, b: Dict) -> bool:
    """Two saved configs of one run (lra.run.folder's identity; a key one lacks reads as its default)."""
    defaults = RunConfig().to_dict()
    return identity(with_defaults(defaults, a)) == identity(with_defaults(defaults, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="*", metavar="BACKEND:PAIRS", help="cells to probe, e.g. local:16")
    p.add_argument("--failing", action="store_true", help="every cell within twice the guess level or split by seed")
    p.add_argument("--results", default="results/mqar", help="the matrix's records (default results/mqar)")
    p.add_argument("--runs", default="runs/probes", help="where runs without weights are trained again")
    p.add_argument("--out", default="results/mqar/probes", help="where the probes' tables go")
    args = p.parse_args()
    records, _ = load_records([ROOT / args.results])
    found = cells(records)
    wanted = failing(found) if args.failing else []
    for item in args.cells:
        row, _, pairs = item.rpartition(":")
        wanted.append((row, int(pairs)))
    for row, pairs in wanted:
        seed0 = [r for r in found.get((row, pairs), []) if r["seed"] == 0]
        if not seed0:
            raise SystemExit(f"no seed-0 record of {row} at {pairs} pairs in {args.results}")
        record = seed0[0]
        folder = ROOT / args.results / record["run_name"]
        if not (folder / "best_model.pt").exists():
            folder = train_again(record, ROOT / args.runs)
        name = row.replace(" (", "-").replace(")", "")
        subprocess.run([sys.executable, "-m", "lra.analyze.cli", "recall", str(folder), "--out",
                        str(ROOT / args.out / f"{name}-p{pairs}"), "--quiet"], check=True, cwd=ROOT)
        print(f"probed {row} at {pairs} pairs (train.lr {record['config']['train']['lr']}): {folder}")


if __name__ == "__main__":
    main()
