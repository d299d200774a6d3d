"""Text (IMDB), Retrieval (AAN) and Image (CIFAR-10) loaders on tiny fixtures in the official formats."""
from __future__ import annotations

import os
import pickle
import re
import tarfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from lra.config import DataConfig
from lra.errors import UserError
from lra.tasks import Split, get_task
from lra.tasks import image as image_task
from lra.tasks import retrieval as retrieval_task
from lra.tasks import text as text_task


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the network: the hub fallback must see an offline machine."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def cfg(root: Path, max_len: int = 0) -> DataConfig:
    return DataConfig(data_dir=str(root), max_len=max_len)


def make_tar(root: Path, folder: str, archive: str) -> Path:
    with tarfile.open(root / archive, "w:gz") as tar:
        tar.add(root / folder, arcname=folder)
    return root / archive


def bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def fail_if_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("the sources were read again instead of the cache")


# IMDB -----------------------------------------------------------------------------------------

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


# AAN ------------------------------------------------------------------------------------------

AAN_ROWS = {
    "train": [b"1.0\tp1\tp2\tab\tcaf\xc3\xa9", b"0.0\tp3\tp4\tx\t\"q\""],
    "val": [b"0.0\tp5\tp6\tlong text\ty"],
    "test": [b"1.0\tp7\tp8\tz\tw", b"1\tp9\tp0\tu\tv"],
}


def make_aan(folder: Path, rows: Dict[str, List[bytes]] = AAN_ROWS) -> Dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, name in retrieval_task.FILES.items():
        paths[split] = folder / name
        paths[split].write_bytes(b"".join(row + b"\n" for row in rows[split]))
    return paths


@pytest.mark.parametrize(
    "layout", ["tsv_data", "lra_release/tsv_data", "lra_release/lra_release/tsv_data", "aan", "."]
)
def test_retrieval_pairs_in_every_layout(tmp_path: Path, layout: str) -> None:
    make_aan(tmp_path / layout)
    task = get_task("retrieval")
    splits = task.load(cfg(tmp_path, 6))
    assert task.spec.dual and task.spec.vocab_size == 257 and task.spec.max_len == 4000
    train = splits["train"]
    assert [len(splits[s]) for s in ("train", "val", "test")] == [2, 1, 2]
    assert train.tokens.shape == (2, 2, 6) and train.lengths.shape == (2, 2)
    assert train.labels.tolist() == [1, 0] and splits["test"].labels.tolist() == [1, 1]
    assert train.tokens[0, 0].tolist() == [98, 99, 0, 0, 0, 0]
    assert train.tokens[0, 1].tolist() == [100, 98, 103, 0xC3 + 1, 0xA9 + 1, 0]
    # quotes are data, as in the official reader (use_quote_delim=False)
    assert train.tokens[1, 1, :3].tolist() == [35, 114, 35]
    assert train.lengths.tolist() == [[2, 5], [1, 3]]
    # "long text" is cut at max_len
    assert splits["val"].lengths.tolist() == [[6, 1]]


@pytest.mark.parametrize(
    "row, problem",
    [(b"1.0\tp1\tp2\tonly four", "expected 5 tab-separated columns"), (b"yes\tp1\tp2\ta\tb", "is not a number"),
     (b"2.0\tp1\tp2\ta\tb", "is not 0 or 1")],
    ids=["columns", "label-text", "label-range"],
)
def test_retrieval_malformed_row_names_file_and_line(tmp_path: Path, row: bytes, problem: str) -> None:
    rows = dict(AAN_ROWS, train=AAN_ROWS["train"] + [row])
    paths = make_aan(tmp_path / "tsv_data", rows)
    with pytest.raises(UserError) as err:
        get_task("retrieval").load(cfg(tmp_path))
    assert f"{paths['train']}:3" in str(err.value) and problem in str(err.value)


def test_retrieval_cache_is_reused_then_rebuilt_when_a_file_or_max_len_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = make_aan(tmp_path / "tsv_data")
    task = get_task("retrieval")
    assert len(task.load(cfg(tmp_path, 8))["train"]) == 2
    with monkeypatch.context() as m:
        m.setattr(retrieval_task, "read_pairs", fail_if_called)
        assert len(task.load(cfg(tmp_path, 8))["train"]) == 2
    with open(paths["train"], "ab") as f:
        f.write(b"0.0\tp1\tp3\tm\tn\n")
    assert len(task.load(cfg(tmp_path, 8))["train"]) == 3
    assert task.load(cfg(tmp_path, 4))["train"].tokens.shape == (3, 2, 4)


