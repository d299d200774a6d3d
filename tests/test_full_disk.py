"""A full disk, for real: a small tmpfs mounted over the run, data or output folder and filled to the
last byte. Every writer stops with one line naming the file and the cause (exit status 1 for a run,
2 for a command's own output), keeps the previous complete file, leaves no temporary file and no
half data set; a run continued once space is freed ends as one that never ran out of it.

Mounting needs root and a system that allows ``mount -t tmpfs``; elsewhere these tests skip, saying why.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import pytest
import torch

import lra.run.checkpoint
import lra.run.train
from lra.cli import run as lra_run
from conftest import copy_listops
from test_kill_anywhere import TINY, outcome

ROOT = Path(__file__).resolve().parents[1]
NO_SPACE = "No space left on device"


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made), with a tmpfs of ``size`` (mount's notation: 8m) mounted on it for the block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this system")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here: {(mounted.stderr.strip() or 'no reason given')[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(disk: Path) -> Path:
    """Write ``disk/filler`` until the disk has not one byte left; returns it (delete it to free the space)."""
    filler = disk / "filler"
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    return filler


def one_error(proc: object, prog: str, code: int, *words: str) -> str:
    """The one stderr line of a command that ended with ``code``, holding ``words``; no traceback."""
    lines = proc.err.strip().splitlines()
    assert proc.code == code and len(lines) == 1, proc.err[-3000:]
    assert lines[0].startswith(f"{prog}: error: cannot write ") and NO_SPACE in lines[0], lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def leftovers(folder: Path) -> List[str]:
    """Temporary files and folders (``.<name>.<random>``) anywhere under ``folder``."""
    return [str(p) for p in folder.rglob(".*") if p.name != ".lock"]


def hashes(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (".lock", "filler")}


# ---- lra-run ----

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, listops_data: Path) -> dict:
    """The outcome (test_kill_anywhere.outcome) of the run never short of space."""
    folder = tmp_path_factory.mktemp("disk-ref")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert lra_run.main([*TINY, "data.data_dir=" + str(listops_data)]) == 0
    return outcome(folder)


def fills_after(disk: Path, module: object, name: str, when: Callable[[tuple], bool]) -> Callable:
    """``module.name`` that fills ``disk`` after the first call for which ``when(args)`` holds."""
    real = getattr(module, name)
    done: List[bool] = []

    def wrapped(*args: object) -> object:
        result = real(*args)
        if not done and when(args):
            fill(disk)
            done.append(True)
        return result
    return wrapped


def fills_before(disk: Path, module: object, name: str, when: Callable[[tuple], bool]) -> Callable:
    real = getattr(module, name)

    def wrapped(*args: object) -> object:
        if when(args) and not (disk / "filler").exists():
            fill(disk)
        return real(*args)
    return wrapped


# where the disk fills: (the module function wrapped, fill after it or before it, on which call, the
# file that fails, the checkpoint step that must survive (None: no checkpoint yet))
MOMENTS = {
    "before-the-first-metrics-line": (lra.run.checkpoint, "open_metrics", fills_after, lambda a: True, "metrics.jsonl", None),
    "after-the-first-checkpoint": (lra.run.checkpoint, "save_checkpoint", fills_after,
                                   lambda a: a[0].name == "checkpoint.pt", "checkpoint.pt", 4),
    "before-the-record": (lra.run.train, "write_json_atomic", fills_before, lambda a: a[0].name == "record.json", "record.json", 16),
}


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_run_on_a_disk_that_fills_stops_in_one_line_and_resumes_identical(
    moment: str, reference: dict, listops_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable
) -> None:
    module, name, how, when, failing, kept_step = MOMENTS[moment]
    with tmpfs(tmp_path / "disk", "16m") as disk:
        monkeypatch.chdir(disk)
        args = [*TINY, "data.data_dir=" + str(listops_data)]
        with monkeypatch.context() as patch:
            patch.setattr(module, name, how(disk, module, name, when))
            proc = cli("lra-run", *args)
        run = disk / "runs" / "listops_full_smoke_seed0"
        one_error(proc, "lra-run", 1, f"runs/{run.name}/{failing}:", "run the same command again")
        assert leftovers(disk) == [] and not (run / "record.json").exists()
        if kept_step is None:
            assert not (run / "checkpoint.pt").exists()
        else:
            assert torch.load(run / "checkpoint.pt", weights_only=True)["state"]["step"] == kept_step
        # the log ends with its last whole line
        text = (run / "metrics.jsonl").read_text()
        assert text == "" or text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
        (disk / "filler").unlink()
        again = cli("lra-run", *args)
        assert again.code == 0, again.err[-3000:]
        assert outcome(disk) == reference


def test_a_token_cache_that_does_not_fit_leaves_none(listops_data: Path, tmp_path: Path, cli: Callable,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with tmpfs(tmp_path / "data", "8m") as disk:
        copy_listops(listops_data, disk)
        (disk / ".cache").mkdir()
        fill(disk)
        args = [*TINY, "data.data_dir=" + str(disk)]
        proc = cli("lra-run", *args)
        one_error(proc, "lra-run", 1, str(disk / ".cache" / "listops-"), "no cache was stored")
        assert leftovers(disk / ".cache") == []
        (disk / "filler").unlink()
        assert cli("lra-run", *args).code == 0


# ---- generated data ----

def test_listops_generated_on_a_full_disk_is_absent_then_complete(tmp_path: Path, cli: Callable) -> None:
    """The set's three files are written together: val and test fit, train does not, and none is left."""
    args = ["generate", "listops", "--size", "40"]
    with tmpfs(tmp_path / "data", "2m") as disk:
        filler = fill(disk)
        # room for the generated chunk (500 trees, gzip: about 700 KB) and val and test (32 rows, about 210 KB
        # each), not for train too (40 rows, about 260 KB)
        os.truncate(filler, filler.stat().st_size - (1250 << 10))
        proc = cli("lra-data", *args, "--data-dir", disk)
        folder = disk / "listops_n40_seed0"
        one_error(proc, "lra-data", 2, str(folder / "basic_train.tsv"), "no file of the set was written")
        # the generated shards are kept, whole, for the rerun
        assert sorted(p.name for p in folder.iterdir()) == [".lock", ".parts"]
        assert not [p for p in (folder / ".parts").iterdir() if p.name.startswith(".")]
        filler.unlink()
        assert cli("lra-data", *args, "--data-dir", disk).code == 0
        rows = {s: len((folder / f"basic_{s}.tsv").read_text().splitlines()) - 1 for s in ("train", "val", "test")}
        assert rows == {"train": 40, "val": 32, "test": 32}


