"""Text (LRA, Tay et al. 2021): IMDB movie-review sentiment (Maas et al. 2011), read byte by byte.

Sources, in order: ``<data_dir>/aclImdb/`` (the extracted archive), ``<data_dir>/aclImdb_v1.tar.gz``
(read in place, nothing extracted), else ``stanfordnlp/imdb`` through ``datasets`` when online.
As in tfds' ``imdb_reviews``, which the official pipeline reads, a review is its file's bytes with
surrounding white space stripped; pos = 1, neg = 0; ``train/unsup`` is ignored. Ids are bytes + 1
(pad 0), cut or padded to 4,000 (the paper; the official JAX config used 1,000: set data.max_len).
IMDB has no validation split: the official pipeline validates on the test split, and so does this
one (val and test are the same arrays). Rows are in a fixed shuffled order, not grouped by label.
"""
from __future__ import annotations

import re
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import UserError
from .base import DataConfigLike, DataStatus, Source, Split, Task, TaskSpec, cache_key, cached_splits, register_task
from .bytes import BYTE_VOCAB, byte_rows, check_length
from .hub import cache_ready, cached_sizes, load_hub, offline_reason

FOLDER = "aclImdb"
ARCHIVE = "aclImdb_v1.tar.gz"
URL = "https://ai.stanford.edu/~amaas/data/sentiment/"
HUB_NAME = "stanfordnlp/imdb"
LABELS = {"neg": 0, "pos": 1}
PARTS = ("train", "test")
# part of every cache key: bump it when the tokenization changes, so no old cache is served
FORMAT = 1
# a review inside the archive: aclImdb/<train|test>/<pos|neg>/<id>_<rating>.txt
_MEMBER = re.compile(r"^(?:\./)?aclImdb/(train|test)/(pos|neg)/([^/]+\.txt)$")

# "train" / "test" -> (review bytes, labels)
Reviews = Dict[str, Tuple[List[bytes], List[int]]]


def find_source(data_dir: str) -> Optional[Source]:
    """The user's IMDB files, or None. An aclImdb/ folder without its four label folders is an error."""
    folder = Path(data_dir) / FOLDER
    if folder.is_dir():
        lacking = [f"{part}/{label}" for part in PARTS for label in LABELS if not (folder / part / label).is_dir()]
        if lacking:
            raise UserError(f"text: {folder} lacks {', '.join(lacking)}; extract {ARCHIVE} (from {URL}) again")
        files = sorted(path for part in PARTS for label in LABELS for path in (folder / part / label).glob("*.txt"))
        return Source("folder", folder, files)
    archive = Path(data_dir) / ARCHIVE
    if archive.is_file():
        return Source("archive", archive, [archive])
    return None


def read_folder(files: List[Path]) -> Reviews:
    reviews: Reviews = {part: ([], []) for part in PARTS}
    for path in files:
        texts, labels = reviews[path.parent.parent.name]
        texts.append(path.read_bytes().strip())
        labels.append(LABELS[path.parent.name])
    return reviews


def read_archive(path: Path) -> Reviews:
    """The reviews straight from the .tar.gz, in the folder reader's order (so both give the same arrays)."""
    found = []
    try:
        with tarfile.open(path, "r|gz") as tar:
            for member in tar:
                match = _MEMBER.match(member.name)
                if match and member.isfile():
                    found.append((match[1], match[2], match[3], tar.extractfile(member).read().strip()))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise UserError(f"text: cannot read {path} ({err}); download {ARCHIVE} again from {URL}")
    reviews: Reviews = {part: ([], []) for part in PARTS}
    for part, label, _, text in sorted(found):
        reviews[part][0].append(text)
        reviews[part][1].append(LABELS[label])
    return reviews


