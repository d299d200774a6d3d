"""Pathfinder generator: a Python 3 port of ``snakes2`` (Linsley et al. 2018, "Learning long-range
spatial dependencies with horizontal gated recurrent units"; drewlinsley/pathfinder), as LRA used it.

An image holds two target contours of ``contour_length`` paddles (short anti-aliased line segments)
whose first paddles start ``seed_distance`` apart, then up to ``budget // (contour_length // 3)``
distractor contours of ``contour_length // 3`` paddles. Each next paddle sits on a circle of radius
``length + margin`` beyond the last one, drawn with weight ``cos(min(continuity * turn, pi/2))**2``
on free pixels, and is kept only if it does not run into earlier paddles' masks. Two circular markers
go on the first paddle of one target contour and on the last paddle of the same contour (label 1) or
of the other one (label 0). Drawing happens at ``antialias`` times the resolution, then a Lanczos
resize; the image is min-max scaled to 0..255 as scipy.misc.imsave did.

Parameters are LRA's (lra_benchmarks/data/pathfinder.py docstrings): 32 px: paddle 2, thickness 0.5,
margin 1, marker 1.5, seed distance 7, continuity 1.0, contrasts 2 (contours) x 0.75 (paddles),
distractor budget 20; 128 px: paddle 5, thickness 1.5, margins 2-3, marker 3, seed distance 20,
continuity 1.8, contrast 0.9, budget 35. The original's quirks are kept: distractors are drawn at the
contour contrast without the paddle factor (so at 32 px they are brighter than the targets), the
first target contour's last paddle is never added to the occupancy mask, and the second seed paddle
is placed without looking at the mask. A seed fails outright when its structuring element leaves
an image cell without taps (cv2.dilate's -DBL_MAX border, see ``seed_blind``): at 32 px only
orientations -150..-121 degrees seed, so a Pathfinder-32 hard image holds about 1.15 distractor
contours, not 5. Paddles are float32, as the original's PIL "F" canvases, which decides rounding ties
in the final 0..255 scaling. Single-paddle clutter is off (the LRA wrapper sets
``use_single_paddles = False``). results/generators/comparison.md compares our images with the
original's, run with these settings.

Departures: cv2 and scipy are replaced by numpy and PIL (same operations); each image draws from its
own generator seeded by (seed, window, contour length, batch, index), so the output depends on the
seed and not on the number of worker processes; paddle stamps are memoised by orientation, and
the occupancy mask is dilated only at the candidate cells of the next paddle.

Speed, in CPU time on one core of a shared 2-core x86 box (numpy 2.4, Pillow 13): 32 px: 133 images/s
(curv_baseline), 75 (curv_contour_length_9), 17 (curv_contour_length_14); 128 px (measured before blind
seeds were made to fail, which touches 6 of 360 orientations there): 19 (curv_baseline), 1.0
(curv_contour_length_14). Most of it goes to redrawing the two target contours until both fit, as
the original's ``while not success`` loop does (about 340 tries an image at 32 px hard, most ending
at the first seed; 300 for Path-X). So one level of Pathfinder-32 (200,000 images) costs about 3.3
core-hours and Path-X about 55 core-hours; ``workers`` divides that. The original runs at about 1.9
images/s per core at 32 px hard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .pathfinder_draw import (
    Coord, Paddle, Params, bytescale, circle_cells, dilate, dilated_at, disc, draw_marker, flip_by_pi, free,
    kernel_offsets, paddle, seed_offsets, translate,
)

# give up on an image after this many failed placements of the two target contours
MAX_TARGET_ATTEMPTS = 50000


@dataclass
class Sample:
    """One image and the record of how it was drawn (what the tests check)."""

    image: np.ndarray  # [H, W] uint8, what goes into the PNG
    label: int  # 1 = both markers end the same target contour
    margin: int
    targets: np.ndarray  # [2, H, W] float, each target contour drawn alone
    markers: Tuple[Coord, Coord]  # (y, x) of the origin and terminal markers
    marker_contours: Tuple[int, int]  # the target contour each marker sits on


def next_paddle_choices(
    pivot: Coord, last_angle: float, radius: int, mask: np.ndarray, small: np.ndarray, continuity: float
) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Candidate heads around ``pivot``: (coords [K, 2], angles [K], cmf [K]), or None at a dead end.

    A cell's weight is (1 - the mask dilated by ``small``) times cos(min(continuity * turn, pi/2))**2.
    """
    found = circle_cells(pivot, radius, mask.shape)
    if found is None:
        return None
    coords, angles = found
    turn = np.abs(angles - last_angle)
    turn = np.minimum(np.minimum(turn, 2 * math.pi - turn) * continuity, 0.5 * math.pi)
    pmf = (1 - dilated_at(mask, coords, small)) * np.maximum(np.cos(turn), 0) ** 2
    total = pmf.sum()
    if total < 1e-4:
        return None
    return coords, angles, np.cumsum(pmf / total)