def test_retrieval_partial_set_and_missing_data_are_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        get_task("retrieval").load(cfg(tmp_path))
    for place in retrieval_task.places(str(tmp_path)):
        assert str(place) in str(err.value)
    assert "new_aan_pairs.eval.tsv" in str(err.value) and "lra_release.gz" in str(err.value)
    paths = make_aan(tmp_path / "aan")
    paths["val"].unlink()
    with pytest.raises(UserError, match="lacks new_aan_pairs.eval.tsv"):
        get_task("retrieval").load(cfg(tmp_path))


def test_retrieval_status_counts_rows(tmp_path: Path) -> None:
    assert not get_task("retrieval").status(str(tmp_path)).present
    make_aan(tmp_path / "lra_release" / "tsv_data")
    status = get_task("retrieval").status(str(tmp_path))
    assert status.present and status.split_sizes == {"train": 2, "val": 1, "test": 2}


# CIFAR-10 -------------------------------------------------------------------------------------

# (R, G, B) -> grey as tf.image.rgb_to_grayscale gives it: trunc(255.5 * (0.2989 r + 0.587 g + 0.114 b) / 255)
GREY = {
    (0, 0, 0): 0,
    (255, 0, 0): 76,  # 0.2989 * 255.5 = 76.37
    (0, 255, 0): 149,  # 0.5870 * 255.5 = 149.98
    (0, 0, 255): 29,  # 0.1140 * 255.5 = 29.13
    (255, 255, 255): 255,  # 0.9999 * 255.5 = 255.47
    (200, 100, 50): 124,  # 124.18 * 255.5 / 255 = 124.42
    # exact: 92.99999608; TF's float32 sum gives 93.0000 (float64 would give 92)
    (0, 122, 186): 93,
}


def test_grey_matches_tensorflow_on_hand_computed_pixels() -> None:
    rgb = np.array(list(GREY), dtype=np.uint8)  # [7, 3]
    grey = image_task.to_grey(rgb[:, 0], rgb[:, 1], rgb[:, 2])
    assert grey.dtype == np.uint8 and grey.tolist() == list(GREY.values())


def reference_grey(rgb: np.ndarray) -> np.ndarray:
    """TF's rule written out per pixel, in float32: trunc(255.5 * ((0.2989 r + 0.587 g) + 0.114 b)), x = byte / 255."""
    x = rgb.astype(np.float32) * np.float32(1 / 255)  # [n, 3]
    w = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
    return (((x[:, 0] * w[0] + x[:, 1] * w[1]) + x[:, 2] * w[2]) * np.float32(255.5)).astype(np.uint8)


def test_grey_table_path_matches_the_formula_on_random_pixels() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, size=(100_000, 3), dtype=np.uint8)
    assert np.array_equal(image_task.to_grey(rgb[:, 0], rgb[:, 1], rgb[:, 2]), reference_grey(rgb))


