"""Image (CIFAR-10, grey): the loader on tiny CIFAR batches, folder and archive."""
from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

from conftest import bump_mtime, cfg, fail_if_called, make_tar
from lra.errors import UserError
from lra.tasks import get_task
from lra.tasks import image as image_task


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
