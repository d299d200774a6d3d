"""The figures README.md and docs/*.md quote equal the committed records they cite: a re-run that
changes a record fails here, not for a reader. Checked: every sample lra-run line (against
results/runs/<run>/record.json, printed as lra-run prints it), the README's ListOps table (the rate
results/tables/tuning.md chose, accuracy per seed and mean ± std there and at the preset's rate, over
results/runs), its seed list, the `cpu` preset's training time,
the README's MQAR figure and figures and docs/results.md's MQAR tables (against
results/tables/recall.md, built from results/mqar)."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import ROOT
from lra.cli.run import last_line

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS = ROOT / "results" / "runs"
SAMPLE = re.compile(r"^\S+/\S+: test acc .*; record: runs/(?P<run>[^/\s]+)/record\.json$", re.M)
BACKENDS = ("full", "linear", "linformer", "moba", "topk", "agent", "mita")


def record(run: str) -> Dict:
    return json.loads((RUNS / run / "record.json").read_text())


def cpu_records(backend: str) -> List[Dict]:
    return [record(f"listops_{backend}_cpu_seed{seed}") for seed in range(3)]


SAMPLES = [(page.relative_to(ROOT), m.group(0), m.group("run")) for page in PAGES for m in SAMPLE.finditer(page.read_text())]


def test_the_pages_quote_sample_lines() -> None:
    assert {str(page) for page, _, _ in SAMPLES} >= {"README.md", "docs/running.md"}


@pytest.mark.parametrize("page, line, run", SAMPLES, ids=[f"{p}:{r}" for p, _, r in SAMPLES])
def test_a_sample_line_is_its_committed_record_as_lra_run_prints_it(page: Path, line: str, run: str) -> None:
    assert (RUNS / run / "record.json").is_file(), f"{page} quotes {run}, which has no committed record in results/runs"
    assert line == last_line(record(run), f"runs/{run}/record.json"), page


TUNED = ("full", "mita", "informer", "reformer", "performer", "skyformer", "nystromformer")


def listops_choices() -> Dict[str, str]:
    """results/tables/tuning.md's chosen learning rate of each tuned ListOps cell (the bucket form's
    row for reformer), as the table prints it ('1e-3')."""
    chosen = {}
    for line in (ROOT / "results" / "tables" / "tuning.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 8 and cells[1] == "ListOps" and cells[-3].startswith("train.lr "):
            chosen[cells[0]] = cells[-3].split()[-1]
    return chosen


def at_rate(backend: str, lr: float) -> List[Dict]:
    """The committed ListOps cpu runs of ``backend`` (its default form) at ``lr``, by seed."""
    found = {}
    for path in sorted(RUNS.glob(f"listops_{backend}_cpu_seed*/record.json")):
        r = json.loads(path.read_text())
        if r["attn"] == backend and abs(r["config"]["train"]["lr"] - lr) < 1e-12 and \
                r["config"]["attn_options"].get("form", "bucket") == "bucket" and "tuning" in r["config"]:
            found[r["seed"]] = r
    return [found[seed] for seed in sorted(found)]


def mean_std(accs: List[float]) -> str:
    return f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}"


def test_the_readme_listops_table_is_the_committed_records() -> None:
    """Each tuned row: the rate tuning.md chose, the three seeds at it, and the preset's 3e-3 runs."""
    text = (ROOT / "README.md").read_text()
    chosen = listops_choices()
    assert set(TUNED) <= set(chosen), f"results/tables/tuning.md lacks a ListOps row of {set(TUNED) - set(chosen)}"
    for backend in TUNED:
        records = at_rate(backend, float(chosen[backend]))
        assert [r["seed"] for r in records] == [0, 1, 2], f"{backend}: no three seeds at {chosen[backend]}"
        accs = [100 * r["test_acc"] for r in records]
        preset = [100 * r["test_acc"] for r in cpu_records(backend)]
        row = (f"| {backend} | {chosen[backend]} | {mean_std(accs)} | {' / '.join(f'{a:.2f}' for a in accs)} | "
               f"{mean_std(preset)} |")
        assert row in text, f"README.md's ListOps row for {backend} should read: {row}"


