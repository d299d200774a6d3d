"""ListOps: labels worked by hand, the generator's bounds and deduplication, the tokenizer, the loader."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from lra.config import DataConfig
from lra.errors import UserError
from lra.tasks import get_task
from lra.tasks import listops_gen as gen
from lra.tasks.listops import TOKEN_ID, read_split, tokenize


def evaluate(tokens: list) -> int:
    """Evaluate a token list like ['[MED', '1', ..., ']'] with the generator's operators."""
    stack: list = []
    for tok in tokens:
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            value = gen.apply(op, args)
            if not stack:
                return value
            stack[-1].append(value)
        else:
            stack[-1].append(int(tok))
    raise AssertionError("unbalanced expression")


@pytest.mark.parametrize(
    "source, label",
    [("[MED 1 2 3 4 ]", 2), ("[SM 5 6 7 ]", 8), ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9), ("[MED 3 1 ]", 2), ("[MIN 4 [SM 9 9 ] ]", 4)],
)
def test_labels_by_hand(source: str, label: int) -> None:
    assert evaluate(tokenize(source)) == label


def test_median_truncates_like_numpy() -> None:
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.randint(0, 9) for _ in range(rng.randint(2, 10))]
        assert gen.median(values) == int(np.median(values))


def official_string(tokens: list) -> str:
    """The official to_string of the official left-nested pair tree, rebuilt from tokens."""

    def parse(pos: int) -> tuple:
        tok = tokens[pos]
        if not tok.startswith("["):
            return int(tok), pos + 1
        children, pos = [], pos + 1
        while tokens[pos] != "]":
            child, pos = parse(pos)
            children.append(child)
        tree = (tok, children[0])
        for child in children[1:]:
            tree = (tree, child)
        return (tree, "]"), pos + 1

    def to_string(t: object) -> str:
        if isinstance(t, (str, int)):
            return str(t)
        return "( " + to_string(t[0]) + " " + to_string(t[1]) + " )"

    return to_string(parse(0)[0])


def test_tree_string_is_the_official_parenthesised_form() -> None:
    rng = random.Random(3)
    checked = 0
    while checked < 20:
        count = [0, 10_000]
        source, value = gen.generate_tree(rng, 1, 4, 4, count)
        toks = tokenize(source)
        if len(toks) < 3:
            continue
        checked += 1
        assert source == official_string(toks)
        assert len(toks) == count[0]
        assert evaluate(toks) == value


def test_generator_bounds_labels_and_dedup() -> None:
    rows = gen.generate(60, seed=7, min_length=20, max_length=60)
    sources = [s for s, _ in rows]
    assert len(set(sources)) == len(sources) == 60
    for source, label in rows:
        toks = tokenize(source)
        assert 20 < len(toks) < 60
        assert evaluate(toks) == label


def test_generator_is_seeded_and_independent_of_workers() -> None:
    a = gen.generate(30, seed=1, workers=1, min_length=10, max_length=40)
    b = gen.generate(30, seed=1, workers=2, min_length=10, max_length=40)
    c = gen.generate(30, seed=2, workers=1, min_length=10, max_length=40)
    assert a == b and a != c


def test_official_lengths_are_strictly_between_500_and_2000() -> None:
    rows = gen.generate_chunk((0, 0, 10, 10, 500, 2000))[:40]
    lengths = [len(tokenize(s)) for s, _ in rows]
    assert min(lengths) > 500 and max(lengths) < 2000


@pytest.mark.parametrize("max_len", [256, 512, 2000], ids=["cpu-256", "smoke-512", "paper-2000"])
def test_made_up_rows_are_padded_as_the_generated_ones(max_len: int) -> None:
    """The rows a run's estimate times on (before any data) are whole where every generated row is cut
    to max_len, so the model takes the same unmasked path; longer, they span the generator's lengths."""
    made_up = get_task("listops").example_rows(DataConfig(max_len=max_len), 256).lengths
    generated = [min(len(tokenize(s)), max_len) for s, _ in gen.generate_chunk((0, 0, 10, 10, 500, 2000))[:40]]
    if max_len <= 501:
        assert set(made_up) == set(generated) == {max_len}
    else:
        assert 500 < made_up.min() and made_up.max() <= max_len and 500 < min(generated)
    if max_len == 2000:
        # every generated row is shorter than 2,000 tokens: padded, as every made-up one
        assert made_up.max() < max_len and max(generated) < max_len


def test_tokenizer_drops_parentheses_and_splits_brackets() -> None:
    assert tokenize("( ( [MAX 2 ) 9 ) ] )") == ["[MAX", "2", "9", "]"]
    assert tokenize("[MIN 3 4]") == ["[MIN", "3", "4", "]"]


def write_tsv(path: Path, rows: list) -> None:
    path.write_text("Source\tTarget\n" + "".join(f"{s}\t{t}\n" for s, t in rows))


def test_loader_reads_official_files_and_pads(tmp_path: Path) -> None:
    folder = tmp_path / "lra_release" / "listops-1000"
    folder.mkdir(parents=True)
    rows = [("( ( ( [MAX 2 ) 9 ) ] )", 9), ("( ( ( ( [SM 5 ) 6 ) 7 ) ] )", 8)]
    for split in ("train", "val", "test"):
        write_tsv(folder / f"basic_{split}.tsv", rows)
    splits = get_task("listops").load(DataConfig(data_dir=str(tmp_path), generate=False))
    train = splits["train"]
    assert train.tokens.shape == (2, 2000)
    assert list(train.lengths) == [4, 5]
    assert list(train.labels) == [9, 8]
    expected = [TOKEN_ID[t] for t in ["[MAX", "2", "9", "]"]]
    assert list(train.tokens[0, :4]) == expected and not train.tokens[0, 4:].any()


def test_loader_reports_malformed_rows_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.tsv"
    write_tsv(path, [("[MAX 2 ]", 2), ("[MAX 2 ]", "x")])
    with pytest.raises(UserError, match=r"bad.tsv:3"):
        read_split(path, 10)


def test_missing_files_without_generation_name_the_command(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"`lra-data generate listops --data-dir \S+ --size 300`"):
        get_task("listops").load(DataConfig(data_dir=str(tmp_path), size=300, generate=False))


def test_generated_set_loads_and_caches(tmp_path: Path) -> None:
    data = DataConfig(data_dir=str(tmp_path), size=40, max_len=2000)
    first = get_task("listops").load(data)
    assert [len(first[s]) for s in ("train", "val", "test")] == [40, 32, 32]
    assert (first["train"].lengths > 500).all() and (first["train"].lengths < 2000).all()
    second = get_task("listops").load(data)
    assert isinstance(second["train"].tokens, np.memmap)
    np.testing.assert_array_equal(first["train"].tokens, second["train"].tokens)
