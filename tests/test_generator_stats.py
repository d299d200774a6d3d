"""scripts/generator_stats.py: statistics of tiny Pathfinder and ListOps fixtures against hand-computed numbers."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from PIL import Image

from conftest import load_script

stats = load_script("generator_stats")

# 2x2 images and labels; hand-computed below
IMAGES = [
    ([[0, 255], [0, 0]], 0),
    ([[100, 200], [0, 50]], 1),
    ([[0, 0], [0, 0]], 1),
    ([[10, 10], [10, 10]], 1),
]

# "( ( ( [MAX 2 ) 9 ) ] )" is [MAX 2 9 ]: 4 tokens, depth 1, value 9
LISTOPS = [
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),
    ("( ( ( [MIN ( ( ( [SM 1 ) 2 ) ] ) ) 3 ) ] )", 3),
    ("7", 7),
]


def write_pathfinder(folder: Path, images: List) -> Path:
    (folder / "metadata").mkdir(parents=True)
    (folder / "imgs" / "0").mkdir(parents=True)
    lines = []
    for i, (pixels, label) in enumerate(images):
        Image.fromarray(np.array(pixels, dtype=np.uint8)).save(folder / "imgs" / "0" / f"sample_{i}.png")
        lines.append(f"imgs/0 sample_{i}.png {i} {label} 1.0 14 4 2 0.5 1 1\n")
    (folder / "metadata" / "0.npy").write_text("".join(lines))
    return folder


def write_listops(path: Path, rows: List) -> Path:
    path.write_text("Source\tTarget\n" + "".join(f"{src}\t{label}\n" for src, label in rows))
    return path


def table(rows: List) -> Dict[str, tuple]:
    return {r.name: r.estimate() for r in rows}


def test_pathfinder_statistics_match_hand_computation(tmp_path: Path) -> None:
    got = table(stats.pathfinder_rows(*stats.read_pathfinder(write_pathfinder(tmp_path / "pf", IMAGES)), threshold=127))
    # ink > 0 per image: 1/4, 3/4, 0, 1 -> mean 1/2; squared deviations sum to 0.625
    assert got["all: ink > 0"] == pytest.approx((0.5, math.sqrt(0.625 / 3) / 2))
    # above 127: 255 in image 0, 200 in image 1
    assert got["all: ink > 127"][0] == pytest.approx((0.25 + 0.25 + 0 + 0) / 4)
    assert got["all: mean intensity"][0] == pytest.approx((63.75 + 87.5 + 0 + 10) / 4)
    # the empty image has no inked pixels and drops out: 255, 350/3, 10
    assert got["all: mean inked intensity"][0] == pytest.approx((255 + 350 / 3 + 10) / 3)
    # labels 0, 1, 1, 1
    assert got["label 1 share"] == pytest.approx((0.75, 0.25))
    assert got["label 0: ink > 0"][0] == pytest.approx(0.25)
    assert got["label 1: ink > 0"][0] == pytest.approx((0.75 + 0 + 1) / 3)
    assert got["label 1: mean inked intensity"][0] == pytest.approx((350 / 3 + 10) / 2)


def test_listops_statistics_match_hand_computation(tmp_path: Path) -> None:
    lengths, depths, labels = stats.read_listops(write_listops(tmp_path / "basic_test.tsv", LISTOPS))
    # [MAX 2 9 ] / [MIN [SM 1 2 ] 3 ] / 7
    assert lengths.tolist() == [4, 7, 1]
    assert depths.tolist() == [1, 2, 0]
    got = table(stats.listops_rows(lengths, depths, labels))
    assert got["tokens: mean"][0] == pytest.approx(4.0)
    assert got["tokens: 50 %"][0] == pytest.approx(4.0)
    assert got["label 9 share"][0] == pytest.approx(1 / 3)
    assert got["label 0 share"][0] == 0


def test_quantile_se_is_half_the_binomial_rank_spread() -> None:
    values = np.arange(1, 101, dtype=float)
    # n p = 50, sqrt(n p (1 - p)) = 5: ranks 45 and 55 hold 46 and 56
    assert stats.quantile_se(values, 0.5) == 5.0
    assert stats.Row("median", values, quantile=0.5).estimate() == (50.5, 5.0)


def test_ks_and_chi_square_against_known_values() -> None:
    # empirical CDFs of 1..4 and 3..6 differ by 1/2 at 2 and at 4
    assert stats.ks_two_sample(np.array([1.0, 2, 3, 4]), np.array([3.0, 4, 5, 6]))[0] == 0.5
    # tabulated Kolmogorov tail: Q(1.0) = 0.2700, Q(1.358) = 0.0500
    assert stats.kolmogorov_q(1.0) == pytest.approx(0.27, abs=1e-4)
    assert stats.kolmogorov_q(1.358) == pytest.approx(0.05, abs=1e-4)
    # table [[2, 2], [4, 0]], expected [[3, 1], [3, 1]]: chi2 = 1/3 + 1 + 1/3 + 1 on 1 df, exact p 0.1025
    stat, df, p = stats.chi2_homogeneity(np.array([0, 0, 1, 1]), np.array([0, 0, 0, 0]), (0, 1))
    assert (stat, df) == (pytest.approx(8 / 3), 1)
    assert p == pytest.approx(0.1025, abs=0.005)


def test_value_counts_z_matches_hand_computation() -> None:
    # value 255 per image: 1 and 3 (mean 2, SE 1) against 0 and 0; value 0: 3 and 1 against 4 and 4
    a = np.array([[255, 0, 0, 0], [255, 255, 255, 0]], dtype=np.uint8)
    b = np.zeros((2, 4), dtype=np.uint8)
    z = stats.value_counts_z(a, b)
    assert z[255] == pytest.approx(2.0) and z[0] == pytest.approx(-2.0)
    assert not np.any(z[1:255])
    # no spread on either side: an exact difference is infinitely significant
    assert stats.value_counts_z(a[[0, 0]], b)[255] == np.inf


def test_comparison_prints_difference_and_z(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write_listops(tmp_path / "a.tsv", LISTOPS)
    # one more row, [SM 1 2 3 4 5 6 7 ] of 9 tokens: lengths 4, 7, 1, 9, mean 5.25
    b = write_listops(tmp_path / "b.tsv", LISTOPS + [("( ( ( ( ( ( ( [SM 1 ) 2 ) 3 ) 4 ) 5 ) 6 ) 7 ) ] )", 8)])
    assert stats.main(["listops", str(a), str(b), "--names", "A", "B"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tokens: mean"))
    # squared deviations: 0 + 9 + 9 for A, 1.25^2 + 1.75^2 + 4.25^2 + 3.75^2 = 36.75 for B
    se_a, se_b = math.sqrt(18 / 2) / math.sqrt(3), math.sqrt(36.75 / 3) / 2
    assert f"{-1.25 / math.sqrt(se_a**2 + se_b**2):+.2f}" in row
    assert "| 4 +- 1.732 | 5.25 +- 1.75 | -1.25 |" in row
    assert "chi-square" in out


def test_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert stats.guarded("generator_stats", lambda: stats.main(["pathfinder", str(tmp_path / "nope")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or folder" in err
    empty = tmp_path / "empty"
    (empty / "metadata").mkdir(parents=True)
    assert stats.guarded("generator_stats", lambda: stats.main(["pathfinder", str(empty)])) == 2
    assert "lists 0 images" in capsys.readouterr().err