@dataclass
class Tip:
    """The growing end of a contour: where the next paddle hangs from, and the last paddle."""

    pivot: Coord
    angle: float
    last: Paddle


def extend(
    rng: np.random.Generator, tip: Tip, image: np.ndarray, mask: np.ndarray, p: Params, margin: int, contrast: float,
    small: np.ndarray,
) -> Optional[Tuple[Tip, Coord]]:
    """Add one paddle after ``tip``, painting ``image`` and ``mask`` in place: (new tip, its head) or None.

    Nothing is changed when no paddle fits.
    """
    pivot = translate(tip.pivot, tip.angle, p.paddle_length + 2 * margin)
    choices = next_paddle_choices(pivot, tip.angle, p.paddle_length + margin, mask, small, p.continuity)
    if choices is None:
        return None
    coords, angles, cmf = choices
    for _ in range(p.max_paddle_retrial + 1):
        index = int(np.argmax(cmf - rng.random() > 0))
        head = (int(coords[index, 0]), int(coords[index, 1]))
        new = paddle(mask.shape, head, flip_by_pi(float(angles[index])), p, margin, contrast)
        if not new.crosses(mask):
            new.paint(image)
            # the previous paddle joins the occupancy mask only now, so the new one may touch it
            tip.last.occupy(mask)
            return Tip(pivot, float(angles[index]), new), head
    return None


def random_angle(rng: np.random.Generator) -> float:
    return int(rng.integers(-180, 180)) * math.pi / 180


def in_window(shape: Tuple[int, int], *coords: Coord) -> bool:
    return all(0 <= y < shape[0] and 0 <= x < shape[1] for y, x in coords)


def border(shape: Tuple[int, int], width: int) -> np.ndarray:
    out = np.zeros(shape)
    out[:width, :] = out[-width:, :] = out[:, :width] = out[:, -width:] = 1
    return out


@lru_cache(maxsize=4096)
def seed_blind(angle: float, p: Params, margin: int) -> bool:
    """Whether a seed paddle along ``angle`` fails wherever it would go, as in the original.

    The original dilates the mask with the seed's structuring element by cv2.dilate, which writes
    its border value -DBL_MAX into a cell none of whose taps lies inside the image; the original's
    find_available_coordinates then sees a negative value and reports no free cell at all. The
    element sits off its anchor (it is centred on the paddle's head), so this happens for 330 of the
    360 orientations at 32 px and 6 at 128 px (margin 2): most seeds fail, and Pathfinder-32 images
    carry about one distractor contour, not the five the budget allows.
    """
    shape = (p.window, p.window)
    return bool((dilate(np.ones(shape), seed_offsets(angle, p, margin)) == 0).any())


@lru_cache(maxsize=4096)
def first_seed_cells(angle: float, p: Params, margin: int) -> Tuple[np.ndarray, np.ndarray]:
    """Free tails for the first target paddle: 2 * seed_distance from the borders, the paddle clear of them."""
    shape = (p.window, p.window)
    blocked = np.maximum(border(shape, p.padding), border(shape, 2 * p.seed_distance))
    return np.nonzero(free(dilate(blocked, seed_offsets(angle, p, margin))))


def seed_paddle(
    rng: np.random.Generator, mask: np.ndarray, p: Params, margin: int, contrast: float, first: bool = False
) -> Optional[Tuple[Tip, Coord]]:
    """A first paddle whose whole footprint avoids the mask (and a 1-cell border): (tip, tail) or None.

    ``first``: the first target paddle, whose tail keeps 2 * seed_distance from the borders. As in
    the original, an orientation that finds no free cell (or is ``seed_blind``) ends the attempt.
    """
    for _ in range(p.max_paddle_retrial + 1):
        angle = random_angle(rng)
        if seed_blind(angle, p, margin):
            return None
        if first:
            ys, xs = first_seed_cells(angle, p, margin)
        else:
            blocked = np.maximum(mask, border(mask.shape, 1))
            ys, xs = np.nonzero(free(dilate(blocked, seed_offsets(angle, p, margin))))
        if len(ys) == 0:
            return None
        pick_at = int(rng.integers(len(ys)))
        tail = (int(ys[pick_at]), int(xs[pick_at]))
        head = translate(tail, angle, p.paddle_length)
        pivot = translate(head, flip_by_pi(angle), p.paddle_length + margin)
        if in_window(mask.shape, head, pivot):
            return Tip(pivot, angle, paddle(mask.shape, tail, angle, p, margin, contrast)), tail
    return None


