"""ListOps generator: a Python 3 port of the official LRA generator (lra_benchmarks/data/listops.py).

A tree is a leaf value 0-9 or an operator (MIN, MAX, MED, SUM_MOD) over 2..max_args sub-trees:
at depth < max_depth a node is an operator with probability 0.25 (else a leaf); at max_depth it is a
leaf. Trees whose token count is strictly between min_length and max_length are kept, duplicates
removed; the label is the value of the expression. Sources are written as the official
``basic_{train,val,test}.tsv`` files (header ``Source<TAB>Target``, parenthesised bracket strings).

Departures that do not change the distribution of kept trees: a tree is abandoned as soon as it
reaches max_length tokens (it would be rejected anyway), and the work is cut into seeded chunks that
``workers`` processes generate in parallel, deduplicated in chunk order (so the output depends on the
seed, not on the number of workers). Each chunk is kept on disk while a set is made, so that an
interrupted generation continues where it stopped (``Shards``).
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import random
import shutil
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from tqdm import tqdm

from ..errors import UserError
from ..files import FolderLock, remove_temporaries, write_atomic, write_atomic_set
from .base import bars_off

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)
VALUE_P = 0.25
# trees a chunk keeps: they depend on (seed, chunk index) alone, and a chunk is the unit kept on disk
CHUNK = 500
# a kept tree has strictly more than MIN_LENGTH and fewer than MAX_LENGTH tokens (the official bounds)
MIN_LENGTH, MAX_LENGTH = 500, 2000
FILES = ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")
# the folder of a generation's finished shards, inside the set's folder
PARTS = ".parts"


class TooLong(Exception):
    """Raised inside generation once a tree reaches max_length tokens (it would be rejected)."""


def median(values: List[int]) -> int:
    """``int(np.median(values))``: an even count truncates the mean of the middle two."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else int((s[mid - 1] + s[mid]) / 2)


def apply(op: str, values: List[int]) -> int:
    if op == MIN:
        return min(values)
    if op == MAX:
        return max(values)
    if op == MED:
        return median(values)
    return sum(values) % 10


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int, count: List[int]) -> Tuple[str, int]:
    """One tree as (official source string, value), drawing from ``rng`` in the official order.

    ``count[0]`` accumulates the tree's token count (op and "]" count one each, as officially);
    generation stops with TooLong once it reaches ``count[1]``. The string follows the official
    to_string of the left-nested pairs: ``[MAX 2 9 ]`` is written ``( ( ( [MAX 2 ) 9 ) ] )``.
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        value = rng.choice(range(10))
        count[0] += 1
        if count[0] >= count[1]:
            raise TooLong
        return str(value), value
    count[0] += 2
    num_values = rng.randint(2, max_args)
    children = [generate_tree(rng, depth + 1, max_depth, max_args, count) for _ in range(num_values)]
    # the official generator picks the operator after its arguments
    op = rng.choice(OPERATORS)
    body = "".join(f" {text} )" for text, _ in children)
    source = "( " * (num_values + 1) + op + body + " ] )"
    return source, apply(op, [value for _, value in children])


def generate_chunk(args: Tuple[int, int, int, int, int, int]) -> List[Tuple[str, int]]:
    """``CHUNK`` kept trees from the stream seeded by (seed, index)."""
    seed, index, max_depth, max_args, min_length, max_length = args
    rng = random.Random(f"listops-{seed}-{index}")
    kept: List[Tuple[str, int]] = []
    while len(kept) < CHUNK:
        count = [0, max_length]
        try:
            source, value = generate_tree(rng, 1, max_depth, max_args, count)
        except TooLong:
            continue
        if count[0] > min_length:
            kept.append((source, value))
    return kept


def generate(
    num_samples: int,
    seed: int = 0,
    workers: int = 1,
    max_depth: int = 10,
    max_args: int = 10,
    min_length: int = MIN_LENGTH,
    max_length: int = MAX_LENGTH,
    shards: Optional["Shards"] = None,
    left: Optional[Callable[[float, int], None]] = None,
) -> List[Tuple[str, int]]:
    """``num_samples`` distinct (source, label) pairs, in a fixed order for a given seed.

    The chunks are taken in order; ``shards``: each finished chunk is kept there and read back instead
    of generated again, so an interrupted generation continues where it stopped, with the same result.
    ``left(seconds, rows)``: called once, after the first chunks generated here, with the time the
    rest should take at that pace and the rows it timed."""
    data: Dict[str, int] = {}
    bar = tqdm(total=num_samples, desc="ListOps", unit="ex", disable=num_samples < 5000 or bars_off())
    index, began, made = 0, time.perf_counter(), 0
    with Pool(workers) if workers > 1 else _Serial() as pool:
        while len(data) < num_samples:
            # enough chunks to keep every worker busy, and no more than the set can still need
            count = min(max(workers * 4, 1), -(-(num_samples - len(data)) // CHUNK))
            chunks = range(index, index + count)
            index += count
            stored = {i: shards.read(i) for i in chunks} if shards is not None else {}
            jobs = [(seed, i, max_depth, max_args, min_length, max_length) for i in chunks if stored.get(i) is None]
            fresh = iter(pool.imap(generate_chunk, jobs))
            for i in chunks:
                trees = stored.get(i)
                if trees is None:
                    trees = next(fresh)
                    made += len(trees)
                    if shards is not None:
                        shards.write(i, trees)
                for source, value in trees:
                    if len(data) < num_samples and source not in data:
                        data[source] = value
                        bar.update(1)
            if made and left is not None:
                left((time.perf_counter() - began) / made * max(0, num_samples - len(data)), made)
                left = None
    bar.close()
    return list(data.items())


class Shards:
    """A generation's finished chunks, ``<folder>/.parts/<i>.tsv.gz``: the kept trees of chunk i (before
    deduplication), one ``source<TAB>label`` line each, gzip-compressed, each file written atomically.
    ``settings.json`` names the generator's settings: shards of other settings are removed, never
    mixed in. Use under the set folder's lock."""

    def __init__(self, folder: Path, settings: Dict[str, int]) -> None:
        self.folder = Path(folder) / PARTS
        settings = {**settings, "chunk": CHUNK}
        manifest = self.folder / "settings.json"
        try:
            same = json.loads(manifest.read_text()) == settings
        except (OSError, ValueError):
            same = False
        if not same:
            self.clear()
            self.folder.mkdir(parents=True)
            write_atomic(manifest, json.dumps(settings).encode())
        # what a killed write left (write_atomic's temporary names start with a dot)
        for leftover in self.folder.glob(".*"):
            leftover.unlink(missing_ok=True)

    def read(self, i: int) -> Optional[List[Tuple[str, int]]]:
        path = self.folder / f"{i}.tsv.gz"
        try:
            text = gzip.decompress(path.read_bytes()).decode()
        except FileNotFoundError:
            return None
        except (OSError, EOFError, UnicodeDecodeError):
            # damaged (not written by this writer, which renames whole files): made again
            return None
        return [(source, int(value)) for source, value in (line.split("\t") for line in text.splitlines())]

    def write(self, i: int, trees: List[Tuple[str, int]]) -> None:
        text = "".join(f"{source}\t{value}\n" for source, value in trees).encode()
        write_atomic(self.folder / f"{i}.tsv.gz", gzip.compress(text, compresslevel=1, mtime=0),
                     "the shards finished so far are kept; free some space there and run the same command again")

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class _Serial:
    """The part of a multiprocessing Pool that ``generate`` uses, in this process."""

    def __enter__(self) -> "_Serial":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def imap(self, fn, jobs):  # type: ignore[no-untyped-def]
        return map(fn, jobs)


