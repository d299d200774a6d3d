"""Pathfinder-32 and Path-X (Linsley et al. 2018, as in LRA): are the two markers joined by one contour?

Each example is a grayscale image read as a sequence of pixel intensities (1,024 tokens at 32x32,
16,384 for Path-X at 128x128; vocabulary 256, no padding). Images come in the official layout
``<level>/metadata/<batch>.npy`` (lines ``imgs/<batch> sample_<i>.png <i> <label> ...``) and
``<level>/imgs/<batch>/sample_<i>.png``, from our generator (``pathfinder_gen.py``, written to disk by
``pathfinder_write.py``) or the official ``lra_release`` folder; metadata saved as a NumPy string array is read too. Empty images are skipped,
as the PyTorch re-runs did, and the rest split 80/10/10 after a fixed shuffle.

Data is never generated silently (200,000 images take hours); ``lra-data generate`` writes it.
"""
from __future__ import annotations

import io
from multiprocessing import Pool
from pathlib import Path
from typing import ClassVar, Dict, List, Optional, Tuple

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from ..errors import UserError
from . import pathfinder_draw, pathfinder_write
from .base import (
    DataConfigLike,
    DataStatus,
    Split,
    Task,
    TaskSpec,
    bars_off,
    cache_key,
    cached_splits,
    register_task,
    search_dirs,
)

LEVELS = tuple(pathfinder_draw.LEVELS)
DEFAULT_LEVEL = "curv_contour_length_14"
# images per level in LRA's release
FULL_SIZE = 200_000
NPY_MAGIC = b"\x93NUMPY"

# (metadata file, line number, image path, label)
Entry = Tuple[Path, int, Path, int]


def split_bounds(n: int) -> Tuple[int, int]:
    """Where train ends and test begins: 80/10/10 as int(0.8 n), int(0.9 n)."""
    return int(n * 0.8), int(n * 0.9)


def metadata_rows(path: Path) -> List[Tuple[int, List[str]]]:
    """(line number, fields) of one metadata file, plain text or a saved NumPy string array."""
    raw = path.read_bytes()
    if raw.startswith(NPY_MAGIC):
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, EOFError, OSError) as err:
            raise UserError(f"{path}: not a readable NumPy array of strings ({err})")
        return [(i + 1, [str(v) for v in np.atleast_1d(row)]) for i, row in enumerate(np.atleast_2d(array))]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(
            f"{path}: neither text nor a NumPy array; expected lines 'imgs/<batch> sample_<i>.png <i> <label> ...'"
        )
    return [(i + 1, line.split()) for i, line in enumerate(text.splitlines()) if line.strip()]


def batch_order(path: Path) -> Tuple[int, int, str]:
    """Numbered batches first, in numeric order (``2.npy`` before ``10.npy``), then any others by name."""
    return (0, int(path.stem), "") if path.stem.isdigit() else (1, 0, path.stem)


def read_metadata(folder: Path) -> List[Entry]:
    """Every example listed under ``folder/metadata``, batches in numeric order."""
    files = sorted((folder / "metadata").glob("*.npy"), key=batch_order)
    entries: List[Entry] = []
    for meta in files:
        for line, fields in metadata_rows(meta):
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise UserError(
                    f"{meta}:{line}: expected 'imgs/<batch> sample_<i>.png <i> <label 0 or 1> ...', "
                    f"got {' '.join(fields)[:80]!r}"
                )
            entries.append((meta, line, folder / fields[0] / fields[1], int(fields[3])))
    return entries


def read_image(args: Tuple[Path, Path, int, int]) -> Optional[np.ndarray]:
    """One image as [side * side] uint8 pixels, or None when the file or the image is empty."""
    path, meta, line, side = args
    if not path.is_file():
        raise UserError(f"{path}: image listed in {meta}:{line} is missing")
    if path.stat().st_size == 0:
        return None
    try:
        with Image.open(path) as img:
            if img.size != (side, side):
                raise UserError(f"{path}: image is {img.size[0]}x{img.size[1]}, expected {side}x{side}")
            pixels = np.asarray(img.convert("L"), dtype=np.uint8).reshape(-1)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise UserError(f"{path}: not a readable PNG ({err})")
    return pixels if pixels.any() else None


