"""Image (LRA, Tay et al. 2021): CIFAR-10 (Krizhevsky 2009) classified from its grey pixels, one token each.

Sources, in order: ``<data_dir>/cifar-10-batches-py/`` (the extracted archive),
``<data_dir>/cifar-10-python.tar.gz`` (read in place, nothing extracted), else ``uoft-cs/cifar10``
through ``datasets`` when online. Each 32 x 32 RGB image becomes 1,024 grey values, the tokens
(vocabulary 256, uint8); every pixel is real data, so there is no padding mask (lengths all 1,024).
Splits as the official ``train[:90%]`` / ``train[90%:]`` / ``test``: the first 45,000 images of
data_batch_1..5 train, the last 5,000 validate, test_batch (10,000) tests.
"""
from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO, Dict, Optional, Tuple

import numpy as np

from ..errors import UserError
from .base import DataConfigLike, DataStatus, Source, Split, Task, TaskSpec, cache_key, cached_splits, register_task
from .hub import cache_ready, cached_sizes, load_hub, offline_reason

FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
HUB_NAME = "uoft-cs/cifar10"
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCH = "test_batch"
SIDE = 32
PIXELS = SIDE * SIDE
# part of every cache key: bump it when the conversion changes, so no old cache is served
FORMAT = 1

# "train" (data_batch_1..5 in order) / "test" -> (pixels [n, 3072] uint8: the R, G and B planes,
# each row-major; labels [n] int64)
Images = Dict[str, Tuple[np.ndarray, np.ndarray]]


def _channel_terms() -> np.ndarray:
    """[3, 256] float32: what each byte value of R, G and B adds to the grey value, as TF computes it."""
    scaled = np.arange(256, dtype=np.float32) * np.float32(1.0 / 255.0)  # convert_image_dtype to float32
    weights = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
    return weights[:, None] * scaled[None, :]


_TERMS = _channel_terms()


