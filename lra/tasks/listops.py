"""ListOps (Nangia & Bowman 2018, as in LRA): the value 0-9 of a nested MIN/MAX/MED/SUM_MOD expression.

Reads the official ``basic_{train,val,test}.tsv`` files, from our generator (``listops_gen.py``) or
from the official ``lra_release/listops-1000/`` folder, and tokenizes as the fixed official
pipeline does: parentheses dropped, ``]`` a token of its own, split on white space; padded to 2,000.
Missing files of the official size are generated on first use (a few minutes on 2 cores; an
interrupted generation continues where it stopped).
"""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import UserError
from ..format import fmt_duration
from . import listops_gen
from .base import (
    SPLITS,
    DataConfigLike,
    DataStatus,
    Split,
    Task,
    TaskSpec,
    cache_key,
    cached_splits,
    pad_rows,
    register_task,
    search_dirs,
)

# id 0 is padding; FIRST and LAST are in the official generator's (unused) operator list
VOCAB = ["<pad>", *map(str, range(10)), "[MIN", "[MAX", "[MED", "[SM", "[FIRST", "[LAST", "]"]
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}
# the value of an expression: 0-9
NUM_CLASSES = 10
# the folder of a generated set other than the official size and seed 0 (ListOps.folder_name)
GENERATED_SET = re.compile(r"listops_n(\d+)_seed(\d+)")


# the generated files' mean size per row: the official 100,000 rows (seed 0) take 631 MB
BYTES_PER_ROW = 6310
# a set this large is announced, with its size, before it is generated
NOTICE_MB = 50


def tokenize(source: str) -> List[str]:
    """The fixed official tokenizer: drop parentheses, make ``]`` its own token, split on spaces."""
    return source.replace("(", " ").replace(")", " ").replace("]", " ] ").split()


def encode(source: str, where: str) -> List[int]:
    try:
        return [TOKEN_ID[tok] for tok in tokenize(source)]
    except KeyError as err:
        raise UserError(f"{where}: unknown ListOps token {err.args[0]!r}; valid: {' '.join(VOCAB[1:])}")


def read_split(path: Path, max_len: int) -> Split:
    """One official TSV file -> token arrays. A malformed row names the file and line; so does a
    file that is not text."""
    csv.field_size_limit(sys.maxsize)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows, labels = read_rows(csv.reader(f, delimiter="\t"), path)
    except (UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"{path}: not a ListOps TSV file ({type(err).__name__}: {str(err)[:120]}); expected "
                        "the header 'Source<TAB>Target' and '<source><TAB><label 0-9>' rows")
    tokens, lengths = pad_rows(rows, max_len, dtype=np.uint8)
    return Split(tokens, lengths, np.asarray(labels, dtype=np.int64))


def read_rows(reader: Iterator[List[str]], path: Path) -> Tuple[List[List[int]], List[int]]:
    """Token ids and labels (checked to be one of the 10 classes) of every row after the header."""
    rows: List[List[int]] = []
    labels: List[int] = []
    header = next(reader, None)
    if header != ["Source", "Target"]:
        raise UserError(f"{path}:1: expected the header 'Source<TAB>Target', got {header!r:.80}")
    for line, row in enumerate(reader, start=2):
        if len(row) != 2 or not row[1].strip().isdecimal() or int(row[1]) >= NUM_CLASSES:
            raise UserError(f"{path}:{line}: expected '<source><TAB><label 0-9>', got {row!r:.80}")
        rows.append(encode(row[0], f"{path}:{line}"))
        labels.append(int(row[1]))
    return rows, labels


