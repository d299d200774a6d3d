"""Statistics of generated Pathfinder and ListOps data, to compare our generators with the originals.

    python scripts/generator_stats.py pathfinder FOLDER [OTHER_FOLDER] [--names ours original]
    python scripts/generator_stats.py listops PATH [OTHER_PATH]

A Pathfinder FOLDER is one level in the official layout (``metadata/<batch>.npy``,
``imgs/<batch>/sample_<i>.png``). Per image: ink (share of pixels > 0 and > --threshold), mean
intensity, mean intensity of the inked pixels; over the set: the share of label 1; each for all
images and for each label. A ListOps PATH is a ``basic_*.tsv`` file or a folder holding
``basic_{train,val,test}.tsv`` (all three are read). Per row: tokens (official tokenizer), operator
nesting depth; over the set: token quantiles 5/25/50/75/95 % and the share of each label 0-9.

Every statistic is printed as estimate +- standard error: a mean's SE is std / sqrt(n); a quantile's
is half the gap between the order statistics one binomial SD of rank, sqrt(n p (1 - p)), either side
of rank n p. Given two sets, each row adds A - B and z = (A - B) / sqrt(SE_A^2 + SE_B^2), and each
per-item distribution a two-sample Kolmogorov-Smirnov D with its asymptotic p-value (conservative
for integer-valued data with ties). Label shares also get a chi-square test of homogeneity, and two
Pathfinder sets a z for the pixels per image at each value 0-255 (a port that rounds some values one
level off shows there, while the means barely move).
"""
from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from lra.cli import Parser, guarded
from lra.errors import UserError
from lra.tasks.listops import FILES, tokenize
from lra.tasks.pathfinder import read_metadata

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass
class Row:
    """One statistic: the mean of ``values`` (per image or per row), or their ``quantile``-th quantile."""

    name: str
    values: np.ndarray  # [n]
    quantile: Optional[float] = None
    # the values form a distribution worth a KS test (not a 0/1 indicator)
    ks: bool = True

    def estimate(self) -> Tuple[float, float]:
        """(estimate, standard error)."""
        v = self.values
        if self.quantile is None:
            se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
            return float(v.mean()), se
        return float(np.quantile(v, self.quantile)), quantile_se(v, self.quantile)


def quantile_se(values: np.ndarray, p: float) -> float:
    """Half the gap between the order statistics at ranks n p -+ sqrt(n p (1 - p)) (distribution-free)."""
    s = np.sort(values)
    n = len(s)
    sd = math.sqrt(n * p * (1 - p))
    lo, hi = max(0, math.floor(n * p - sd)), min(n - 1, math.ceil(n * p + sd))
    return float(s[hi] - s[lo]) / 2


def kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution: 2 sum_k (-1)^(k-1) exp(-2 k^2 lam^2)."""
    if lam < 0.3:
        # the series converges slowly there, and Q(0.3) > 0.99999
        return 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(max(p, 0.0), 1.0)


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> Tuple[float, float]:
    """(D, p): the largest gap between the two empirical CDFs and its asymptotic p-value (Stephens' correction)."""
    a, b = np.sort(a), np.sort(b)
    points = np.concatenate([a, b])
    gap = np.abs(np.searchsorted(a, points, "right") / len(a) - np.searchsorted(b, points, "right") / len(b))
    d = float(gap.max())
    ne = len(a) * len(b) / (len(a) + len(b))
    return d, kolmogorov_q((math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d)


def chi2_homogeneity(a: np.ndarray, b: np.ndarray, classes: Sequence[int]) -> Tuple[float, int, float]:
    """(statistic, degrees of freedom, p) for "a and b have the same label distribution".

    The p-value uses the Wilson-Hilferty normal approximation of the chi-square tail.
    """
    table = np.array([[np.sum(x == c) for c in classes] for x in (a, b)], dtype=float)  # [2, C]
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    if df == 0:
        return stat, 0, 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return stat, df, 0.5 * math.erfc(z / math.sqrt(2))


def read_pathfinder(folder: Path) -> Tuple[np.ndarray, np.ndarray]:
    """Pixels [n, H*W] uint8 and labels [n] of every image listed under ``folder/metadata``."""
    if not (folder / "metadata").is_dir():
        raise UserError(f"{folder}: no metadata/ folder; give one Pathfinder level in the official layout")
    entries = read_metadata(folder)
    if len(entries) < 2:
        raise UserError(f"{folder}/metadata lists {len(entries)} images; need at least 2 for standard errors")
    pixels = []
    for meta, line, path, _ in entries:
        try:
            with Image.open(path) as img:
                pixels.append(np.asarray(img.convert("L"), dtype=np.uint8).reshape(-1))
        except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
            raise UserError(f"{path}: image listed in {meta}:{line} is missing or unreadable ({err})")
    if len({p.size for p in pixels}) != 1:
        raise UserError(f"{folder}: images of different sizes")
    return np.stack(pixels), np.array([label for *_, label in entries])


def pathfinder_rows(pixels: np.ndarray, labels: np.ndarray, threshold: int) -> List[Row]:
    """Per-image statistics of ``pixels`` [n, P] uint8, for all images, then label 0, then label 1."""
    rows = [Row("label 1 share", (labels == 1).astype(float), ks=False)]
    for group, keep in (("all", np.ones(len(labels), bool)), ("label 0", labels == 0), ("label 1", labels == 1)):
        px = pixels[keep].astype(float)  # [m, P]
        inked = px > 0
        count = inked.sum(axis=1)
        rows += [
            Row(f"{group}: ink > 0", inked.mean(axis=1)),
            Row(f"{group}: ink > {threshold}", (px > threshold).mean(axis=1)),
            Row(f"{group}: mean intensity", px.mean(axis=1)),
            # empty images have no inked pixels and drop out of this one
            Row(f"{group}: mean inked intensity", px.sum(axis=1)[count > 0] / count[count > 0]),
        ]
    return rows


def value_counts_z(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """z of the difference in pixels per image at each value 0..255 between pixel sets [n, P] uint8: [256].

    Catches what means hide: a port that rounds some values one level off shifts mass between
    neighbouring values.
    """
    counts = [np.stack([np.bincount(row, minlength=256) for row in x]).astype(float) for x in (a, b)]  # [n, 256]
    diff = counts[0].mean(axis=0) - counts[1].mean(axis=0)
    se = np.sqrt(sum(c.var(axis=0, ddof=1) / len(c) for c in counts))
    z = np.divide(diff, se, out=np.zeros(256), where=se > 0)
    exact = (se == 0) & (diff != 0)
    z[exact] = np.copysign(np.inf, diff[exact])
    return z


def listops_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    files = [path / FILES[s] for s in ("train", "val", "test")]
    if not all(f.is_file() for f in files):
        raise UserError(f"{path}: expected a .tsv file or a folder with {', '.join(FILES.values())}")
    return files


def read_listops(path: Path) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens per row [n], operator nesting depth [n], labels [n] of the rows of ``path``."""
    csv.field_size_limit(sys.maxsize)
    lengths, depths, labels = [], [], []
    for file in listops_files(path):
        with open(file, newline="") as f:
            reader = csv.reader(f, delimiter="\t")
            if next(reader, None) != ["Source", "Target"]:
                raise UserError(f"{file}:1: expected the header 'Source<TAB>Target'")
            for line, row in enumerate(reader, start=2):
                if len(row) != 2 or not row[1].strip().isdigit():
                    raise UserError(f"{file}:{line}: expected '<source><TAB><label 0-9>', got {row!r:.80}")
                tokens = tokenize(row[0])
                depth = deepest = 0
                for tok in tokens:
                    depth += tok.startswith("[") - (tok == "]")
                    deepest = max(deepest, depth)
                lengths.append(len(tokens))
                depths.append(deepest)
                labels.append(int(row[1]))
    if len(labels) < 2:
        raise UserError(f"{path}: {len(labels)} rows; need at least 2 for standard errors")
    return np.array(lengths, dtype=float), np.array(depths, dtype=float), np.array(labels)


def listops_rows(lengths: np.ndarray, depths: np.ndarray, labels: np.ndarray) -> List[Row]:
    rows = [Row("tokens: mean", lengths)]
    rows += [Row(f"tokens: {round(q * 100)} %", lengths, quantile=q, ks=False) for q in QUANTILES]
    rows += [Row("depth: mean", depths)]
    rows += [Row(f"label {c} share", (labels == c).astype(float), ks=False) for c in range(10)]
    return rows


def fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"


def single_table(rows: List[Row]) -> str:
    lines = ["| statistic | n | estimate | SE |", "|---|---:|---:|---:|"]
    for r in rows:
        est, se = r.estimate()
        lines.append(f"| {r.name} | {len(r.values)} | {fmt(est)} | {fmt(se)} |")
    return "\n".join(lines)


def compare_table(rows_a: List[Row], rows_b: List[Row], names: Tuple[str, str]) -> str:
    a_name, b_name = names
    lines = [
        f"| statistic | {a_name} | {b_name} | {a_name} - {b_name} | z | KS D (p) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for ra, rb in zip(rows_a, rows_b):
        (ea, sa), (eb, sb) = ra.estimate(), rb.estimate()
        diff, se = ea - eb, math.sqrt(sa * sa + sb * sb)
        z = 0.0 if diff == 0 else (diff / se if se > 0 else math.copysign(math.inf, diff))
        ks = "" if not ra.ks else "{:.3f} ({:.2g})".format(*ks_two_sample(ra.values, rb.values))
        lines.append(
            f"| {ra.name} | {fmt(ea)} +- {fmt(sa)} | {fmt(eb)} +- {fmt(sb)} | {fmt(diff)} | {z:+.2f} | {ks} |"
        )
    return "\n".join(lines)


def parser() -> Parser:
    p = Parser(prog="generator_stats", description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=["pathfinder", "listops"])
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="one set, or two to compare (A then B)")
    p.add_argument("--names", nargs=2, metavar=("A", "B"), help="column names for the two sets (default: the paths)")
    p.add_argument("--threshold", type=int, default=127, help="Pathfinder: also count pixels above this (0-254, default 127)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if len(args.paths) > 2:
        raise UserError(f"give one or two {args.task} sets, got {len(args.paths)}")
    if not 0 <= args.threshold <= 254:
        raise UserError(f"--threshold must be 0-254, got {args.threshold}")
    for path in args.paths:
        if not path.exists():
            raise UserError(f"{path}: no such file or folder")
    sets: List[List[Row]] = []
    labels: List[np.ndarray] = []
    pixel_sets: List[np.ndarray] = []
    for path in args.paths:
        if args.task == "pathfinder":
            pixels, lab = read_pathfinder(path)
            sets.append(pathfinder_rows(pixels, lab, threshold=args.threshold))
            pixel_sets.append(pixels)
        else:
            lengths, depths, lab = read_listops(path)
            sets.append(listops_rows(lengths, depths, lab))
        labels.append(lab)
    if len(sets) == 1:
        print(single_table(sets[0]))
        return 0
    names = tuple(args.names) if args.names else tuple(str(p) for p in args.paths)
    print(compare_table(sets[0], sets[1], names))
    classes = (0, 1) if args.task == "pathfinder" else range(10)
    stat, df, p = chi2_homogeneity(labels[0], labels[1], classes)
    print(f"\nlabels: chi-square {stat:.2f} on {df} df, p = {p:.2g} (same label distribution?)")
    if pixel_sets:
        z = value_counts_z(*pixel_sets)
        worst = int(np.argmax(np.abs(z)))
        print(
            f"pixels per image at each value 0-255: {int(np.sum(np.abs(z) > 3))} of 256 values with |z| > 3 "
            f"(about 0.7 expected by chance); largest |z| {abs(z[worst]):.1f} at value {worst}"
        )
    return 0

if __name__ == "__main__":
    sys.exit(guarded("generator_stats", main))