def cifar_pixels(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def make_cifar(root: Path, archive: bool = False, per_batch: int = 10) -> Tuple[Path, Dict[str, np.ndarray]]:
    """5 training batches and a test batch of random images, pickled as the originals (bytes keys)."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    data = {}
    for name in image_task.TRAIN_BATCHES + [image_task.TEST_BATCH]:
        pixels = cifar_pixels(rng, per_batch)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        data[name] = pixels
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": pixels, b"filenames": [b"x.png"] * per_batch}
        if name == "data_batch_1":
            # the first pixel of the first image: R, G, B planes of a colour that is hard to round
            pixels[0, 0], pixels[0, 1024], pixels[0, 2048] = 0, 122, 186
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    if archive:
        make_tar(root, "cifar-10-batches-py", "cifar-10-python.tar.gz")
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        return root / "cifar-10-python.tar.gz", data
    return folder, data


def grey_of(pixels: np.ndarray) -> np.ndarray:
    return image_task.to_grey(pixels[:, :1024], pixels[:, 1024:2048], pixels[:, 2048:])


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "archive"])
def test_image_grey_tokens_and_the_last_tenth_validates(tmp_path: Path, archive: bool) -> None:
    _, data = make_cifar(tmp_path, archive)
    task = get_task("image")
    assert (task.spec.vocab_size, task.spec.max_len, task.spec.num_classes, task.spec.padded) == (256, 1024, 10, False)
    splits = task.load(cfg(tmp_path))
    train, val, test = splits["train"], splits["val"], splits["test"]
    assert (len(train), len(val), len(test)) == (45, 5, 10)
    assert train.tokens.dtype == np.uint8 and train.tokens.shape == (45, 1024)
    assert set(train.lengths.tolist()) == {1024} and set(test.lengths.tolist()) == {1024}
    assert int(train.tokens[0, 0]) == 93
    all_train = np.concatenate([data[name] for name in image_task.TRAIN_BATCHES])
    assert np.array_equal(train.tokens, grey_of(all_train[:45]))
    # the last 5 images of data_batch_5 validate
    assert np.array_equal(val.tokens, grey_of(data["data_batch_5"][5:]))
    assert np.array_equal(test.tokens, grey_of(data["test_batch"]))
    assert 0 <= int(train.labels.min()) and int(train.labels.max()) <= 9


def test_image_hub_copy_is_fetched_only_online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image as PILImage

    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, size=(12, 32, 32, 3), dtype=np.uint8)
    rows = {"img": [PILImage.fromarray(im) for im in rgb], "label": list(range(10)) + [3, 4]}
    hub = {"train": {k: v[:10] for k, v in rows.items()}, "test": {k: v[10:] for k, v in rows.items()}}
    monkeypatch.setattr(image_task, "offline_reason", lambda: "")
    monkeypatch.setattr(image_task, "load_hub", lambda task, name, instead: hub)
    splits = get_task("image").load(cfg(tmp_path))
    # channel-last hub images go through the same planes -> grey rule as the pickled batches
    planes = rgb.transpose(0, 3, 1, 2).reshape(12, 3072)
    assert np.array_equal(splits["train"].tokens, grey_of(planes[:9]))
    assert np.array_equal(splits["val"].tokens, grey_of(planes[9:10]))
    assert splits["test"].labels.tolist() == [3, 4]


def test_image_of_the_wrong_size_names_the_file(tmp_path: Path) -> None:
    folder, _ = make_cifar(tmp_path)
    batch = {b"labels": [0, 1], b"data": np.zeros((2, 3000), dtype=np.uint8)}
    (folder / "data_batch_3").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UserError, match=re.escape(f"{folder / 'data_batch_3'} holds images of shape (3000,)")):
        get_task("image").load(cfg(tmp_path))


class RunsCode:
    def __reduce__(self) -> tuple:
        return (print, ("this must never run",))


def test_image_batch_that_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder, _ = make_cifar(tmp_path)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": RunsCode(), b"labels": []}, protocol=2))
    with pytest.raises(UserError, match="refusing to load .*print"):
        get_task("image").load(cfg(tmp_path))
    assert "must never run" not in capsys.readouterr().out


def test_image_cache_is_reused_then_rebuilt_when_a_batch_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, data = make_cifar(tmp_path)
    task = get_task("image")
    task.load(cfg(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(image_task, "read_batch", fail_if_called)
        assert int(task.load(cfg(tmp_path))["train"].tokens[0, 0]) == 93
    batch = pickle.loads((folder / "data_batch_1").read_bytes())
    batch[b"data"][0, :3072] = 255
    (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=2))
    bump_mtime(folder / "data_batch_1")
    assert int(task.load(cfg(tmp_path))["train"].tokens[0, 0]) == 255


def test_image_rejects_another_max_len(tmp_path: Path) -> None:
    make_cifar(tmp_path)
    with pytest.raises(UserError, match="data.max_len must be 0 or 1024"):
        get_task("image").load(cfg(tmp_path, 256))


def test_image_missing_data_and_status(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        get_task("image").load(cfg(tmp_path))
    for part in (str(tmp_path / "cifar-10-batches-py"), str(tmp_path / "cifar-10-python.tar.gz"), "HF_DATASETS_OFFLINE"):
        assert part in str(err.value)
    assert not get_task("image").status(str(tmp_path)).present
    make_cifar(tmp_path, archive=True)
    status = get_task("image").status(str(tmp_path))
    assert status.present and status.split_sizes == {"train": 45, "val": 5, "test": 10}
