"""Pathfinder drawing primitives: the LRA parameters, paddles, occupancy masks, markers.

The shapes and numerics follow the original snakes2 generator (Linsley et al. 2018), whose contour
logic lives in ``pathfinder_gen.py``; cv2 and scipy are replaced by numpy and PIL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

LEVELS = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}

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
