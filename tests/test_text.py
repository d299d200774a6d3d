"""Text (IMDB, byte level): the loader on a tiny aclImdb/ fixture, folder and archive."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from conftest import bump_mtime, cfg, fail_if_called, make_tar
from lra.errors import UserError
from lra.tasks import Split, get_task
from lra.tasks import text as text_task


# (part, label folder, file name) -> review text as written to disk
REVIEWS = {
    ("train", "pos", "0_9.txt"): "  ab\n",
    ("train", "pos", "1_8.txt"): "caf\u00e9",
    ("train", "neg", "2_1.txt"): "bad movie",
    ("test", "pos", "3_10.txt"): "great",
    ("test", "neg", "4_2.txt"): "no",
}


def make_imdb(root: Path, archive: bool = False) -> Path:
    base = root / "aclImdb"
    for (part, label, name), text in REVIEWS.items():
        (base / part / label).mkdir(parents=True, exist_ok=True)
        (base / part / label / name).write_text(text, encoding="utf-8")
    # unlabeled reviews and the vocabulary file are not part of the task
    (base / "train" / "unsup").mkdir()
    (base / "train" / "unsup" / "5_0.txt").write_text("unlabeled")
    (base / "imdb.vocab").write_text("the\n")
    if archive:
        path = make_tar(root, "aclImdb", "aclImdb_v1.tar.gz")
        for f in sorted(base.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        base.rmdir()
        return path
    return base


def decoded(split: Split) -> Dict[bytes, int]:
    """Each row's real tokens turned back into bytes (id - 1), mapped to its label."""
    rows = {}
    for tokens, length, label in zip(split.tokens, split.lengths, split.labels):
        rows[bytes((tokens[:length] - 1).astype(np.uint8).tolist())] = int(label)
    return rows


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "archive"])
def test_text_bytes_labels_and_splits(tmp_path: Path, archive: bool) -> None:
    make_imdb(tmp_path, archive)
    task = get_task("text")
    splits = task.load(cfg(tmp_path))
    assert (task.spec.vocab_size, task.spec.max_len, task.spec.num_classes) == (257, 4000, 2)
    train, val, test = splits["train"], splits["val"], splits["test"]
    assert (len(train), len(val), len(test)) == (3, 2, 2)
    assert train.tokens.shape == (3, 4000) and train.tokens.dtype in (np.int16, np.uint16)
    # white space around a review is stripped; pos = 1, neg = 0; train/unsup is ignored
    assert decoded(train) == {b"bad movie": 0, b"ab": 1, "caf\u00e9".encode(): 1}
    assert decoded(test) == {b"great": 1, b"no": 0}
    ab = int(np.flatnonzero(train.lengths == 2)[0])
    assert train.tokens[ab, :3].tolist() == [98, 99, 0]
    # U+00E9 is the UTF-8 bytes C3 A9, each shifted by one
    cafe = int(np.flatnonzero(train.lengths == 5)[0])
    assert train.tokens[cafe, :6].tolist() == [100, 98, 103, 0xC3 + 1, 0xA9 + 1, 0]
    assert int(train.tokens[:, 9:].max()) == 0
    # IMDB has no validation split: val is the test split
    assert np.array_equal(val.tokens, test.tokens) and np.array_equal(val.labels, test.labels)


def test_text_rows_are_not_grouped_by_label(tmp_path: Path) -> None:
    base = make_imdb(tmp_path)
    for i in range(8):
        (base / "test" / "pos" / f"{10 + i}_9.txt").write_text(f"good {i}")
        (base / "test" / "neg" / f"{20 + i}_1.txt").write_text(f"poor {i}")
    labels = get_task("text").load(cfg(tmp_path))["val"].labels.tolist()
    # the first eval batches must see both classes, not 9 neg reviews then 9 pos ones
    assert sorted(labels) == [0] * 9 + [1] * 9 and labels != sorted(labels) and len(set(labels[:4])) == 2