def test_pathfinder_generated_on_a_full_disk_keeps_no_partial_batch(tmp_path: Path, cli: Callable) -> None:
    args = ["generate", "pathfinder32", "--size", "6", "--level", "curv_baseline"]
    with tmpfs(tmp_path / "data", "1m") as disk:
        filler = fill(disk)
        # a page for generator.json and two for images: the third image does not fit
        os.truncate(filler, filler.stat().st_size - 3 * 4096)
        proc = cli("lra-data", *args, "--data-dir", disk)
        level = disk / "pathfinder32" / "curv_baseline"
        one_error(proc, "lra-data", 2, str(level / "imgs"), "run the same command again")
        # the one chunk of the batch was not finished: none of its images is left
        assert not list((level / "imgs" / "0").iterdir()) and not list((level / "metadata").iterdir())
        assert leftovers(level) == []
        filler.unlink()
        assert cli("lra-data", *args, "--data-dir", disk).code == 0
        assert len(list((level / "imgs" / "0").glob("*.png"))) == 6
        # the images and metadata of a generation never short of space
        assert cli("lra-data", *args, "--data-dir", tmp_path / "elsewhere").code == 0
        assert hashes(disk / "pathfinder32") == hashes(tmp_path / "elsewhere" / "pathfinder32")


# ---- a command's own output ----

def test_tables_on_a_full_disk_keep_the_previous_ones(tmp_path: Path, cli: Callable) -> None:
    with tmpfs(tmp_path / "tables", "1m") as disk:
        args = ["--runs", tmp_path / "no-runs", "--out", disk, "--no-plots"]
        assert cli("lra-table", *args).code == 0
        before = hashes(disk)
        assert "taxonomy.md" in before
        fill(disk)
        proc = cli("lra-table", *args)
        # the published-beside-measured table is the first one written without runs
        one_error(proc, "lra-table", 2, str(disk / "published"), "is left as it was")
        assert hashes(disk) == before and leftovers(disk) == []


def test_bench_report_on_a_full_disk_keeps_the_record_and_table(tmp_path: Path, cli: Callable) -> None:
    source = ROOT / "results" / "throughput" / "attention-amd-epyc-2c" / "record.json"
    with tmpfs(tmp_path / "bench", "1m") as disk:
        shutil.copy(source, disk / "record.json")
        assert cli("lra-bench", "report", disk / "record.json", "--no-plot").code == 0
        before = hashes(disk)
        fill(disk)
        proc = cli("lra-bench", "report", disk / "record.json", "--no-plot")
        one_error(proc, "lra-bench", 2, str(disk / "record.json"))
        assert hashes(disk) == before and leftovers(disk) == []