def read_folder(
    folder: Path, entries: List[Entry], side: int, workers: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pixels [n, side * side] uint8, labels [n] int64, keep [n] (False = empty image), in metadata order."""
    jobs = [(path, meta, line, side) for meta, line, path, _ in entries]
    tokens = np.zeros((len(jobs), side * side), dtype=np.uint8)
    keep = np.zeros(len(jobs), dtype=bool)
    pool = Pool(workers) if workers > 1 and len(jobs) > 2000 else None
    try:
        images = pool.imap(read_image, jobs, chunksize=500) if pool else map(read_image, jobs)
        # disable=None: a bar on a terminal only (a log or a pipe gets no progress lines); none under --quiet
        images = tqdm(images, total=len(jobs), desc=f"reading {folder.name}", unit="img", leave=False,
                      disable=True if bars_off() else None)
        for i, pixels in enumerate(images):
            if pixels is not None:
                tokens[i], keep[i] = pixels, True
    finally:
        if pool:
            pool.terminate()
            pool.join()
    labels = np.array([label for *_, label in entries], dtype=np.int64)
    return tokens, labels, keep


def make_splits(tokens: np.ndarray, labels: np.ndarray, keep: np.ndarray) -> Dict[str, Split]:
    """Shuffle the kept rows with a fixed seed, then cut 80/10/10; no padding, every row is full length."""
    kept = np.flatnonzero(keep)
    order = kept[np.random.default_rng(0).permutation(len(kept))]
    train_end, test_start = split_bounds(len(kept))
    parts = {"train": order[:train_end], "val": order[train_end:test_start], "test": order[test_start:]}
    return {
        name: Split(tokens[idx], np.full(len(idx), tokens.shape[1], dtype=np.int32), labels[idx])
        for name, idx in parts.items()
    }


@register_task("pathfinder")
class Pathfinder(Task):
    spec = TaskSpec(name="pathfinder", num_classes=2, vocab_size=256, max_len=1024, dual=False, padded=False, image_side=32, symmetric=True)
    generated = True
    side: ClassVar[int] = 32
    # the name `lra-data generate` knows the task by
    cli_name: ClassVar[str] = "pathfinder32"
    # a size that generates in about a minute on 2 cores ("" where none does)
    quick_size: ClassVar[str] = " (--size 2000 for a quick CPU run)"

    @property
    def folder_name(self) -> str:
        return f"pathfinder{self.side}"

    def level(self, data: DataConfigLike) -> str:
        level = data.level or DEFAULT_LEVEL
        if level not in LEVELS:
            raise UserError(f"unknown {self.spec.name} level {level!r}; valid: {', '.join(LEVELS)}")
        return level

    def places(self, data_dir: str, level: str) -> List[Path]:
        """Where the level's folder may sit: ours, the official release, S4's renamed layout."""
        dirs = search_dirs(data_dir, [self.folder_name]) + [Path(data_dir) / "pathfinder" / self.folder_name]
        return [d / level for d in dirs]

    def find(self, data_dir: str, level: str) -> Optional[Path]:
        for folder in self.places(data_dir, level):
            if any((folder / "metadata").glob("*.npy")):
                return folder
        return None

    def missing_message(self, data_dir: str, level: str) -> str:
        places = ", ".join(f"{p}/" for p in self.places(data_dir, level))
        level_flag = "" if level == DEFAULT_LEVEL else f" --level {level}"
        return (
            f"{self.spec.name}: no {level} images found; searched {places}; put the official "
            f"lra_release/{self.folder_name}/{level}/ there (metadata/<batch>.npy and imgs/<batch>/sample_<i>.png, "
            f"{self.side}x{self.side} grayscale), or generate it with "
            f"`lra-data generate {self.cli_name} --data-dir {data_dir} --size {FULL_SIZE}{level_flag}`{self.quick_size}"
        )

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        level = self.level(data)
        length = self.side * self.side
        if self.max_len(data) != length:
            raise UserError(
                f"{self.spec.name} images are {length} pixel tokens; "
                f"data.max_len must be 0 or {length}, got {data.max_len}"
            )
        folder = self.find(data.data_dir, level)
        if folder is None:
            raise UserError(self.missing_message(data.data_dir, level))
        entries = read_metadata(folder)
        if not entries:
            raise UserError(f"{folder}/metadata lists no images; {self.missing_message(data.data_dir, level)}")
        self.check_finished(folder, level, len(entries), data.data_dir)
        sources = sorted({meta for meta, *_ in entries} | {path.parent for _, _, path, _ in entries})
        settings = {"task": self.spec.name, "level": level, "side": self.side, "split": "rng0-80/10/10-v1"}
        key = cache_key(sources, settings)

        def build() -> Dict[str, Split]:
            tokens, labels, keep = read_folder(folder, entries, self.side, data.workers)
            if keep.sum() < 10:
                raise UserError(f"{folder}: only {keep.sum()} non-empty images; need at least 10 for an 80/10/10 split")
            return make_splits(tokens, labels, keep)

        return cached_splits(data.data_dir, f"{self.spec.name}-{level}", key, build)

    def split_sizes(self, data: DataConfigLike) -> Optional[Dict[str, int]]:
        """The 80/10/10 split of the images the level's metadata lists (the few empty ones the loader
        skips still counted); None when the level is not there (loading then says what is missing)."""
        folder = self.find(data.data_dir, self.level(data))
        if folder is None:
            return None
        n = len(read_metadata(folder))
        train_end, test_start = split_bounds(n)
        return {"train": train_end, "val": test_start - train_end, "test": n - test_start}

    def check_finished(self, folder: Path, level: str, listed: int, data_dir: str) -> None:
        """Refuse a folder of ours whose generation has not finished (still running, or interrupted)."""
        declared = pathfinder_write.declared_size(folder)
        if declared is None or listed >= declared:
            return
        raise UserError(
            f"{self.spec.name}: {folder} holds {listed:,} of the {declared:,} images its "
            f"{pathfinder_write.MANIFEST} declares (generation still running or interrupted); finish it with "
            f"{self.finish_command(data_dir, level, declared)} (finished batches are kept)"
        )

    def finish_command(self, data_dir: str, level: str, size: int) -> str:
        """The lra-data command that completes an unfinished set."""
        level_flag = "" if level == DEFAULT_LEVEL else f" --level {level}"
        return f"`lra-data generate {self.cli_name} --data-dir {data_dir} --size {size}{level_flag}`"

    def generate(self, data: DataConfigLike) -> Path:
        """Write ``data.size`` images (0 = 200,000) of ``data.level`` into ``<data_dir>/pathfinder<side>/<level>/``."""
        level = self.level(data)
        folder = Path(data.data_dir) / self.folder_name / level
        params = pathfinder_draw.lra_params(self.side, level)
        size = data.size or FULL_SIZE
        try:
            return pathfinder_write.generate(folder, params, size=size, seed=data.seed, workers=max(data.workers, 1))
        except OSError as err:
            raise UserError(f"{self.spec.name}: cannot write generated images under {folder}: {err.strerror}")

    def status(self, data_dir: str) -> DataStatus:
        """The default level's data, else the first other level found (the source path names it); the
        other levels found follow in ``also``."""
        found = [(lv, f) for lv, f in ((lv, self.find(data_dir, lv)) for lv in dict.fromkeys((DEFAULT_LEVEL, *LEVELS)))
                 if f is not None]
        if not found:
            return DataStatus(task=self.spec.name, present=False, missing=self.missing_message(data_dir, DEFAULT_LEVEL))
        first = self.level_status(data_dir, *found[0])
        if first.present:
            first.also = [st for st in (self.level_status(data_dir, *lf) for lf in found[1:]) if st.present]
            if found[0][0] != DEFAULT_LEVEL:
                first.note = (f"no {DEFAULT_LEVEL} set (the default level) yet: train on a level found here "
                              f"with --set data.level=LEVEL (e.g. {found[0][0]})")
        return first

    def level_status(self, data_dir: str, level: str, folder: Path) -> DataStatus:
        """One level's folder: its split sizes, or why it cannot be used yet."""
        # counted from the metadata; the few empty images the loader skips are not subtracted
        n = len(read_metadata(folder))
        declared = pathfinder_write.declared_size(folder)
        if declared is not None and n < declared:
            return DataStatus(
                task=self.spec.name, present=False,
                missing=f"{folder}: generation unfinished, {n:,} of {declared:,} images; rerun "
                f"{self.finish_command(data_dir, level, declared)} to finish it",
            )
        train_end, test_start = split_bounds(n)
        sizes = {"train": train_end, "val": test_start - train_end, "test": n - test_start}
        return DataStatus(task=self.spec.name, present=True, source=str(folder), split_sizes=sizes)


@register_task("pathx")
class PathX(Pathfinder):
    spec = TaskSpec(name="pathx", num_classes=2, vocab_size=256, max_len=16384, dual=False, padded=False, image_side=128, symmetric=True)
    side: ClassVar[int] = 128
    cli_name: ClassVar[str] = "pathx"
    # about a Path-X image a second per core
    quick_size: ClassVar[str] = " (about 55 core-hours; use --workers)"
