"""The interface every LRA task implements, and the token-array cache they share.

A task turns files in the official formats into three splits of token arrays:

    task = get_task("listops")
    splits = task.load(data_cfg)            # {"train": Split, "val": Split, "test": Split}
    splits["train"].tokens                  # [n, L] int (dual tasks: [n, 2, L])
    splits["train"].lengths                 # [n] real tokens per row (dual: [n, 2])
    splits["train"].labels                  # [n] int64 (token-level tasks: [n, L], IGNORE = -100 where unasked)

The padding mask is ``position < length``; it is never derived from token ids (pixel 0 is data).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import numpy as np

from ..errors import UserError
from ..files import WriteError, plain_mode
from ..files import FolderLock

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
    # one label per position (labels [n, L], IGNORE where nothing is asked): the model keeps every
    # position's features and the loss and accuracy are taken over the labelled positions only
    token_level: bool = False


# the label of a position a token-level task asks nothing about (torch's cross_entropy ignore_index)
IGNORE = -100


@dataclass
class Split:
    tokens: np.ndarray  # [n, L] or [n, 2, L]
    lengths: np.ndarray  # [n] or [n, 2]
    labels: np.ndarray  # [n], or [n, L] for a token-level task

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
    # further sets of the task found in the folder (other sizes, seeds or levels), each present
    also: List["DataStatus"] = field(default_factory=list)
    # a line printed under the sets, e.g. that the set a preset needs is not there yet
    note: str = ""


class Task:
    """Base class of a task: a spec, a loader and a data check."""

    spec: ClassVar[TaskSpec]
    # synthetic tasks are generated offline when their files are missing
    generated: ClassVar[bool] = False

    def load(self, data: "DataConfigLike") -> Dict[str, Split]:
        raise NotImplementedError

    def status(self, data_dir: str) -> DataStatus:
        raise NotImplementedError

    def unavailable(self, data: "DataConfigLike") -> str:
        """Why this data config's files cannot be had (missing, and not to be generated), when that is
        known without reading them: a run refuses at once, before the seconds its estimate takes. ""
        when they can be had, or when only loading them tells."""
        return ""

    def spec_for(self, data: "DataConfigLike") -> TaskSpec:
        """The spec under this data config (a task whose vocabulary or length follows ``data`` overrides it)."""
        return self.spec

    def max_len(self, data: "DataConfigLike") -> int:
        """The sequence length this data config gives (data.max_len, 0 = the task's default)."""
        return data.max_len or self.spec.max_len

    def split_sizes(self, data: "DataConfigLike") -> Optional[Dict[str, int]]:
        """The rows of each split under this data config where they are known without reading the data
        (a run's cost is estimated before its data are read or generated); None: only the files tell."""
        return None

    def example_rows(self, data: "DataConfigLike", n: int, seed: int = 0) -> Split:
        """``n`` made-up rows of this task's shape, as ``load`` gives them (tokens, lengths, labels), made
        without reading or generating any data: a run checks its backend and times its steps on them
        before the data are read. Padded tasks' rows are as long as ``example_lengths`` says."""
        spec, length = self.spec_for(data), self.max_len(data)
        rng = np.random.default_rng(seed)
        shape = (n, 2, length) if spec.dual else (n, length)
        tokens = rng.integers(1, max(spec.vocab_size, 2), size=shape)  # [n, L] or [n, 2, L]
        lengths = np.full(shape[:-1], length)
        if spec.padded:
            lengths = self.example_lengths(data, shape[:-1], rng)
            tokens[np.arange(length) >= lengths[..., None]] = 0
        if spec.token_level:
            # about half the positions asked, the first one always
            asked = rng.random((n, length)) < 0.5
            asked[:, 0] = True
            labels = np.where(asked, rng.integers(0, spec.num_classes, size=(n, length)), IGNORE)  # [n, L]
        else:
            labels = rng.integers(0, spec.num_classes, size=n)  # [n]
        return Split(tokens, lengths, labels)

    def example_lengths(self, data: "DataConfigLike", shape: Tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """The lengths of made-up rows of a padded task: half to all of ``max_len``. A task that knows
        its rows' lengths without its data says so: whether a batch holds padding decides whether the
        model passes a mask (a batch of whole rows takes the backends' unmasked paths)."""
        length = self.max_len(data)
        return rng.integers(max(1, length // 2), length + 1, size=shape)

    def levels(self, data: "DataConfigLike") -> Dict[str, Any]:
        """The data settings that make runs of this task different experiments, by data field name
        (lra-table keeps the latest record per backend, preset, seed and these values, and gives
        each its own cell); none by default: every run of the task is the same experiment."""
        return {}

    def run_tag(self, data: "DataConfigLike") -> str:
        """What a run folder's name carries after the task's name to tell its level from the others
        (``mqar-L128-p32_full_cpu_seed0``); "" by default: a task of one level is named by itself."""
        return ""


class DataConfigLike:  # the fields of lra.config.DataConfig that loaders read (for type hints)
    data_dir: str
    max_len: int
    size: int
    level: str
    pairs: int
    vocab: int
    seed: int
    workers: int
    generate: bool


# progress bars of data generation and reading: shown on a terminal, off under `lra-run --quiet`
_QUIET = [False]


@contextlib.contextmanager
def quiet_bars(quiet: bool) -> Iterator[None]:
    """Within the block, ``bars_off()`` is True when ``quiet`` is."""
    before, _QUIET[0] = _QUIET[0], quiet
    try:
        yield
    finally:
        _QUIET[0] = before


def bars_off() -> bool:
    return _QUIET[0]


_TASKS: Dict[str, Type[Task]] = {}
_BUILTIN_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx", "mqar")


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


CHECKSUMS = "checksums.json"
PARTS = ("tokens", "lengths", "labels")


def cache_files() -> List[str]:
    return [f"{s}.{part}.npy" for s in SPLITS for part in PARTS]


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def cache_problem(folder: Path) -> str:
    """Why the cache in ``folder`` cannot be trusted, or "" when every file matches its recorded checksum."""
    try:
        sums = json.loads((folder / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"has no {CHECKSUMS} (made by an older version of the suite, or cut short)"
    except (OSError, ValueError) as err:
        return f"has an unreadable {CHECKSUMS} ({type(err).__name__})"
    for name in cache_files():
        if not (folder / name).is_file():
            return f"lacks {name}"
        if not isinstance(sums, dict) or file_digest(folder / name) != sums.get(name):
            return f"holds a {name} that does not match its checksum"
    return ""


def read_cache(folder: Path) -> Dict[str, Split]:
    """The splits of a verified cache, memory-mapped."""
    return {s: Split(*(np.load(folder / f"{s}.{part}.npy", mmap_mode="r") for part in PARTS)) for s in SPLITS}


def store_cache(folder: Path, splits: Dict[str, Split]) -> None:
    """Write ``splits`` and their checksums to a temporary folder, then rename it to ``folder``.

    Under the lock of the cache root, so the temporaries a killed writer left can be removed first."""
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    with FolderLock(root) as lock:
        lock.acquire(wait=True, note="lra: waiting for process {pid}, which is writing to {folder}")
        for leftover in root.glob(".*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder.name}."))
        try:
            tmp.chmod(plain_mode(folder=True))
            for s, split in splits.items():
                for part in PARTS:
                    np.save(tmp / f"{s}.{part}.npy", getattr(split, part))
            (tmp / CHECKSUMS).write_text(json.dumps({name: file_digest(tmp / name) for name in cache_files()}, indent=1))
        except OSError as err:
            # a full disk: no half cache is left (the sources, and an older cache, are untouched)
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteError(folder, err, "no cache was stored; free some space there and run the command again") from None
        if folder.exists():
            # a damaged cache being replaced (or one another process stored meanwhile)
            old = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder.name}.old."))
            os.replace(folder, old / folder.name)
            shutil.rmtree(old)
        os.replace(tmp, folder)


def cached_splits(
    data_dir: str, task: str, key: str, build: Callable[[], Dict[str, Split]]
) -> Dict[str, Split]:
    """Load splits from ``<data_dir>/.cache/<task>-<key>/`` or build them and store them there.

    Arrays are stored as .npy files with their SHA-256 in checksums.json, checked on every load and
    memory-mapped. A cache that fails the check (or cannot be read) is never trained on: it is
    rebuilt from the sources, with a one-line notice on stderr. Writes go to a temporary folder that
    is renamed into place, so a killed run never leaves a half-written cache.
    """
    folder = Path(data_dir) / ".cache" / f"{task}-{key}"
    if folder.is_dir():
        problem = cache_problem(folder)
        if not problem:
            try:
                return read_cache(folder)
            except (OSError, ValueError, EOFError) as err:
                problem = f"cannot be read ({type(err).__name__})"
        print(f"lra: the token cache {folder} {problem}; rebuilding it from the sources", file=sys.stderr)
    splits = build()
    store_cache(folder, splits)
    return splits


def generate_task_data(task: Task, data: DataConfigLike) -> Path:
    """Run a synthetic task's generator; real-data tasks say where to get their files."""
    gen = getattr(task, "generate", None)
    if gen is None:
        raise UserError(f"task {task.spec.name!r} is read from files, not generated; see `lra-data check`")
    return gen(data)
