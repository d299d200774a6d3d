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

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from multiprocessing import Pool
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..errors import UserError

LEVELS = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}
BATCH = 1000
# images per unit of work handed to a worker process
CHUNK = 50
# give up on an image after this many failed placements of the two target contours
MAX_TARGET_ATTEMPTS = 50000
MANIFEST = "generator.json"

Coord = Tuple[int, int]


@dataclass(frozen=True)
class Params:
    window: int
    contour_length: int
    paddle_length: int
    paddle_thickness: float
    marker_radius: float
    seed_distance: int
    continuity: float
    margins: Tuple[int, ...]
    snake_contrasts: Tuple[float, ...]
    paddle_contrasts: Tuple[float, ...]
    # total distractor paddles; the number of distractor contours is budget // distractor_length
    distractor_budget: int
    padding: int = 1
    antialias: int = 2
    max_paddle_retrial: int = 2
    max_distractor_retrial: int = 4

    @property
    def distractor_length(self) -> int:
        return self.contour_length // 3

    @property
    def num_distractors(self) -> int:
        # Python 2 integer division, as the original wrapper computed it
        return self.distractor_budget // self.distractor_length


def lra_params(window: int, level: str) -> Params:
    """LRA's settings for Pathfinder-32 (window 32) or Path-X (window 128) at one difficulty level."""
    length = LEVELS[level]
    if window == 32:
        return Params(32, length, 2, 0.5, 1.5, 7, 1.0, (1,), (2.0,), (0.75,), 20)
    if window == 128:
        return Params(128, length, 5, 1.5, 3.0, 20, 1.8, (2, 3), (0.9,), (1.0,), 35)
    raise ValueError(f"no LRA Pathfinder settings for window {window}; valid: 32, 128")


# one unit of work: (folder, params, seed, batch, first index, end index)
Job = Tuple[str, Params, int, int, int, int]


@dataclass
class Sample:
    """One image and the record of how it was drawn (what the tests check)."""

    image: np.ndarray  # [H, W] uint8, what goes into the PNG
    label: int  # 1 = both markers end the same target contour
    margin: int
    targets: np.ndarray  # [2, H, W] float, each target contour drawn alone
    markers: Tuple[Coord, Coord]  # (y, x) of the origin and terminal markers
    marker_contours: Tuple[int, int]  # the target contour each marker sits on


def translate(coord: Sequence[float], angle: float, dist: float) -> Coord:
    """Move ``coord`` (y, x) by ``dist`` along ``angle`` (radians); rounded up as the original does."""
    return int(math.ceil(coord[0] + dist * math.sin(angle))), int(math.ceil(coord[1] + dist * math.cos(angle)))


def flip_by_pi(angle: float) -> float:
    return angle + math.pi if angle < 0 else angle - math.pi


def disc(radius: int) -> np.ndarray:
    y, x = np.ogrid[-radius : radius + 1, -radius : radius + 1]
    return x**2 + y**2 <= radius**2  # [2r+1, 2r+1] bool


def kernel_offsets(kernel: np.ndarray) -> Tuple[Coord, ...]:
    """(dy, dx) of the kernel's set cells relative to its centre (OpenCV's default anchor)."""
    cy, cx = kernel.shape[0] // 2, kernel.shape[1] // 2
    return tuple((int(y) - cy, int(x) - cx) for y, x in zip(*np.nonzero(kernel)))


def dilate(image: np.ndarray, offsets: Sequence[Coord]) -> np.ndarray:
    """Grey dilation as cv2.dilate: out[y, x] = max of image[y + dy, x + dx]; outside cells are ignored.

    Where every tap is outside, cv2 gives -DBL_MAX and this gives 0; ``seed_blind`` handles that case.
    """
    h, w = image.shape
    r = max(max(abs(dy), abs(dx)) for dy, dx in offsets)
    # zero padding stands for "outside": every image here is non-negative
    padded = np.zeros((h + 2 * r, w + 2 * r), dtype=image.dtype)
    padded[r : r + h, r : r + w] = image
    out = np.zeros_like(image)
    for dy, dx in offsets:
        np.maximum(out, padded[r + dy : r + dy + h, r + dx : r + dx + w], out=out)
    return out


