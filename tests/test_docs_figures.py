"""The figures README.md and docs/*.md quote equal the committed records they cite: a re-run that
changes a record fails here, not for a reader. Checked: every sample lra-run line (against
results/runs/<run>/record.json, printed as lra-run prints it), the README's ListOps table (accuracy per
seed, mean ± std and train time over results/runs), its seed list, the `cpu` preset's training time,
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


def test_the_readme_listops_table_is_the_committed_records() -> None:
    text = (ROOT / "README.md").read_text()
    full_time = statistics.mean(r["train_time_s"] for r in cpu_records("full"))
    for backend in BACKENDS:
        records = cpu_records(backend)
        accs = [100 * r["test_acc"] for r in records]
        times = [r["train_time_s"] for r in records]
        row = (f"| {backend} | {statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} | "
               f"{' / '.join(f'{a:.2f}' for a in accs)} | {statistics.mean(times):.0f} s | "
               f"{statistics.mean(times) / full_time:.2f}x |")
        assert row in text, f"README.md's ListOps row for {backend} should read: {row}"


def test_the_quoted_seeds_and_cpu_preset_time_are_the_committed_records() -> None:
    readme, running = (ROOT / "README.md").read_text(), (ROOT / "docs" / "running.md").read_text()
    seeds = ", ".join(f"{100 * r['test_acc']:.2f}" for r in cpu_records("full"))
    assert f"seeds 0-4 ended at **{seeds}, " in " ".join(readme.split())
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
