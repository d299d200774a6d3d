"""Pathfinder-32 / Path-X: the generator's labels, markers and seeding; the reader on official-layout fixtures."""
from __future__ import annotations

import math
import shutil
from collections import deque
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
from PIL import Image

from lra.config import DataConfig
from lra.errors import UserError
from lra.tasks import get_task
from lra.tasks import pathfinder_draw as draw
from lra.tasks import pathfinder_gen as gen
from lra.tasks import pathfinder_write as write

LEVEL = "curv_contour_length_14"


def hops_from(pixels: np.ndarray, start: Tuple[int, int], hop: int) -> np.ndarray:
    """Flood fill over ``pixels`` from ``start``, steps of up to ``hop`` cells: steps to each cell, -1 if unreached."""
    h, w = pixels.shape
    steps = np.full(pixels.shape, -1)
    steps[start] = 0
    queue = deque([start])
    while queue:
        y, x = queue.popleft()
        for v in range(max(0, y - hop), min(h, y + hop + 1)):
            for u in range(max(0, x - hop), min(w, x + hop + 1)):
                if pixels[v, u] and steps[v, u] < 0:
                    steps[v, u] = steps[y, x] + 1
                    queue.append((v, u))
    return steps


@pytest.mark.parametrize("window, count", [(32, 24), (128, 6)], ids=["pathfinder32", "pathx"])
def test_markers_end_one_contour_for_label_1_and_two_for_label_0(window: int, count: int) -> None:
    p = draw.lra_params(window, "curv_baseline")
    labels = []
    for i in range(count):
        s = gen.render_sample(write.image_seed(5, p, 0, i), p)
        origin, terminal = s.markers
        own, other = s.marker_contours
        labels.append(s.label)
        # both markers are drawn, as bright as the brightest paddles
        assert s.image[origin] >= 128 and s.image[terminal] >= 128
        assert (own == other) == (s.label == 1)
        # a dotted contour: paddles are 2 * margin apart, so a path may step that far plus one cell
        drawn = s.targets >= 0.1 * s.targets.max()  # [2, H, W]
        assert drawn[own][origin] and drawn[other][terminal]
        steps = hops_from(drawn[own], origin, hop=2 * s.margin + 1)
        assert (steps[terminal] >= 0) == (s.label == 1)
        if s.label == 1:
            # the terminal marker ends the contour: no drawn pixel of it lies further along
            assert steps[terminal] >= steps.max() - 1
    assert 0 < sum(labels) < len(labels)


def test_candidate_dilation_matches_full_dilation() -> None:
    rng = np.random.default_rng(0)
    image = rng.random((32, 32)) * (rng.random((32, 32)) < 0.2)
    cells = rng.integers(0, 32, size=(50, 2))
    for radius in (1, 2, 3):
        offsets = np.asarray(draw.kernel_offsets(draw.disc(radius)))
        full = draw.dilate(image, offsets)
        np.testing.assert_array_equal(draw.dilated_at(image, cells, offsets), full[cells[:, 0], cells[:, 1]])
        # dilation by a disc: the maximum over the disc around each cell
        y, x = 10, 0
        ys, xs = np.ogrid[:32, :32]
        assert full[y, x] == image[(ys - y) ** 2 + (xs - x) ** 2 <= radius**2].max()


def test_paddle_is_a_line_of_paddle_length_from_its_start() -> None:
    p = draw.lra_params(128, LEVEL)
    # pointing right (angle 0) from (60, 60): lit along row 60 from column 60 to 60 + paddle_length
    pad = draw.paddle((128, 128), (60, 60), 0.0, p, margin=2, contrast=0.9)
    image = np.zeros((128, 128))
    pad.paint(image)
    row = image[60]
    assert row[60 : 60 + p.paddle_length + 1].min() > 0.5 and row[:57].max() == 0 and row[68:].max() == 0
    assert image.max() <= 0.9 + 1e-9