def pick(rng: np.random.Generator, values: Sequence[float]) -> float:
    return values[int(rng.integers(len(values)))]


def second_seed(
    rng: np.random.Generator, tail1: Coord, p: Params, margin: int, contrast: float
) -> Optional[Tuple[Tip, Coord]]:
    """The second target paddle: its tail seed_distance from the first one's, in any direction; no mask check."""
    shape = (p.window, p.window)
    for _ in range(p.max_paddle_retrial + 1):
        angle = random_angle(rng)
        around = int(rng.integers(0, 360)) * math.pi / 180
        tail = (int(np.round(tail1[0] + p.seed_distance * math.sin(around))),
                int(np.round(tail1[1] + p.seed_distance * math.cos(around))))
        head = translate(tail, angle, p.paddle_length)
        pivot = translate(head, flip_by_pi(angle), p.paddle_length + margin)
        if in_window(shape, head, pivot):
            return Tip(pivot, angle, paddle(shape, tail, angle, p, margin, contrast)), tail
    return None


def two_targets(
    rng: np.random.Generator, p: Params, margin: int, small: np.ndarray
) -> Optional[Tuple[List[np.ndarray], np.ndarray, List[Coord], List[Coord]]]:
    """The two target contours: (images, mask, origin tips, terminal tips), or None to start over."""
    shape = (p.window, p.window)
    mu = list(p.snake_contrasts) * 2
    rng.shuffle(mu)
    mask = border(shape, p.padding)
    first = seed_paddle(rng, mask, p, margin, pick(rng, p.paddle_contrasts) * mu[0], first=True)
    if first is None:
        return None
    second = second_seed(rng, first[1], p, margin, pick(rng, p.paddle_contrasts) * mu[1])
    if second is None:
        return None
    images = [np.zeros(shape), np.zeros(shape)]
    tips, origins = [first[0], second[0]], [first[1], second[1]]
    heads = list(origins)
    for k in range(2):
        tips[k].last.paint(images[k])
    for _ in range(p.contour_length - 1):
        contrast = pick(rng, p.paddle_contrasts)
        for k in range(2):
            grown = extend(rng, tips[k], images[k], mask, p, margin, contrast * mu[k], small)
            if grown is None:
                return None
            tips[k], heads[k] = grown
    # as in the original, only the second contour's last paddle joins the mask
    tips[1].last.occupy(mask)
    return images, mask, origins, heads


def distractor(
    rng: np.random.Generator, image: np.ndarray, mask: np.ndarray, p: Params, margin: int, small: np.ndarray
) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """One distractor contour of ``distractor_length`` paddles on copies: (image, mask), or None if it does not fit."""
    if free(mask).sum() / mask.size < 0.01:
        return None
    seeded = seed_paddle(rng, mask, p, margin, pick(rng, p.snake_contrasts))
    if seeded is None:
        return None
    tip = seeded[0]
    image, mask = image.copy(), mask.copy()
    tip.last.paint(image)
    for _ in range(p.distractor_length - 1):
        grown = extend(rng, tip, image, mask, p, margin, pick(rng, p.snake_contrasts), small)
        if grown is None:
            return None
        tip = grown[0]
    tip.last.occupy(mask)
    return image, mask


def render_sample(rng: np.random.Generator, p: Params) -> Sample:
    """One Pathfinder image drawn from ``rng``, as the original's per-image loop does."""
    label = int(rng.integers(0, 2))
    margin = int(pick(rng, p.margins))
    small = np.asarray(kernel_offsets(disc(margin)))  # [n, 2]
    for _ in range(MAX_TARGET_ATTEMPTS):
        targets = two_targets(rng, p, margin, small)
        if targets is not None:
            break
    else:
        raise RuntimeError(f"pathfinder: no room for two target contours after {MAX_TARGET_ATTEMPTS} tries ({p})")
    images, mask, origins, terminals = targets
    image = np.maximum(images[0], images[1])
    for _ in range(p.num_distractors):
        for _ in range(p.max_distractor_retrial + 1):
            drawn = distractor(rng, image, mask, p, margin, small)
            if drawn is not None:
                image, mask = drawn
                break
    origin = int(rng.integers(0, 2))
    terminal = origin if label == 1 else 1 - origin
    markers = (origins[origin], terminals[terminal])
    dots = np.maximum(*(draw_marker(p.window, m, p.marker_radius, p.antialias) for m in markers))
    return Sample(bytescale(np.maximum(image, dots)), label, margin, np.stack(images), markers, (origin, terminal))
