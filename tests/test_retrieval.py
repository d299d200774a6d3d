"""Retrieval (AAN, byte level): the loader on tiny new_aan_pairs.*.tsv fixtures in every layout."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from conftest import cfg, fail_if_called
from lra.errors import UserError
from lra.tasks import get_task
from lra.tasks import retrieval as retrieval_task


AAN_ROWS = {
    "train": [b"1.0\tp1\tp2\tab\tcaf\xc3\xa9", b"0.0\tp3\tp4\tx\t\"q\""],
    "val": [b"0.0\tp5\tp6\tlong text\ty"],
    "test": [b"1.0\tp7\tp8\tz\tw", b"1\tp9\tp0\tu\tv"],
}


def make_aan(folder: Path, rows: Dict[str, List[bytes]] = AAN_ROWS) -> Dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, name in retrieval_task.FILES.items():
        paths[split] = folder / name
        paths[split].write_bytes(b"".join(row + b"\n" for row in rows[split]))
    return paths


@pytest.mark.parametrize(
    "layout", ["tsv_data", "lra_release/tsv_data", "lra_release/lra_release/tsv_data", "aan", "."]
)
def test_retrieval_pairs_in_every_layout(tmp_path: Path, layout: str) -> None:
    make_aan(tmp_path / layout)
    task = get_task("retrieval")
    splits = task.load(cfg(tmp_path, 6))
    assert task.spec.dual and task.spec.vocab_size == 257 and task.spec.max_len == 4000
    train = splits["train"]
    assert [len(splits[s]) for s in ("train", "val", "test")] == [2, 1, 2]
    assert train.tokens.shape == (2, 2, 6) and train.lengths.shape == (2, 2)
    assert train.labels.tolist() == [1, 0] and splits["test"].labels.tolist() == [1, 1]
    assert train.tokens[0, 0].tolist() == [98, 99, 0, 0, 0, 0]
    assert train.tokens[0, 1].tolist() == [100, 98, 103, 0xC3 + 1, 0xA9 + 1, 0]
    # quotes are data, as in the official reader (use_quote_delim=False)
    assert train.tokens[1, 1, :3].tolist() == [35, 114, 35]
    assert train.lengths.tolist() == [[2, 5], [1, 3]]
    # "long text" is cut at max_len
    assert splits["val"].lengths.tolist() == [[6, 1]]


@pytest.mark.parametrize(
    "row, problem",
    [(b"1.0\tp1\tp2\tonly four", "expected 5 tab-separated columns"), (b"yes\tp1\tp2\ta\tb", "is not a number"),
     (b"2.0\tp1\tp2\ta\tb", "is not 0 or 1")],
    ids=["columns", "label-text", "label-range"],
)
def test_retrieval_malformed_row_names_file_and_line(tmp_path: Path, row: bytes, problem: str) -> None:
    rows = dict(AAN_ROWS, train=AAN_ROWS["train"] + [row])
    paths = make_aan(tmp_path / "tsv_data", rows)
    with pytest.raises(UserError) as err:
        get_task("retrieval").load(cfg(tmp_path))
    assert f"{paths['train']}:3" in str(err.value) and problem in str(err.value)


def test_retrieval_cache_is_reused_then_rebuilt_when_a_file_or_max_len_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = make_aan(tmp_path / "tsv_data")
    task = get_task("retrieval")
    assert len(task.load(cfg(tmp_path, 8))["train"]) == 2
    with monkeypatch.context() as m:
        m.setattr(retrieval_task, "read_pairs", fail_if_called)
        assert len(task.load(cfg(tmp_path, 8))["train"]) == 2
    with open(paths["train"], "ab") as f:
        f.write(b"0.0\tp1\tp3\tm\tn\n")
    assert len(task.load(cfg(tmp_path, 8))["train"]) == 3
    assert task.load(cfg(tmp_path, 4))["train"].tokens.shape == (3, 2, 4)


def test_retrieval_partial_set_and_missing_data_are_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        get_task("retrieval").load(cfg(tmp_path))
    for place in retrieval_task.places(str(tmp_path)):
        assert str(place) in str(err.value)
    assert "new_aan_pairs.eval.tsv" in str(err.value) and "lra_release.gz" in str(err.value)
    paths = make_aan(tmp_path / "aan")
    paths["val"].unlink()
    with pytest.raises(UserError, match="lacks new_aan_pairs.eval.tsv"):
        get_task("retrieval").load(cfg(tmp_path))


def test_retrieval_status_counts_rows(tmp_path: Path) -> None:
    assert not get_task("retrieval").status(str(tmp_path)).present
    make_aan(tmp_path / "lra_release" / "tsv_data")
    status = get_task("retrieval").status(str(tmp_path))
    assert status.present and status.split_sizes == {"train": 2, "val": 1, "test": 2}