def lanczos(image: np.ndarray, size: int) -> np.ndarray:
    """scipy.misc.imresize(image, (size, size), interp="lanczos") of a uint8 image, as floats in [0, 1]."""
    small = Image.fromarray(image).resize((size, size), resample=Image.Resampling.LANCZOS)
    return np.asarray(small, dtype=np.float64) / 255.0


def stamp_extent(p: Params, margin: int) -> int:
    return p.paddle_length + int(math.ceil(p.paddle_thickness)) + margin


@lru_cache(maxsize=16384)
def paddle_stamp(angle: float, p: Params, margin: int) -> Tuple[np.ndarray, np.ndarray]:
    """One paddle from the stamp's centre along ``angle``: (line, mask), each [2e+1, 2e+1] in [0, 1].

    The line is drawn ``antialias`` times larger and Lanczos-resized; the mask is the large line
    dilated by a disc of radius ``margin * antialias``, resized the same way.
    """
    aa = p.antialias
    if round(p.paddle_thickness * aa) != p.paddle_thickness * aa:
        raise ValueError(f"paddle thickness {p.paddle_thickness} x antialias {aa} must be a whole number")
    ext = stamp_extent(p, margin)
    centre = ext * aa
    head = translate((centre, centre), angle, p.paddle_length * aa)
    big = Image.new("L", (2 * centre + 1, 2 * centre + 1), 0)
    width = int(round(p.paddle_thickness * aa))
    ImageDraw.Draw(big).line([(centre, centre), (head[1], head[0])], fill=255, width=width)
    big_line = np.asarray(big)  # [2e*aa+1, 2e*aa+1] uint8, 0 or 255
    big_mask = dilate(big_line, kernel_offsets(disc(margin * aa)))
    line, mask = lanczos(big_line, 2 * ext + 1), lanczos(big_mask, 2 * ext + 1)
    # shared by every paddle at this angle: read-only
    line.setflags(write=False)
    mask.setflags(write=False)
    return line, mask


@dataclass
class Paddle:
    """A paddle cut to the image: the window it covers, its drawn line and its occupancy mask there."""

    region: Tuple[slice, slice]
    # float32, as the original's PIL "F" canvases: the rounding decides ties in the final 0-255 scaling
    line: np.ndarray  # [h, w] float32 in [0, contrast]
    mask: np.ndarray  # [h, w] float32 in [0, 1]

    def paint(self, image: np.ndarray) -> None:
        np.maximum(image[self.region], self.line, out=image[self.region])

    def occupy(self, mask: np.ndarray) -> None:
        np.maximum(mask[self.region], self.mask, out=mask[self.region])

    def crosses(self, mask: np.ndarray) -> bool:
        # the original tests max(mask + paddle mask) < 1.8 over the whole image; outside the window
        # the paddle mask is 0 and the mask at most 1, so the window decides
        return bool(np.max(mask[self.region] + self.mask) >= 1.8)


def paddle(
    shape: Tuple[int, int], start: Sequence[int], angle: float, p: Params, margin: int, contrast: float
) -> Paddle:
    """The paddle from ``start`` along ``angle``, its stamp centred on ``start`` and cut at the borders."""
    line, mask = paddle_stamp(float(angle), p, margin)
    ext = line.shape[0] // 2
    y0, x0 = start[0] - ext, start[1] - ext
    ys, xs = max(y0, 0), max(x0, 0)
    ye, xe = min(y0 + line.shape[0], shape[0]), min(x0 + line.shape[1], shape[1])
    cut = (slice(ys - y0, ye - y0), slice(xs - x0, xe - x0))
    line32, mask32 = (line[cut] * contrast).astype(np.float32), mask[cut].astype(np.float32)
    return Paddle((slice(ys, ye), slice(xs, xe)), line32, mask32)