def split_sizes(size: int) -> Tuple[int, int, int]:
    """Train / val / test sizes: the official 96,000 / 2,000 / 2,000, or ``size`` train in that ratio."""
    if size <= 0:
        return 96_000, 2_000, 2_000
    held_out = max(size // 48, 32)
    return size, held_out, held_out


def split_text(rows: List[Tuple[str, int]]) -> bytes:
    """One official TSV file (header ``Source<TAB>Target``)."""
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t")
    writer.writerow(["Source", "Target"])
    writer.writerows(rows)
    return text.getvalue().encode()


def generate_files(folder: Path, size: int = 0, seed: int = 0, workers: int = 1,
                   left: Optional[Callable[[float, int], None]] = None) -> Path:
    """Generate and write ``basic_{train,val,test}.tsv`` into ``folder``; return the folder.

    Under the folder's lock: the temporary files of an earlier, killed write are removed first, and
    a process that waited for another one writing the same set keeps that set instead of redoing it.
    Finished shards are kept in ``folder/.parts`` until the set is written: an interrupted generation
    (a kill, Ctrl-C, a full disk) continues from them, and the files are the same bytes as an
    uninterrupted one's. The three files are written together: all of them, or none."""
    folder.mkdir(parents=True, exist_ok=True)
    with FolderLock(folder) as lock:
        waited = lock.acquire(wait=True, note="lra: waiting for process {pid}, which is writing to {folder}")
        remove_temporaries(folder, FILES)
        if waited and all((folder / name).is_file() for name in FILES):
            return folder
        n_train, n_val, n_test = split_sizes(size)
        shards = Shards(folder, {"seed": seed, "version": 1})
        rows = generate(n_train + n_val + n_test, seed=seed, workers=workers, shards=shards, left=left)
        # train last: its presence marks a complete set
        write_atomic_set([
            (folder / "basic_test.tsv", split_text(rows[n_train + n_val :])),
            (folder / "basic_val.tsv", split_text(rows[n_train : n_train + n_val])),
            (folder / "basic_train.tsv", split_text(rows[:n_train])),
        ], "no file of the set was written (the generated shards are kept); free some space there and run the "
           "command again")
        shards.clear()
    return folder


def clear_shards(folder: Path) -> None:
    """Remove a finished set's shards, left by a generation killed between writing the set and removing them."""
    if not (Path(folder) / PARTS).is_dir():
        return
    with FolderLock(Path(folder)) as lock:
        try:
            lock.acquire(wait=False)
        except UserError:
            # another process is writing there: it removes them itself
            return
        if all((Path(folder) / name).is_file() for name in FILES):
            shutil.rmtree(Path(folder) / PARTS, ignore_errors=True)
