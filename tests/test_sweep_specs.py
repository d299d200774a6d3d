"""The sweep specs in sweeps/: each expands (lra-sweep run --dry-run) to the runs of the table it
regenerates: its tasks, the backends that claim that table's published rows (or every backend),
its seeds and preset."""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from attentions import list_attentions
from lra.files import package_data
from lra.tables.published import claims
from lra.tasks import list_tasks

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
LRA = ["listops", "text", "retrieval", "image", "pathfinder"]

# file -> (the published sources it regenerates (None: the suite's own table), tasks, seeds, preset, --set values)
SPECS: Dict[str, tuple] = {
    "lra_paper.yaml": (["tay2021_lra"], LRA, [0], "official", [()]),
    "pytorch_2layer.yaml": (["nystromformer2021", "skyformer2021", "xformers_lra"], LRA, [0], "paper", [()]),
    "listops_cpu.yaml": (None, ["listops"], [0, 1, 2], "cpu", [()]),
    "mqar_cpu.yaml": (None, ["mqar"], [0, 1, 2], "cpu", [("data.pairs=8",), ("data.pairs=16",), ("data.pairs=32",)]),
}


def claimed(sources: Optional[List[str]]) -> List[str]:
    """The backends whose published_as names a row of ``sources`` (every backend for None), in registry order."""
    if sources is None:
        return list(list_attentions())
    with open(package_data("reference") / "published_lra.csv") as f:
        models = {row["model"] for row in csv.DictReader(f) if row["source"] in sources}
    owner = claims()
    return [name for name in list_attentions() if any(owner.get(m) == name for m in models)]


def test_every_spec_in_sweeps_is_checked() -> None:
    assert sorted(p.name for p in SWEEPS.glob("*.yaml")) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_dry_run_lists_the_tables_runs(name: str, cli: Callable, tmp_path: Path) -> None:
    sources, tasks, seeds, preset, sets = SPECS[name]
    ran = cli("lra-sweep", "run", "--spec", SWEEPS / name, "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 0, ran.err
    *lines, total = ran.out.strip().splitlines()
    backends = claimed(sources)
    expected = {(t, a, s, preset, v) for t in tasks for a in backends for s in seeds for v in sets}
    listed = set()
    for line in lines:
        found = re.fullmatch(r"lra-run --task (\S+) --attn (\S+) --preset (\S+) --seed (\d+) --out \S+ --quiet(?: --set (.+))?",
                             line)
        assert found, line
        task, attn, run_preset, seed, values = found.groups()
        listed.add((task, attn, int(seed), run_preset, tuple(values.split()) if values else ()))
    assert total == f"{len(expected)} runs" and len(lines) == len(expected)
    assert listed == expected
    assert set(tasks) <= set(list_tasks()) and set(backends) <= set(list_attentions())
    assert not (tmp_path / "sw").exists()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_says_which_table_it_regenerates(name: str) -> None:
    text = (SWEEPS / name).read_text()
    assert text.startswith("# Regenerates ")
    sources = SPECS[name][0]
    for source in sources or []:
        assert source in text