def test_the_quoted_seeds_and_cpu_preset_time_are_the_committed_records() -> None:
    readme, running = (ROOT / "README.md").read_text(), (ROOT / "docs" / "running.md").read_text()
    flat = " ".join(readme.split())
    # this version's seeds 0-4 (results/repeatability/), then the committed AMD records' 0-2
    folder = ROOT / "results" / "repeatability" / "listops-full-cpu-intel-xeon-2c"
    commits = {p.parent.parent.name for p in folder.glob("*/seed4/record.json")}
    assert len(commits) == 1, commits
    commit = commits.pop()
    current = [json.loads((folder / commit / f"seed{s}" / "record.json").read_text()) for s in range(5)]
    seeds = ", ".join(f"{100 * r['test_acc']:.2f}" for r in current)
    assert f"seeds 0-4 end at **{seeds}%** test with this version on an Intel Xeon, " \
        f"{mean_std([100 * r['test_acc'] for r in current])} (" in flat
    committed = ", ".join(f"{100 * r['test_acc']:.2f}" for r in cpu_records("full"))
    assert f"AMD, an earlier version: {committed}%" in flat
    minutes = [r["train_time_s"] / 60 for b in BACKENDS for r in cpu_records(b)]
    span = f"{round(min(minutes))}-{round(max(minutes))} min of training on one core"
    assert span in readme and span in running, f"README.md and docs/running.md should say: {span}"


def recall_means() -> Dict[str, List[str]]:
    """results/tables/recall.md's cells per backend: mean ± std (or the one seed's value) at 8 / 16 / 32 pairs."""
    committed = {}
    for line in (ROOT / "results" / "tables" / "recall.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        # Model | Protocol | ... | [chosen values |] 8 pairs | 16 pairs | 32 pairs
        if len(cells) >= 11 and cells[1].startswith("preset"):
            committed[cells[0]] = cells[-3:]
    return committed


def test_the_readme_mqar_figure_and_figures_are_the_committed_recall_table() -> None:
    """The README's MQAR paragraph shows results/tables/recall_by_family.png and quotes each backend's
    means as "name a / b / c%" (8 / 16 / 32 pairs), each the committed table's mean."""
    committed = recall_means()
    readme = (ROOT / "README.md").read_text()
    start = readme.index("**MQAR")
    paragraph = readme[start:readme.index("\n**", start + 1)]
    assert "(results/tables/recall_by_family.png)" in paragraph
    assert (ROOT / "results" / "tables" / "recall_by_family.png").read_bytes()[:4] == b"\x89PNG"
    quoted = re.findall(r"\b([a-z_]+(?: \([a-z]+\))?) ([\d.]+) / ([\d.]+) / ([\d.]+)%", paragraph)
    assert len(quoted) >= 3, paragraph
    for backend, *means in quoted:
        assert means == [cell.split(" ")[0] for cell in committed[backend]], f"README.md's MQAR figures for {backend}"


def test_the_mqar_tables_of_docs_results_are_the_committed_recall_table() -> None:
    """Each row of docs/results.md's MQAR tables ("| backend | keys | [chosen |] 8 | 16 | 32 |") is recall.md's."""
    committed = recall_means()
    text = (ROOT / "docs" / "results.md").read_text()
    section = text[text.index("## MQAR"):text.index("## Pathfinder")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    checked = [r for r in rows if r[0] in committed and len(r) in (5, 6)]
    assert len(checked) == len(committed), "docs/results.md should give every backend's MQAR row"
    for cells in checked:
        assert cells[-3:] == committed[cells[0]], f"docs/results.md's MQAR row for {cells[0]}"
