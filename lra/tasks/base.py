"""The interface every LRA task implements, and the token-array cache they share.

A task turns files in the official formats into three splits of token arrays:

    task = get_task("listops")
    splits = task.load(data_cfg)            # {"train": Split, "val": Split, "test": Split}
    splits["train"].tokens                  # [n, L] int (dual tasks: [n, 2, L])
    splits["train"].lengths                 # [n] real tokens per row (dual: [n, 2])
    splits["train"].labels                  # [n] int64

The padding mask is ``position < length``; it is never derived from token ids (pixel 0 is data).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Dict, List, Sequence, Type

import numpy as np

from ..errors import UserError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    num_classes: int
    # token ids are in [0, vocab_size); 0 is the pad id for padded tasks
    vocab_size: int
    # default sequence length (data.max_len overrides it where the task allows)
    max_len: int
    # two sequences per example (Retrieval), combined by the model's dual head
    dual: bool = False
    # rows can be shorter than max_len, so the model passes a padding mask
    padded: bool = True
    # images: the side of the square, its pixels in row-major order (0 = not an image)
    image_side: int = 0
    # the label survives the 8 rotations and flips of the image (train.augment=dihedral allowed)
    symmetric: bool = False


@dataclass
class Split:
    tokens: np.ndarray  # [n, L] or [n, 2, L]
    lengths: np.ndarray  # [n] or [n, 2]
    labels: np.ndarray  # [n]

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Source:
    """Where a file-based task found its data."""

    # e.g. "folder" (an extracted release) or "archive" (the downloaded .tar.gz)
    kind: str
    path: Path
    # the files whose size and mtime key the cache
    files: List[Path]


@dataclass
class DataStatus:
    """What ``lra-data check`` prints for one task."""

    task: str
    present: bool
    # where the data was found, or "" when missing
    source: str = ""
    split_sizes: Dict[str, int] = field(default_factory=dict)
    # when missing: the exact files to obtain and where to put them
    missing: str = ""


class Task:
    """Base class of a task: a spec, a loader and a data check."""

    spec: ClassVar[TaskSpec]
    # synthetic tasks are generated offline when their files are missing
    generated: ClassVar[bool] = False

    def load(self, data: "DataConfigLike") -> Dict[str, Split]:
        raise NotImplementedError

    def status(self, data_dir: str) -> DataStatus:
        raise NotImplementedError

    def max_len(self, data: "DataConfigLike") -> int:
        """The sequence length this data config gives (data.max_len, 0 = the task's default)."""
        return data.max_len or self.spec.max_len


class DataConfigLike:  # the fields of lra.config.DataConfig that loaders read (for type hints)
    data_dir: str
    max_len: int
    size: int
    level: str
    seed: int
    workers: int
    generate: bool


_TASKS: Dict[str, Type[Task]] = {}
_BUILTIN_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")


def register_task(name: str) -> Callable[[Type[Task]], Type[Task]]:
    def decorate(cls: Type[Task]) -> Type[Task]:
        if name in _TASKS and _TASKS[name] is not cls:
            raise UserError(f"a task named {name!r} is already registered")
        _TASKS[name] = cls
        return cls

    return decorate


def list_tasks() -> List[str]:
    import importlib

    for module in _BUILTIN_TASKS:
        try:
            importlib.import_module(f"lra.tasks.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"lra.tasks.{module}":
                raise
    return [n for n in _BUILTIN_TASKS if n in _TASKS] + sorted(n for n in _TASKS if n not in _BUILTIN_TASKS)


def get_task(name: str) -> Task:
    known = list_tasks()
    if name not in _TASKS:
        raise UserError(f"unknown task {name!r}; known: {', '.join(known)}")
    return _TASKS[name]()


def search_dirs(data_dir: str, names: Sequence[str]) -> List[Path]:
    """Folders a task's files may sit in: ``data_dir/<name>`` and ``data_dir/lra_release/<name>``."""
    root = Path(data_dir)
    out: List[Path] = []
    for name in names:
        out += [root / name, root / "lra_release" / name]
    return out


def pad_rows(rows: Sequence[Sequence[int]], length: int, dtype: type = np.int16) -> "tuple[np.ndarray, np.ndarray]":
    """Cut or right-pad token lists with 0 to ``length``. Returns tokens [n, L] and lengths [n]."""
    tokens = np.zeros((len(rows), length), dtype=dtype)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for i, row in enumerate(rows):
        row = row[:length]
        tokens[i, : len(row)] = row
        lengths[i] = len(row)
    return tokens, lengths


def cache_key(sources: Sequence[Path], settings: Dict[str, object]) -> str:
    """A key that changes when any source file (path, size, mtime) or tokenizer setting changes."""
    parts: List[object] = [settings]
    for src in sorted(str(s) for s in sources):
        st = os.stat(src)
        parts.append([src, st.st_size, st.st_mtime_ns])
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_splits(
    data_dir: str, task: str, key: str, build: Callable[[], Dict[str, Split]]
) -> Dict[str, Split]:
    """Load splits from ``<data_dir>/.cache/<task>-<key>/`` or build them and store them there.

    Arrays are stored as .npy files and memory-mapped on later loads. Writes go to a temporary
    folder that is renamed into place, so a killed run never leaves a half-written cache.
    """
    folder = Path(data_dir) / ".cache" / f"{task}-{key}"
    if folder.is_dir():
        try:
            return {
                s: Split(*(np.load(folder / f"{s}.{part}.npy", mmap_mode="r") for part in ("tokens", "lengths", "labels")))
                for s in SPLITS
            }
        except (OSError, ValueError) as err:
            raise UserError(f"the cache {folder} is corrupted ({err}); delete that folder and run again")
    splits = build()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{task}-tmp-"))
    for s, split in splits.items():
        for part in ("tokens", "lengths", "labels"):
            np.save(tmp / f"{s}.{part}.npy", getattr(split, part))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process stored the same cache first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return splits


def generate_task_data(task: Task, data: DataConfigLike) -> Path:
    """Run a synthetic task's generator; real-data tasks say where to get their files."""
    gen = getattr(task, "generate", None)
    if gen is None:
        raise UserError(f"task {task.spec.name!r} is read from files, not generated; see `lra-data check`")
    return gen(data)
