"""Retrieval (LRA, Tay et al. 2021): do two ACL Anthology Network papers (Radev et al. 2013) cite each other?

Reads the official ``new_aan_pairs.{train,eval,test}.tsv`` of ``lra_release/tsv_data/``: no header,
tab separated, columns label (written as a float, ``1.0``), id1, id2, text1, text2; 147,086 /
18,090 / 17,437 rows. Like the official pipeline (``make_csv_dataset`` with ``use_quote_delim=False``
and tfds' ``ByteTextEncoder``) each text field is taken as its raw bytes, quotes and all, and byte b
becomes id b + 1 (pad 0), cut or padded to 4,000. Each example is a pair: tokens [n, 2, L] and
lengths [n, 2], which the model's dual head encodes separately and combines.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ..errors import UserError
from .base import (
    SPLITS,
    DataConfigLike,
    DataStatus,
    Split,
    Task,
    TaskSpec,
    cache_key,
    cached_splits,
    register_task,
)
from .bytes import BYTE_VOCAB, TOKEN_DTYPE, check_length, fill_row

FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}
URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
# part of every cache key: bump it when the tokenization changes, so no old cache is served
FORMAT = 1
_COLUMNS = "label, id1, id2, text1, text2"


def places(data_dir: str) -> List[Path]:
    """Folders searched, in order: the release layout (extracted here or one level down), S4's aan/, data_dir."""
    root = Path(data_dir)
    return [
        root / "tsv_data",
        root / "lra_release" / "tsv_data",
        root / "lra_release" / "lra_release" / "tsv_data",
        # S4 (state-spaces/s4, src/dataloaders/lra.py) keeps the same file names in data/aan/
        root / "aan",
        root,
    ]


def find_files(data_dir: str) -> Optional[Dict[str, Path]]:
    """The three split files from the first folder holding any of them; a partial set is an error."""
    for folder in places(data_dir):
        found = {split: folder / name for split, name in FILES.items() if (folder / name).is_file()}
        if len(found) == len(FILES):
            return found
        if found:
            lacking = [name for split, name in FILES.items() if split not in found]
            raise UserError(f"retrieval: {folder} lacks {', '.join(lacking)}; copy all of lra_release/tsv_data there")
    return None


def count_rows(path: Path) -> int:
    """Lines in the file (a last line without a newline counts), without parsing them."""
    rows, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            rows += chunk.count(b"\n")
            last = chunk[-1:]
    return rows + (last != b"\n")


def parse_label(raw: bytes, where: str) -> int:
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{where}: label {raw[:20].decode('utf-8', 'replace')!r} is not a number; expected 0.0 or 1.0")
    if value not in (0.0, 1.0):
        raise UserError(f"{where}: label {value:g} is not 0 or 1")
    return int(value)


def read_pairs(path: Path, length: int) -> Split:
    """One official TSV file -> tokens [n, 2, L], lengths [n, 2], labels [n]. A bad row names file and line."""
    capacity = count_rows(path)
    tokens = np.zeros((capacity, 2, length), dtype=TOKEN_DTYPE)  # [n, 2, L]
    lengths = np.zeros((capacity, 2), dtype=np.int32)  # [n, 2]
    labels = np.zeros(capacity, dtype=np.int64)  # [n]
    n = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            fields = line.split(b"\t")
            where = f"{path}:{line_no}"
            if len(fields) != 5:
                raise UserError(f"{where}: expected 5 tab-separated columns ({_COLUMNS}), found {len(fields)}")
            labels[n] = parse_label(fields[0], where)
            lengths[n, 0] = fill_row(tokens[n, 0], fields[3])
            lengths[n, 1] = fill_row(tokens[n, 1], fields[4])
            n += 1
    if n == 0:
        raise UserError(f"{path}: no rows; expected the official file of {_COLUMNS} rows")
    return Split(tokens[:n], lengths[:n], labels[:n])


def missing_error(data_dir: str) -> UserError:
    searched = ", ".join(str(p) for p in places(data_dir))
    return UserError(
        f"retrieval: no AAN data found; searched {searched} for {', '.join(FILES.values())}; "
        f"download lra_release.gz from {URL}, extract it (tar xzf) and put its tsv_data/ folder in {data_dir}/"
    )


@register_task("retrieval")
class Retrieval(Task):
    spec = TaskSpec(name="retrieval", num_classes=2, vocab_size=BYTE_VOCAB, max_len=4000, dual=True)

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        length = check_length("retrieval", self.max_len(data))
        files = find_files(data.data_dir)
        if files is None:
            raise missing_error(data.data_dir)
        key = cache_key(list(files.values()), {"format": FORMAT, "max_len": length})
        return cached_splits(
            data.data_dir, "retrieval", key, lambda: {s: read_pairs(files[s], length) for s in SPLITS}
        )

    def status(self, data_dir: str) -> DataStatus:
        try:
            files = find_files(data_dir)
        except UserError as err:
            return DataStatus(task="retrieval", present=False, missing=str(err))
        if files is None:
            folders = ", ".join(f"{p}/" for p in places(data_dir))
            return DataStatus(
                task="retrieval",
                present=False,
                missing=f"{', '.join(FILES.values())} in one of {folders}; they are lra_release/tsv_data/ of {URL}",
            )
        sizes = {s: count_rows(files[s]) for s in SPLITS}
        return DataStatus(task="retrieval", present=True, source=str(files["train"].parent), split_sizes=sizes)