def read_hub(data_dir: str) -> Reviews:
    dataset = load_hub("text", HUB_NAME, instead=f"download {ARCHIVE} from {URL} and put it in {data_dir}/")
    reviews: Reviews = {}
    for part in PARTS:
        rows = dataset[part]
        # the hub copy's labels are neg = 0, pos = 1, as here
        reviews[part] = ([text.encode("utf-8").strip() for text in rows["text"]], [int(y) for y in rows["label"]])
    return reviews


def to_splits(reviews: Reviews, length: int, where: str) -> Dict[str, Split]:
    parts = {}
    for part in PARTS:
        texts, labels = reviews[part]
        if not texts:
            raise UserError(f"text: {where} holds no aclImdb/{part}/pos or neg reviews; is it {ARCHIVE} from {URL}?")
        tokens, lengths = byte_rows(texts, length)  # [n, L], [n]
        # a fixed shuffle (as tfds stores imdb_reviews), so the first batches of an evaluation hold both
        # classes instead of all the neg reviews
        order = np.random.default_rng(0).permutation(len(texts))
        parts[part] = Split(tokens[order], lengths[order], np.asarray(labels, dtype=np.int64)[order])
    # IMDB has no validation split: validate on the test split, as the official pipeline does
    return {"train": parts["train"], "val": parts["test"], "test": parts["test"]}


def missing_error(data_dir: str, reason: str) -> UserError:
    return UserError(
        f"text: no IMDB data found; searched {Path(data_dir) / FOLDER}, {Path(data_dir) / ARCHIVE} and "
        f"{HUB_NAME} via `datasets` ({reason}); download {ARCHIVE} from {URL} and put it in {data_dir}/"
    )


@register_task("text")
class Text(Task):
    spec = TaskSpec(name="text", num_classes=2, vocab_size=BYTE_VOCAB, max_len=4000)

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        length = check_length("text", self.max_len(data))
        source = find_source(data.data_dir)
        if source is not None:
            key = cache_key(source.files, {"format": FORMAT, "max_len": length, "source": source.kind})

            def build() -> Dict[str, Split]:
                reviews = read_folder(source.files) if source.kind == "folder" else read_archive(source.path)
                return to_splits(reviews, length, str(source.path))

            return cached_splits(data.data_dir, "text", key, build)
        key = cache_key([], {"format": FORMAT, "max_len": length, "source": HUB_NAME})
        if not cache_ready(data.data_dir, "text", key):
            reason = offline_reason()
            if reason:
                raise missing_error(data.data_dir, reason)
        return cached_splits(data.data_dir, "text", key, lambda: to_splits(read_hub(data.data_dir), length, HUB_NAME))

    def status(self, data_dir: str) -> DataStatus:
        try:
            source = find_source(data_dir)
        except UserError as err:
            return DataStatus(task="text", present=False, missing=str(err))
        if source is None:
            key = cache_key([], {"format": FORMAT, "max_len": self.spec.max_len, "source": HUB_NAME})
            sizes = cached_sizes(data_dir, "text", key)
            if sizes is not None:
                return DataStatus(task="text", present=True, source=f"{HUB_NAME} (cached)", split_sizes=sizes)
            return DataStatus(
                task="text",
                present=False,
                missing=f"{ARCHIVE} (or its extracted {FOLDER}/ folder) in {data_dir}/, from {URL}; "
                f"or run once online, when `datasets` fetches {HUB_NAME}",
            )
        if source.kind == "archive":
            # listing the archive's 100,000 members takes tens of seconds: give the sizes once cached
            key = cache_key(source.files, {"format": FORMAT, "max_len": self.spec.max_len, "source": source.kind})
            sizes = cached_sizes(data_dir, "text", key) or {}
            return DataStatus(task="text", present=True, source=str(source.path), split_sizes=sizes)
        counts = {part: sum(path.parent.parent.name == part for path in source.files) for part in PARTS}
        sizes = {"train": counts["train"], "val": counts["test"], "test": counts["test"]}
        return DataStatus(task="text", present=True, source=str(source.path), split_sizes=sizes)
