"""train.augment=dihedral: the 8 symmetries of the square, drawn as a pure function of (seed, step)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lra.tasks.augment import augment, check_augment, dihedral_permutations
from lra.errors import UserError
from lra.tasks import get_task

PATHFINDER = get_task("pathfinder").spec


def test_permutations_are_the_rotations_and_flips_of_the_image() -> None:
    image = np.random.default_rng(0).integers(0, 256, size=(5, 5))
    expected = {np.rot90(t, k).tobytes() for t in (image, image.T) for k in range(4)}
    got = {image.reshape(-1)[p.numpy()].reshape(5, 5).tobytes() for p in dihedral_permutations(5)}
    assert got == expected and len(got) == 8


def test_permutations_form_a_group() -> None:
    perms = dihedral_permutations(4)
    rows = {tuple(p.tolist()) for p in perms}
    # composing any two symmetries gives one of the 8 again
    assert all(tuple(a[b].tolist()) in rows for a in perms for b in perms)


def test_same_seed_and_step_same_turns_and_a_shard_sees_its_rows() -> None:
    tokens = torch.arange(6 * 1024).reshape(6, 1024) % 256  # [6, 32*32]
    first = augment("dihedral", tokens, PATHFINDER, seed=3, step=7, batch_size=6, rows=slice(0, 6))
    again = augment("dihedral", tokens, PATHFINDER, seed=3, step=7, batch_size=6, rows=slice(0, 6))
    other = augment("dihedral", tokens, PATHFINDER, seed=3, step=8, batch_size=6, rows=slice(0, 6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    # process 1 of 2 turns rows 3..5 exactly as a single process turns them
    shard = augment("dihedral", tokens[3:], PATHFINDER, seed=3, step=7, batch_size=6, rows=slice(3, 6))
    assert torch.equal(shard, first[3:])
    # every row keeps its pixel values, only moved
    assert torch.equal(first.sort(dim=1).values, tokens.sort(dim=1).values)
    assert torch.equal(augment("none", tokens, PATHFINDER, 3, 7, 6, slice(0, 6)), tokens)


@pytest.mark.parametrize("task", ["listops", "image", "text"])
def test_tasks_whose_labels_can_change_refuse_dihedral(task: str) -> None:
    with pytest.raises(UserError, match="labels survive rotations and flips"):
        check_augment("dihedral", get_task(task).spec)


def test_unknown_augment_names_the_valid_ones() -> None:
    with pytest.raises(UserError, match="none, dihedral"):
        check_augment("mixup", PATHFINDER)
    check_augment("dihedral", get_task("pathx").spec)