class FixedAngle:
    """A stand-in random generator whose integers() always draws ``value``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def integers(self, *args: int) -> int:
        return self.value


def test_seeds_fail_where_the_originals_cv2_dilation_leaves_a_cell_without_taps() -> None:
    p = draw.lra_params(32, LEVEL)
    # pointing right, the seed's element lies one row below its anchor: no tap of a bottom-row cell
    # is inside, cv2.dilate writes -DBL_MAX there and the original then finds no free cell at all
    assert draw.seed_offsets(0.0, p, 1) == ((1, 1), (1, 2), (1, 3))
    assert gen.seed_blind(0.0, p, 1)
    assert gen.seed_paddle(FixedAngle(0), np.zeros((32, 32)), p, 1, 2.0) is None
    # with the original under OpenCV, only 30 orientations, -150..-121 degrees, ever seed at 32 px
    seeding = [d for d in range(-180, 180) if not gen.seed_blind(d * math.pi / 180, p, 1)]
    assert seeding == list(range(-150, -120))
    # paddles are float32, as the original's PIL "F" canvases; it decides ties when scaling to 0-255
    pad = draw.paddle((32, 32), (10, 10), 0.0, p, 1, 1.5)
    assert pad.line.dtype == np.float32 and pad.mask.dtype == np.float32


def generated(folder: Path) -> List[bytes]:
    images = [f.read_bytes() for f in sorted((folder / "imgs" / "0").glob("*.png"))]
    return images + [(folder / "metadata" / "0.npy").read_bytes()]


def test_generator_writes_the_official_layout_seeded(tmp_path: Path) -> None:
    p = draw.lra_params(32, "curv_baseline")
    a = write.generate(tmp_path / "a", p, size=40, seed=3, workers=2)
    lines = (a / "metadata" / "0.npy").read_text().splitlines()
    assert len(lines) == 40
    labels = []
    for i, line in enumerate(lines):
        fields = line.split()
        assert fields[:3] == ["imgs/0", f"sample_{i}.png", str(i)]
        labels.append(int(fields[3]))
        with Image.open(a / fields[0] / fields[1]) as img:
            assert img.size == (32, 32) and img.mode == "L"
    assert 12 <= sum(labels) <= 28
    # the same seed gives the same files whatever the number of workers; another seed does not
    assert generated(write.generate(tmp_path / "b", p, size=40, seed=3, workers=1)) == generated(a)
    other = generated(write.generate(tmp_path / "c", p, size=40, seed=4, workers=1))
    assert sum(x != y for x, y in zip(other, generated(a))) > 35


def test_generator_refuses_to_mix_sets(tmp_path: Path) -> None:
    p = draw.lra_params(32, "curv_baseline")
    write.generate(tmp_path, p, size=4, seed=0)
    done = (tmp_path / "metadata" / "0.npy").stat().st_mtime_ns
    # a rerun with the same settings finds the batch done and leaves it
    write.generate(tmp_path, p, size=4, seed=0)
    assert (tmp_path / "metadata" / "0.npy").stat().st_mtime_ns == done
    with pytest.raises(UserError, match="other settings"):
        write.generate(tmp_path, p, size=4, seed=1)
    (tmp_path / write.MANIFEST).unlink()
    with pytest.raises(UserError, match="not made by this generator"):
        write.generate(tmp_path, p, size=4, seed=0)


def test_a_rerun_removes_what_a_killed_generator_left(tmp_path: Path) -> None:
    p = draw.lra_params(32, "curv_baseline")
    write.generate(tmp_path, p, size=4, seed=0)
    # a kill while metadata/0.npy or generator.json was being written leaves their temporary files
    (tmp_path / "metadata" / "0.npy").unlink()
    (tmp_path / "metadata" / ".0-k1ll3d").write_text("imgs/0 sample_0.png 0 1")
    (tmp_path / f".{write.MANIFEST}.k1ll3d").write_text('{"generator": ')
    write.generate(tmp_path, p, size=4, seed=0)
    assert sorted(p.name for p in (tmp_path / "metadata").iterdir()) == ["0.npy"]
    assert not list(tmp_path.glob(f".{write.MANIFEST}.*"))
    assert len((tmp_path / "metadata" / "0.npy").read_text().splitlines()) == 4


def test_unfinished_generation_is_refused_not_read(tmp_path: Path) -> None:
    """A folder whose generator.json promises more images than its metadata lists is still being
    written (or was interrupted): reading it would train on a fraction of the set."""
    folder = tmp_path / "pathfinder32" / "curv_baseline"
    write.generate(folder, draw.lra_params(32, "curv_baseline"), size=12, seed=0)
    data = DataConfig(data_dir=str(tmp_path), level="curv_baseline")
    assert len(get_task("pathfinder").load(data)["train"]) >= 8
    manifest = folder / write.MANIFEST
    manifest.write_text(manifest.read_text().replace('"size": 12', '"size": 2000'))
    assert write.declared_size(folder) == 2000
    expected = (f"pathfinder: {folder} holds 12 of the 2,000 images its generator.json declares "
                f"(generation still running or interrupted); finish it with `lra-data generate pathfinder32 "
                f"--data-dir {tmp_path} --size 2000 --level curv_baseline`")
    with pytest.raises(UserError) as err:
        get_task("pathfinder").load(data)
    assert str(err.value).startswith(expected)
    status = get_task("pathfinder").status(str(tmp_path))
    assert not status.present and status.missing == (
        f"{folder}: generation unfinished, 12 of 2,000 images; rerun `lra-data generate pathfinder32 "
        f"--data-dir {tmp_path} --size 2000 --level curv_baseline` to finish it")


def write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.astype(np.uint8)).save(path)


def write_fixture(folder: Path, side: int) -> None:
    """22 images whose first pixel is their id (1..22) and label id % 2; two are empty (skipped).

    Image 3 is all zeros, image 8 a zero-byte file. Batch 0 (images 0-10) has text metadata, as
    LRA's release; batch 1 a saved NumPy string array, as some ports write it.
    """
    rows = {0: [], 1: []}
    for i in range(22):
        batch = 0 if i <= 10 else 1
        path = folder / "imgs" / str(batch) / f"sample_{i}.png"
        pixels = np.zeros((side, side))
        if i != 3:
            pixels[0, 0], pixels[side // 2] = i + 1, 200
        write_png(path, pixels)
        if i == 8:
            path.write_bytes(b"")
        rows[batch].append([f"imgs/{batch}", f"sample_{i}.png", str(i), str((i + 1) % 2), "1.0", "14"])
    (folder / "metadata").mkdir(parents=True)
    (folder / "metadata" / "0.npy").write_text("".join(" ".join(r) + "\n" for r in rows[0]))
    np.save(folder / "metadata" / "1.npy", np.array(rows[1]))


@pytest.mark.parametrize(
    "task, layout",
    [
        ("pathfinder", "pathfinder32"),
        ("pathfinder", "lra_release/pathfinder32"),
        ("pathfinder", "pathfinder/pathfinder32"),
        ("pathx", "lra_release/pathfinder128"),
    ],
    ids=["ours", "lra_release", "s4-layout", "pathx"],
)
def test_reader_skips_empty_images_and_splits_80_10_10(tmp_path: Path, task: str, layout: str) -> None:
    t = get_task(task)
    side = 32 if task == "pathfinder" else 128
    assert (t.spec.max_len, t.spec.vocab_size, t.spec.padded, t.spec.num_classes) == (side * side, 256, False, 2)
    write_fixture(tmp_path / layout / LEVEL, side)
    data = DataConfig(data_dir=str(tmp_path))
    splits = t.load(data)
    assert {k: len(v) for k, v in splits.items()} == {"train": 16, "val": 2, "test": 2}
    ids = []
    for split in splits.values():
        assert split.tokens.dtype == np.uint8 and split.tokens.shape[1] == side * side
        assert (np.asarray(split.lengths) == side * side).all()
        ids += list(split.tokens[:, 0])
        # each image keeps its own label through the shuffle
        np.testing.assert_array_equal(split.labels, split.tokens[:, 0] % 2)
    assert sorted(ids) == [i + 1 for i in range(22) if i not in (3, 8)]
    again = t.load(data)
    np.testing.assert_array_equal(again["val"].tokens, splits["val"].tokens)
    status = t.status(str(tmp_path))
    assert status.present and status.split_sizes == {"train": 17, "val": 2, "test": 3}


def test_wrong_image_size_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "pathfinder32" / LEVEL
    write_fixture(folder, 32)
    bad = folder / "imgs" / "1" / "sample_15.png"
    write_png(bad, np.ones((32, 31)))
    with pytest.raises(UserError, match=f"{bad}: image is 31x32, expected 32x32"):
        get_task("pathfinder").load(DataConfig(data_dir=str(tmp_path)))


def test_malformed_metadata_names_file_and_line(tmp_path: Path) -> None:
    folder = tmp_path / "pathfinder32" / LEVEL
    write_fixture(folder, 32)
    meta = folder / "metadata" / "0.npy"
    meta.write_text(meta.read_text() + "imgs/0 sample_99.png 99 yes\n")
    with pytest.raises(UserError, match=f"{meta}:12: expected"):
        get_task("pathfinder").load(DataConfig(data_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "task, folder, command",
    [("pathfinder", "pathfinder32", "pathfinder32"), ("pathx", "pathfinder128", "pathx")],
    ids=["pathfinder", "pathx"],
)
def test_missing_data_names_every_place_and_the_command(tmp_path: Path, task: str, folder: str, command: str) -> None:
    with pytest.raises(UserError) as err:
        get_task(task).load(DataConfig(data_dir=str(tmp_path), level="curv_baseline"))
    message = str(err.value)
    for place in (folder, f"lra_release/{folder}", f"pathfinder/{folder}"):
        assert f"{tmp_path}/{place}/curv_baseline/" in message
    assert f"lra-data generate {command} --data-dir {tmp_path}" in message and "--level curv_baseline" in message
    assert "metadata/<batch>.npy" in message and "imgs/<batch>/sample_<i>.png" in message


def test_bad_level_and_max_len_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="valid: curv_baseline, curv_contour_length_9, curv_contour_length_14"):
        get_task("pathfinder").load(DataConfig(data_dir=str(tmp_path), level="hard"))
    with pytest.raises(UserError, match="data.max_len must be 0 or 16384"):
        get_task("pathx").load(DataConfig(data_dir=str(tmp_path), max_len=1024))


def test_quiet_silences_the_reading_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lra-run --quiet` silences Pathfinder's "reading" progress bar too (on a terminal)."""
    from lra.tasks import pathfinder as reader
    from lra.tasks.base import quiet_bars

    seen: List[object] = []

    def tqdm(items: object, **kwargs: object) -> object:
        seen.append(kwargs["disable"])
        return items

    monkeypatch.setattr(reader, "tqdm", tqdm)
    write_fixture(tmp_path / "pathfinder32" / LEVEL, 32)
    with quiet_bars(True):
        get_task("pathfinder").load(DataConfig(data_dir=str(tmp_path)))
    # not quiet (the token cache removed, so the images are read again): a bar on a terminal only
    shutil.rmtree(tmp_path / ".cache")
    get_task("pathfinder").load(DataConfig(data_dir=str(tmp_path)))
    assert seen == [True, None]


def test_check_lists_every_level_found(tmp_path: Path) -> None:
    for level in ("curv_baseline", "curv_contour_length_9"):
        write_fixture(tmp_path / "pathfinder32" / level, 32)
    status = get_task("pathfinder").status(str(tmp_path))
    assert status.present and status.source == str(tmp_path / "pathfinder32" / "curv_baseline")
    assert [s.source for s in status.also] == [str(tmp_path / "pathfinder32" / "curv_contour_length_9")]
    assert f"no {LEVEL} set (the default level) yet" in status.note