@lru_cache(maxsize=4096)
def seed_offsets(angle: float, p: Params, margin: int) -> Tuple[Coord, ...]:
    """Offsets a seed paddle along ``angle`` covers, from the original's head-centred structuring element."""
    side = (p.paddle_length + margin) * 2 + 1
    head = p.paddle_length + margin + 1
    struct = np.zeros((side, side))
    paddle((side, side), (head, head), angle, p, margin, 1.0).occupy(struct)
    # the original casts the [0, 1] mask to uint8, which keeps only fully covered cells
    return kernel_offsets(struct >= 1.0)


def free(mask: np.ndarray) -> np.ndarray:
    """Cells the original counts as available: ``ceil(mask - 0.3) == 0``."""
    return mask <= 0.3


@lru_cache(maxsize=64)
def circle(radius: int) -> Tuple[np.ndarray, np.ndarray]:
    """(radius * sin, radius * cos) at one sample per pixel of arc, as the original samples the circle."""
    rad = np.arange(0, 360, 360.0 / (2 * radius * math.pi)) * math.pi / 180
    return radius * np.sin(rad), radius * np.cos(rad)


@lru_cache(maxsize=65536)
def circle_cells(pivot: Coord, radius: int, shape: Tuple[int, int]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Distinct in-image cells on the circle around ``pivot`` in (y, x) order, and their angles."""
    h, w = shape
    dy, dx = circle(radius)
    ys, xs = pivot[0] + dy, pivot[1] + dx
    inside = (ys < h) & (ys >= 0) & (xs < w) & (xs >= 0)
    if not inside.any():
        return None
    # np.unique(coords, axis=0) of the original, on flat indices
    cells = np.unique(ys[inside].astype(int) * w + xs[inside].astype(int))
    coords = np.stack([cells // w, cells % w], axis=1)  # [K, 2]
    return coords, np.arctan2(coords[:, 0] - pivot[0], coords[:, 1] - pivot[1])


def dilated_at(image: np.ndarray, cells: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``dilate(image, offsets)[cells[:, 0], cells[:, 1]]`` without dilating the whole image: [K].

    ``cells`` [K, 2] lie inside the image; ``offsets`` [n, 2].
    """
    h, w = image.shape
    r = int(np.abs(offsets).max())
    # zero padding stands for "outside": every image here is non-negative
    padded = np.zeros((h + 2 * r, w + 2 * r))
    padded[r : r + h, r : r + w] = image
    ys = cells[:, None, 0] + offsets[None, :, 0] + r  # [K, n]
    xs = cells[:, None, 1] + offsets[None, :, 1] + r  # [K, n]
    return padded[ys, xs].max(axis=1)


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


def draw_marker(window: int, centre: Coord, radius: float, aa: int) -> np.ndarray:
    """A filled circle drawn ``aa`` times larger and Lanczos-resized: [window, window] in [0, 1]."""
    y, x = np.ogrid[-centre[0] * aa : (window - centre[0]) * aa, -centre[1] * aa : (window - centre[1]) * aa]
    big = np.where(x**2 + y**2 <= (radius * aa) ** 2, 255, 0).astype(np.uint8)
    return lanczos(big, window)


def bytescale(image: np.ndarray) -> np.ndarray:
    """scipy.misc.imsave's scaling of a float image: min -> 0, max -> 255, rounded."""
    low, high = float(image.min()), float(image.max())
    scale = 255.0 / ((high - low) or 1.0)
    return (np.clip((image - low) * scale, 0, 255) + 0.5).astype(np.uint8)


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


def image_seed(seed: int, p: Params, batch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, p.window, p.contour_length, batch, index])


def metadata_line(p: Params, batch: int, index: int, label: int, margin: int) -> str:
    """The original's metadata row: path parts, index, label, then the drawing parameters."""
    fields = [f"imgs/{batch}", f"sample_{index}.png", index, label, p.continuity, p.contour_length,
              p.distractor_length, p.paddle_length, p.paddle_thickness, margin, len(p.paddle_contrasts)]
    return " ".join(map(str, fields))


