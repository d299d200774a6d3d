"""Label-preserving augmentation of training batches, a pure function of (seed, step).

``dihedral`` turns each image by one of the 8 symmetries of the square (4 rotations, each with or
without a transpose). Pathfinder's label (are the two markers joined by one contour?) is unchanged
by all 8, so a small generated set goes 8 times further. A CIFAR label can change (an upside-down
ship), so only tasks whose ``TaskSpec.symmetric`` is set accept it. The same (seed, step) gives the
same turns, so a resumed run sees the batches an uninterrupted one would.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import UserError
from .base import TaskSpec

AUGMENTS = ("none", "dihedral")


@lru_cache(maxsize=4)
def dihedral_permutations(side: int) -> torch.Tensor:
    """The 8 symmetries of a ``side x side`` image as gathers of its row-major pixels: [8, side*side]."""
    grid = np.arange(side * side).reshape(side, side)
    turns = [np.rot90(grid, k) for k in range(4)]
    return torch.from_numpy(np.stack([t.reshape(-1) for t in turns + [t.T for t in turns]]).copy())


def check_augment(name: str, spec: TaskSpec) -> None:
    """Refuse an augmentation the task's labels do not survive."""
    if name not in AUGMENTS:
        raise UserError(f"train.augment must be one of {', '.join(AUGMENTS)}, got {name!r}")
    if name == "dihedral" and not spec.symmetric:
        raise UserError(
            f"train.augment=dihedral needs a task whose labels survive rotations and flips "
            f"(pathfinder, pathx); {spec.name!r} is not one"
        )


def augment(
    name: str, tokens: torch.Tensor, spec: TaskSpec, seed: int, step: int, batch_size: int, rows: slice
) -> torch.Tensor:
    """``tokens`` [b, side*side]: rows ``rows`` of the global batch (``batch_size`` rows) of ``step``."""
    if name == "none":
        return tokens
    perms = dihedral_permutations(spec.image_side).to(tokens.device)  # [8, L]
    # one symmetry per row of the global batch, so that every process draws the same ones
    choice = np.random.default_rng([seed, step, 8]).integers(0, 8, size=batch_size)[rows]
    index = perms[torch.from_numpy(choice).to(tokens.device)]  # [b, L]
    return tokens.gather(1, index)
