"""The token cache carries the SHA-256 of its files: a changed, cut or unreadable cache is rebuilt from the
sources with one notice on stderr, never trained on; an intact one is loaded without reading the sources."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict

import numpy as np
import pytest

from conftest import copy_listops, fail_if_called, smoke_listops
from lra.cli import run as lra_run
from lra.config import DataConfig
from lra.tasks import get_task, listops
from lra.tasks.base import SPLITS, cache_problem


@pytest.fixture
def generated(listops_data: Path, tmp_path: Path) -> Path:
    """./data of the test's own: a copy of the session's smoke ListOps set, no token cache yet."""
    return copy_listops(listops_data, tmp_path / "data")


def load(root: Path) -> Dict[str, list]:
    _, size = smoke_listops()
    splits = get_task("listops").load(DataConfig(data_dir=str(root), size=size, max_len=64, generate=False))
    return {s: [np.array(getattr(splits[s], part)) for part in ("tokens", "lengths", "labels")] for s in SPLITS}


def cache_folder(root: Path) -> Path:
    (folder,) = (root / ".cache").glob("listops-*")
    return folder


def change_a_value(name: str, change: Callable[[np.ndarray], None]) -> Callable[[Path], None]:
    """Rewrite one array with a value changed but kept in range: same size, same header."""
    def corrupt(folder: Path) -> None:
        array = np.load(folder / name)
        change(array)
        np.save(folder / name, array)
    return corrupt


def bump_token(tokens: np.ndarray) -> None:
    tokens[0, 0] = tokens[0, 0] % 17 + 1


def bump_label(labels: np.ndarray) -> None:
    labels[0] = (labels[0] + 1) % 10


CORRUPTIONS: Dict[str, Callable[[Path], None]] = {
    "token-changed-in-range": change_a_value("train.tokens.npy", bump_token),
    "label-changed-in-range": change_a_value("test.labels.npy", bump_label),
    "zero-bytes": lambda f: (f / "train.tokens.npy").write_bytes(b""),
    "garbage": lambda f: (f / "val.labels.npy").write_bytes(b"\x93NUMPY garbage" * 9),
    "missing-file": lambda f: (f / "val.lengths.npy").unlink(),
    "checksums-garbage": lambda f: (f / "checksums.json").write_text("{not json"),
    "no-checksums": lambda f: (f / "checksums.json").unlink(),
}


@pytest.mark.parametrize("damage", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_damaged_cache_is_rebuilt_with_one_notice(damage: Callable[[Path], None], generated: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    root = generated
    clean = load(root)
    folder = cache_folder(root)
    damage(folder)
    capsys.readouterr()
    rebuilt = load(root)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the token cache {folder}" in err[0] and "rebuilding it from the sources" in err[0], err
    for split in SPLITS:
        for got, want in zip(rebuilt[split], clean[split]):
            np.testing.assert_array_equal(got, want)
    # repaired on disk: the next load reads the cache, not the sources, and says nothing
    assert cache_problem(folder) == ""
    monkeypatch.setattr(listops, "read_split", fail_if_called)
    load(root)
    assert capsys.readouterr().err == ""


def test_the_checksums_cover_every_file(generated: Path) -> None:
    load(generated)
    folder = cache_folder(generated)
    sums = json.loads((folder / "checksums.json").read_text())
    assert sorted(sums) == sorted(p.name for p in folder.glob("*.npy")) and len(sums) == 9


def test_a_killed_cache_write_leaves_nothing_behind(generated: Path) -> None:
    """The temporary folder of a write killed midway is removed by the next write."""
    root = generated
    leftover = root / ".cache" / ".listops-0123456789abcdef.k1ll3d"
    leftover.mkdir(parents=True)
    (leftover / "train.tokens.npy").write_bytes(b"\x93NUMPY half")
    load(root)
    assert not leftover.exists()
    assert [p.name for p in (root / ".cache").iterdir() if p.name != ".lock"] == [cache_folder(root).name]


def test_a_run_on_a_changed_cache_trains_on_the_sources(generated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    """Labels changed in the cache (same size) are caught: the run trains and tests on the sources' labels."""
    # no --data-dir: lra-run must read ./data (generated), the cache_folder below finds its token cache there
    monkeypatch.chdir(tmp_path)
    args = ["--task", "listops", "--attn", "full", "--preset", "smoke", "--quiet", "--set", "model.dim=16",
            "model.ffn_dim=32", "model.num_layers=1", "data.max_len=64", "train.steps=4", "train.eval_every=2"]
    assert lra_run.main([*args, "--out", "clean"]) == 0
    folder = cache_folder(tmp_path / "data")
    labels = np.load(folder / "test.labels.npy")
    np.save(folder / "test.labels.npy", (labels + 3) % 10)
    capsys.readouterr()
    assert lra_run.main([*args, "--out", "changed"]) == 0
    assert "rebuilding it from the sources" in capsys.readouterr().err
    clean, changed = (json.loads(next((tmp_path / out).glob("*/record.json")).read_text()) for out in ("clean", "changed"))
    for key in ("test_acc", "val_acc", "majority_acc", "final_train_loss"):
        assert changed[key] == clean[key], key