@register_task("listops")
class ListOps(Task):
    spec = TaskSpec(name="listops", num_classes=NUM_CLASSES, vocab_size=len(VOCAB), max_len=2000)
    generated = True

    def folder_name(self, data: DataConfigLike) -> str:
        """Where our generator writes: ``listops`` for the official size and seed 0."""
        if data.size == 0 and data.seed == 0:
            return "listops"
        return f"listops_n{data.size}_seed{data.seed}"

    def example_lengths(self, data: DataConfigLike, shape: Tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """The generator's lengths (more than MIN_LENGTH and fewer than MAX_LENGTH tokens) cut to the
        run's ``max_len`` as its rows are: at 501 tokens or fewer every row is whole, as in the cpu preset."""
        drawn = rng.integers(listops_gen.MIN_LENGTH + 1, listops_gen.MAX_LENGTH, size=shape)
        return np.minimum(drawn, self.max_len(data))

    def unavailable(self, data: DataConfigLike) -> str:
        """The set is missing and generation is off: what to run."""
        if data.generate or self.find(data) is not None:
            return ""
        return (f"listops: no basic_train/val/test.tsv in {data.data_dir}/{self.folder_name(data)} or "
                f"{data.data_dir}/lra_release/listops-1000 (data.generate is off); make them with `lra-data generate "
                f"listops --data-dir {data.data_dir}" + (f" --size {data.size}" if data.size else "")
                + (f" --seed {data.seed}" if data.seed else "") + "`, or drop --set data.generate=false")

    def split_sizes(self, data: DataConfigLike) -> Dict[str, int]:
        """The generator's sizes (those of the official release too, at the official size)."""
        return dict(zip(SPLITS, listops_gen.split_sizes(data.size)))

    def find(self, data: DataConfigLike) -> Optional[Path]:
        names = [self.folder_name(data)]
        if data.size == 0:
            # the official release and S4's renamed layout
            names += ["listops-1000"]
        for folder in search_dirs(data.data_dir, names):
            if all((folder / f).is_file() for f in FILES.values()):
                return folder
        return None

    def generate(self, data: DataConfigLike) -> Path:
        """Generate the set into its folder. A large one says so first, with its size, then what the rest
        will take at the pace of its first shards; an interrupted one continues where it stopped."""
        folder = Path(data.data_dir) / self.folder_name(data)
        rows = sum(listops_gen.split_sizes(data.size))
        size_mb = rows * BYTES_PER_ROW / 1e6
        large = size_mb >= NOTICE_MB
        if large:
            print(f"lra: generating ListOps ({rows:,} rows, about {size_mb:,.0f} MB) into {folder}, once (later runs "
                  "read it); if stopped, the next run picks up where it left off", file=sys.stderr, flush=True)

        def left(seconds: float, timed: int) -> None:
            if large:
                print(f"lra: ListOps generation: about {fmt_duration(seconds)} left here (at the pace of its first "
                      f"{timed:,} rows)", file=sys.stderr, flush=True)

        try:
            return listops_gen.generate_files(folder, size=data.size, seed=data.seed, workers=max(data.workers, 1),
                                              left=left)
        except KeyboardInterrupt:
            if large:
                print(f"lra: ListOps generation stopped; its finished shards are kept in {folder / listops_gen.PARTS}, "
                      "and the same command continues from them", file=sys.stderr, flush=True)
            raise

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        missing = self.unavailable(data)
        if missing:
            raise UserError(missing)
        folder = self.find(data)
        if folder is None:
            try:
                folder = self.generate(data)
            except OSError as err:
                raise UserError(f"listops: cannot write generated data under {data.data_dir}: {err.strerror}")
        else:
            # a generation killed after writing the set, before removing its shards
            listops_gen.clear_shards(folder)
        max_len = self.max_len(data)
        sources = [folder / FILES[s] for s in SPLITS]
        key = cache_key(sources, {"max_len": max_len, "vocab": VOCAB})
        return cached_splits(
            data.data_dir, "listops", key, lambda: {s: read_split(folder / FILES[s], max_len) for s in SPLITS}
        )

    def generated_sets(self, data_dir: str) -> List[Path]:
        """Our generator's other sets (``listops_n<size>_seed<seed>/``) that hold all three files, by size and seed."""
        found = []
        for parent in (Path(data_dir), Path(data_dir) / "lra_release"):
            for folder in parent.glob("listops_n*_seed*"):
                match = GENERATED_SET.fullmatch(folder.name)
                if match and all((folder / f).is_file() for f in FILES.values()):
                    found.append((int(match.group(1)), int(match.group(2)), folder))
        return [folder for *_, folder in sorted(found)]

    def status(self, data_dir: str) -> DataStatus:
        """The official-size set, then every generated set of another size or seed."""
        from ..config import DataConfig

        official = self.find(DataConfig(data_dir=data_dir))
        found = ([official] if official is not None else []) + self.generated_sets(data_dir)
        if not found:
            return DataStatus(
                task="listops",
                present=False,
                missing=f"basic_train.tsv, basic_val.tsv, basic_test.tsv in {data_dir}/listops/ "
                f"(or lra_release/listops-1000/); lra-run generates them on first use, or "
                f"`lra-data generate listops --data-dir {data_dir}`",
            )
        sets = [DataStatus(task="listops", present=True, source=str(folder),
                           split_sizes={s: _count_rows(folder / FILES[s]) for s in SPLITS}) for folder in found]
        first = sets[0]
        first.also = sets[1:]
        if official is None:
            first.note = ("no set of the official size (preset paper) yet: lra-run generates it on first use "
                          "(a few minutes), or `lra-data generate listops`")
        return first


def _count_rows(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f) - 1