def to_grey(red: np.ndarray, green: np.ndarray, blue: np.ndarray) -> np.ndarray:
    """uint8 RGB planes -> uint8 grey, bit-exact with TensorFlow's ``tf.image.rgb_to_grayscale``.

    The rule TF applies to uint8 input (image_ops_impl.py), all in float32:
      x = uint8 * (1 / 255)                         (convert_image_dtype to float32)
      g = (0.2989 * r + 0.5870 * g) + 0.1140 * b   (tensordot with the weights, summed in this order)
      grey = uint8(trunc(g * 255.5))                (convert_image_dtype back: scale by max + 0.5, cast)
    The per-channel products are looked up in a [3, 256] table (the same float32 values, computed once).
    Checked against tensorflow-cpu 2.21 on all 2^24 RGB triples: identical. Summing in float64 or in
    another order differs on a few hundred triples, e.g. (0, 122, 186) -> 93 here, 92 in float64.
    """
    grey = (_TERMS[0][red] + _TERMS[1][green]) + _TERMS[2][blue]
    return (grey * np.float32(255.5)).astype(np.uint8)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR batches (a dict of bytes, lists and numpy arrays) and nothing else: no code runs."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # how Python 3 writes bytes at pickle protocol 2
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_batch(f: IO[bytes], where: str) -> Tuple[np.ndarray, np.ndarray]:
    """One pickled CIFAR-10 batch -> pixels [n, 3072] uint8 and labels [n] int64, checked."""
    try:
        batch = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as err:  # any unpickling failure means: not a CIFAR-10 batch
        raise UserError(f"image: cannot read {where} as a CIFAR-10 python batch ({err}); get {ARCHIVE} from {URL}")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise UserError(f"image: {where} is not a CIFAR-10 python batch (it needs the keys b'data' and b'labels')")
    pixels = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if pixels.ndim != 2 or pixels.shape[1] != 3 * PIXELS:
        raise UserError(
            f"image: {where} holds images of shape {tuple(pixels.shape[1:])}; CIFAR-10 images are "
            f"{3 * PIXELS} bytes (3 x {SIDE} x {SIDE})"
        )
    if pixels.dtype != np.uint8:
        raise UserError(f"image: {where} holds {pixels.dtype} pixels; CIFAR-10 pixels are uint8")
    if len(labels) != len(pixels):
        raise UserError(f"image: {where} has {len(pixels)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise UserError(f"image: {where} has labels outside 0-9 (found {labels.min()} to {labels.max()})")
    return pixels, labels


def find_source(data_dir: str) -> Optional[Source]:
    """The user's CIFAR-10 files, or None. A folder that lacks a batch is an error naming it."""
    folder = Path(data_dir) / FOLDER
    if folder.is_dir():
        names = TRAIN_BATCHES + [TEST_BATCH]
        lacking = [name for name in names if not (folder / name).is_file()]
        if lacking:
            raise UserError(f"image: {folder} lacks {', '.join(lacking)}; extract {ARCHIVE} (from {URL}) again")
        return Source("folder", folder, [folder / name for name in names])
    archive = Path(data_dir) / ARCHIVE
    if archive.is_file():
        return Source("archive", archive, [archive])
    return None


def read_source(source: Source) -> Images:
    batches = {}
    if source.kind == "folder":
        for path in source.files:
            with open(path, "rb") as f:
                batches[path.name] = read_batch(f, str(path))
        return join_batches(batches)
    wanted = set(TRAIN_BATCHES + [TEST_BATCH])
    try:
        with tarfile.open(source.path, "r|gz") as tar:
            for member in tar:
                name = PurePosixPath(member.name)
                if member.isfile() and name.parent.name == FOLDER and name.name in wanted:
                    data = io.BytesIO(tar.extractfile(member).read())
                    batches[name.name] = read_batch(data, f"{source.path}:{member.name}")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise UserError(f"image: cannot read {source.path} ({err}); download {ARCHIVE} again from {URL}")
    lacking = sorted(wanted - set(batches))
    if lacking:
        missing = ", ".join(f"{FOLDER}/{name}" for name in lacking)
        raise UserError(f"image: {source.path} lacks {missing}; is it {ARCHIVE} from {URL}?")
    return join_batches(batches)


def join_batches(batches: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> Images:
    pixels = np.concatenate([batches[name][0] for name in TRAIN_BATCHES])  # [50000, 3072]
    labels = np.concatenate([batches[name][1] for name in TRAIN_BATCHES])  # [50000]
    return {"train": (pixels, labels), "test": batches[TEST_BATCH]}


def read_hub(data_dir: str) -> Images:
    dataset = load_hub("image", HUB_NAME, instead=f"download {ARCHIVE} from {URL} and put it in {data_dir}/")
    images = {}
    for part in ("train", "test"):
        rows = dataset[part]
        rgb = np.stack([np.asarray(img.convert("RGB")) for img in rows["img"]])  # [n, 32, 32, 3]
        # to the pickled batches' layout: R, G and B planes, each row-major
        pixels = rgb.transpose(0, 3, 1, 2).reshape(len(rgb), 3 * PIXELS)  # [n, 3072]
        images[part] = (np.ascontiguousarray(pixels), np.asarray(rows["label"], dtype=np.int64))
    return images


def to_split(pixels: np.ndarray, labels: np.ndarray) -> Split:
    planes = pixels.reshape(len(pixels), 3, PIXELS)  # [n, 3, 1024]
    tokens = to_grey(planes[:, 0], planes[:, 1], planes[:, 2])  # [n, 1024] uint8
    lengths = np.full(len(tokens), PIXELS, dtype=np.int32)
    return Split(tokens, lengths, labels)


def train_cut(n: int) -> int:
    """Images of the training data that train; the rest (the last 10%) validate: 50,000 -> 45,000."""
    return n * 9 // 10


def to_splits(images: Images) -> Dict[str, Split]:
    pixels, labels = images["train"]
    cut = train_cut(len(pixels))
    return {
        "train": to_split(pixels[:cut], labels[:cut]),
        "val": to_split(pixels[cut:], labels[cut:]),
        "test": to_split(*images["test"]),
    }


def missing_error(data_dir: str, reason: str) -> UserError:
    return UserError(
        f"image: no CIFAR-10 data found; searched {Path(data_dir) / FOLDER}, {Path(data_dir) / ARCHIVE} and "
        f"{HUB_NAME} via `datasets` ({reason}); download {ARCHIVE} from {URL} and put it in {data_dir}/"
    )


@register_task("image")
class Image(Task):
    spec = TaskSpec(name="image", num_classes=10, vocab_size=256, max_len=PIXELS, padded=False, image_side=32)

    def max_len(self, data: DataConfigLike) -> int:
        if data.max_len not in (0, PIXELS):
            raise UserError(f"image: data.max_len must be 0 or {PIXELS} (32 x 32 pixels), got {data.max_len}")
        return PIXELS

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        self.max_len(data)
        source = find_source(data.data_dir)
        if source is not None:
            key = cache_key(source.files, {"format": FORMAT, "source": source.kind})
            return cached_splits(data.data_dir, "image", key, lambda: to_splits(read_source(source)))
        key = cache_key([], {"format": FORMAT, "source": HUB_NAME})
        if not cache_ready(data.data_dir, "image", key):
            reason = offline_reason()
            if reason:
                raise missing_error(data.data_dir, reason)
        return cached_splits(data.data_dir, "image", key, lambda: to_splits(read_hub(data.data_dir)))

    def status(self, data_dir: str) -> DataStatus:
        try:
            source = find_source(data_dir)
        except UserError as err:
            return DataStatus(task="image", present=False, missing=str(err))
        if source is None:
            sizes = cached_sizes(data_dir, "image", cache_key([], {"format": FORMAT, "source": HUB_NAME}))
            if sizes is not None:
                return DataStatus(task="image", present=True, source=f"{HUB_NAME} (cached)", split_sizes=sizes)
            return DataStatus(
                task="image",
                present=False,
                missing=f"{ARCHIVE} (or its extracted {FOLDER}/ folder) in {data_dir}/, from {URL}; "
                f"or run once online, when `datasets` fetches {HUB_NAME}",
            )
        try:
            images = read_source(source)
        except UserError as err:
            return DataStatus(task="image", present=False, missing=str(err))
        train = len(images["train"][1])
        sizes = {"train": train_cut(train), "val": train - train_cut(train), "test": len(images["test"][1])}
        return DataStatus(task="image", present=True, source=str(source.path), split_sizes=sizes)