def render_chunk(job: Job) -> Tuple[int, List[str]]:
    """Draw and save images ``start..stop-1`` of one batch; returns (batch, metadata lines)."""
    folder, p, seed, batch, start, stop = job
    lines = []
    for index in range(start, stop):
        sample = render_sample(image_seed(seed, p, batch, index), p)
        Image.fromarray(sample.image).save(Path(folder) / "imgs" / str(batch) / f"sample_{index}.png")
        lines.append(metadata_line(p, batch, index, sample.label, sample.margin))
    return batch, lines


def batch_sizes(size: int) -> List[int]:
    return [min(BATCH, size - start) for start in range(0, size, BATCH)]


def check_manifest(folder: Path, manifest: Dict[str, object]) -> None:
    """Refuse to mix our images into a folder holding another set (the official release, another seed)."""
    # compare as stored: JSON turns tuples into lists
    manifest = json.loads(json.dumps(manifest))
    path = folder / MANIFEST
    has_data = any((folder / "metadata").glob("*.npy"))
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except ValueError:
            stored = None
        if stored == manifest:
            return
        raise UserError(
            f"{folder} holds Pathfinder images generated with other settings ({path}); "
            f"delete that folder or choose another data directory to generate {manifest['size']} images "
            f"with seed {manifest['seed']}"
        )
    if has_data:
        raise UserError(
            f"{folder} already holds Pathfinder data not made by this generator; leave it, or delete it to regenerate"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))


def write_metadata(folder: Path, batch: int, lines: List[str]) -> None:
    """metadata/<batch>.npy as plain text lines (the format LRA's readers parse), written atomically."""
    meta = folder / "metadata"
    fd, tmp = tempfile.mkstemp(dir=meta, prefix=f".{batch}-")
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, meta / f"{batch}.npy")


def jobs(folder: Path, p: Params, seed: int, sizes: List[int], workers: int) -> Iterator[Job]:
    """Chunks of the unfinished batches; a batch whose metadata exists is done and skipped."""
    for batch, n in enumerate(sizes):
        if (folder / "metadata" / f"{batch}.npy").is_file():
            continue
        shutil.rmtree(folder / "imgs" / str(batch), ignore_errors=True)
        (folder / "imgs" / str(batch)).mkdir(parents=True)
        # small batches still give every worker a share
        chunk = min(CHUNK, -(-n // workers))
        for start in range(0, n, chunk):
            yield str(folder), p, seed, batch, start, min(start + chunk, n)


def generate(folder: Path, p: Params, size: int, seed: int, workers: int = 1) -> Path:
    """Write ``size`` images in the official layout under ``folder``; finished batches are kept on rerun.

    ``folder/imgs/<batch>/sample_<i>.png`` and ``folder/metadata/<batch>.npy``, 1,000 images a batch.
    """
    folder = Path(folder)
    check_manifest(folder, {"generator": "lra-suite snakes2 port v2", "size": size, "seed": seed, "params": asdict(p)})
    (folder / "metadata").mkdir(exist_ok=True)
    sizes = batch_sizes(size)
    todo = list(jobs(folder, p, seed, sizes, workers))
    pending = {b: [] for b in {job[3] for job in todo}}
    remaining = {b: sizes[b] for b in pending}
    bar = tqdm(total=sum(job[5] - job[4] for job in todo), desc=f"pathfinder{p.window}", unit="img")
    pool = Pool(workers) if workers > 1 and len(todo) > 1 else None
    try:
        results = pool.imap(render_chunk, todo) if pool else map(render_chunk, todo)
        for batch, lines in results:
            pending[batch] += lines
            remaining[batch] -= len(lines)
            bar.update(len(lines))
            if remaining[batch] == 0:
                write_metadata(folder, batch, pending.pop(batch))
    finally:
        bar.close()
        if pool:
            # every result is in on success; on an error or Ctrl-C this stops the workers at once
            pool.terminate()
            pool.join()
    return folder
