"""The wheel holds what the code reads: built from the repo and installed apart from the source tree,
lra-run trains from an unrelated folder and lra-table finds the published numbers."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = sorted(str(p.relative_to(REPO)) for pattern in ("lra/configs/*/*.yaml", "lra/reference/*.csv")
              for p in REPO.glob(pattern))
# the C kernels' sources: built on the user's machine on first use
KERNELS = sorted(str(p.relative_to(REPO)) for pattern in ("attentions/csrc/*.c", "attentions/csrc/*.h")
                 for p in REPO.glob(pattern))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                           "--quiet", "-w", str(out)], capture_output=True, text=True)
    if done.returncode != 0 and "No module named" in done.stderr:
        pytest.skip(f"cannot build a wheel here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    return next(out.glob("lra_suite-*.whl"))


def test_the_wheel_holds_every_yaml_csv_and_kernel_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert DATA and len([p for p in DATA if p.endswith(".yaml")]) >= 16
    assert "attentions/csrc/dropout_cpu.c" in KERNELS and "attentions/csrc/blocks.h" in KERNELS
    missing = [p for p in DATA + KERNELS if p not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_installed_apart_from_the_source_it_runs_and_tabulates(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    script = (
        "import lra, sys\n"
        f"assert lra.__file__.startswith({str(site)!r}), lra.__file__\n"
        "from lra.cli import call\n"
        "from lra.cli import run, data\n"
        "from lra.tables import cli as tables\n"
        "sys.exit(call('lra-run', run.main, ['--task', 'listops', '--attn', 'mita', '--preset', 'smoke', '--quiet',\n"
        "    '--set', 'data.size=64', 'train.steps=2', 'train.eval_every=2']) or\n"
        "    call('lra-table', tables.main, ['--runs', 'runs', '--include-smoke', '--no-plots', '--out', 'tables']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no published numbers found" not in done.stderr
    accuracy = (elsewhere / "tables" / "accuracy.md").read_text()
    assert "| mita | this suite | preset smoke" in accuracy and "Tay et al. 2021" in accuracy
