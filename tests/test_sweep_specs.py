"""The sweep specs in sweeps/: each expands (lra-sweep run --dry-run) to the runs of the table it
regenerates: its tasks, the backends that claim that table's published rows (or every backend),
its seeds and preset."""
from __future__ import annotations

import csv
import re
import shlex
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


# the tuned specs: file -> (tasks, backends and their own values, seeds, preset, --set values)
LEVELS = [("data.pairs=8",), ("data.pairs=16",), ("data.pairs=32",)]
CHUNKED = ("reformer", ("attn.form=chunked",))
TUNED: Dict[str, tuple] = {
    "mqar_cpu_tuned.yaml": (["mqar"], [(a, ()) for a in list_attentions()] + [CHUNKED], [0, 1, 2], "cpu", LEVELS),
    "listops_cpu_tuned.yaml": (["listops"], [(a, ()) for a in ("full", "linear", "performer", "nystromformer",
                                                                 "skyformer", "reformer", "informer", "agent", "mita")]
                               + [CHUNKED], [0, 1, 2], "cpu", [()]),
}
LRS = ("train.lr=0.0003", "train.lr=0.001", "train.lr=0.003", "train.lr=0.01")


def test_every_spec_in_sweeps_is_checked() -> None:
    assert sorted(p.name for p in SWEEPS.glob("*.yaml")) == sorted({**SPECS, **TUNED})


@pytest.mark.parametrize("name", sorted(TUNED))
def test_tuned_spec_dry_run_lists_the_learning_rate_grid_then_each_cells_seeds(name: str, cli: Callable,
                                                                               tmp_path: Path) -> None:
    """Every (level, backend) cell: the four learning rates at seed 0, then seeds 1 and 2 at the chosen one."""
    tasks, backends, seeds, preset, levels = TUNED[name]
    ran = cli("lra-sweep", "run", "--spec", SWEEPS / name, "--out", tmp_path / "sw", "--dry-run")
    assert ran.code == 0, ran.err
    *lines, total = ran.out.strip().splitlines()
    listed = set()
    for line in lines:
        words = shlex.split(line)
        flags = dict(zip(words[1::2], words[2::2]))
        values = tuple(words[words.index("--set") + 1:words.index("--tuning") if "--tuning" in words else None])
        listed.add((flags["--task"], flags["--attn"], int(flags["--seed"]), flags["--preset"], values))
    cells = [(t, a, own + level) for t in tasks for a, own in backends for level in levels]
    grid = {(t, a, 0, preset, values + (lr,)) for t, a, values in cells for lr in LRS}
    waiting = {(t, a, s, preset, values + ("train.lr=<chosen>",)) for t, a, values in cells for s in seeds[1:]}
    assert listed == grid | waiting and len(lines) == len(grid) + len(waiting)
    assert total.startswith(f"{len(lines)} runs: {len(grid)} on the tuning grid (train.lr over 0.0003, 0.001, 0.003, "
                            "0.01 at seed 0, by val_acc")


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


@pytest.mark.parametrize("name", sorted({**SPECS, **TUNED}))
def test_spec_says_which_table_it_regenerates(name: str) -> None:
    text = (SWEEPS / name).read_text()
    assert text.startswith("# Regenerates ")
    sources = SPECS[name][0] if name in SPECS else None
    for source in sources or []:
        assert source in text