def test_text_folder_and_archive_give_the_same_arrays(tmp_path: Path) -> None:
    make_imdb(tmp_path / "a")
    make_imdb(tmp_path / "b", archive=True)
    a = get_task("text").load(cfg(tmp_path / "a", 16))
    b = get_task("text").load(cfg(tmp_path / "b", 16))
    for s in ("train", "val", "test"):
        assert np.array_equal(a[s].tokens, b[s].tokens) and np.array_equal(a[s].labels, b[s].labels)


def test_text_cuts_at_max_len(tmp_path: Path) -> None:
    make_imdb(tmp_path)
    train = get_task("text").load(cfg(tmp_path, 4))["train"]
    assert train.tokens.shape == (3, 4)
    assert sorted(train.lengths.tolist()) == [2, 4, 4]
    assert decoded(train) == {b"bad ": 0, b"ab": 1, b"caf\xc3": 1}


def test_text_cache_is_reused_then_rebuilt_when_a_source_or_max_len_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_imdb(tmp_path)
    task = get_task("text")
    task.load(cfg(tmp_path, 8))
    with monkeypatch.context() as m:
        m.setattr(text_task, "read_folder", fail_if_called)
        assert b"ab" in decoded(task.load(cfg(tmp_path, 8))["train"])
    review = base / "train" / "pos" / "0_9.txt"
    review.write_text("zz")
    bump_mtime(review)
    assert decoded(task.load(cfg(tmp_path, 8))["train"])[b"zz"] == 1
    assert task.load(cfg(tmp_path, 5))["train"].tokens.shape == (3, 5)


def test_text_missing_data_names_every_place_searched(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        get_task("text").load(cfg(tmp_path))
    message = str(err.value)
    for part in (str(tmp_path / "aclImdb"), str(tmp_path / "aclImdb_v1.tar.gz"), "HF_DATASETS_OFFLINE", "ai.stanford.edu"):
        assert part in message
    status = get_task("text").status(str(tmp_path))
    assert not status.present and "aclImdb_v1.tar.gz" in status.missing


def test_text_folder_without_a_label_folder_is_an_error(tmp_path: Path) -> None:
    base = make_imdb(tmp_path)
    (base / "test" / "neg" / "4_2.txt").unlink()
    (base / "test" / "neg").rmdir()
    with pytest.raises(UserError, match="lacks test/neg"):
        get_task("text").load(cfg(tmp_path))


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "archive"])
def test_text_status_counts_reviews(tmp_path: Path, archive: bool) -> None:
    make_imdb(tmp_path, archive)
    task = get_task("text")
    if archive:
        # listing a real archive takes tens of seconds, so its sizes come from the cache of a first load
        status = task.status(str(tmp_path))
        assert status.present and status.split_sizes == {}
        task.load(cfg(tmp_path))
    status = task.status(str(tmp_path))
    assert status.present and status.split_sizes == {"train": 3, "val": 2, "test": 2}


def test_text_hub_copy_is_fetched_only_online_and_then_served_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = {"train": {"text": [" ab\n", "x"], "label": [1, 0]}, "test": {"text": ["y"], "label": [0]}}
    monkeypatch.setattr(text_task, "offline_reason", lambda: "")
    monkeypatch.setattr(text_task, "load_hub", lambda task, name, instead: hub)
    assert decoded(get_task("text").load(cfg(tmp_path))["train"]) == {b"ab": 1, b"x": 0}
    monkeypatch.setattr(text_task, "offline_reason", lambda: "HF_DATASETS_OFFLINE is set")
    monkeypatch.setattr(text_task, "load_hub", fail_if_called)
    assert decoded(get_task("text").load(cfg(tmp_path))["test"]) == {b"y": 0}
    assert get_task("text").status(str(tmp_path)).split_sizes == {"train": 2, "val": 1, "test": 1}
