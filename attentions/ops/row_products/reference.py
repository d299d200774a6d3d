"""Products with k table rows chosen per query, the PyTorch form: indexed torch expressions.

Query r picks rows idx[r, :] of its group's block of ``group_rows`` table rows (group = r // per_group).
"""
from __future__ import annotations

import torch


def _rows(idx: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """The table row of every pick: [R, k]."""
    groups = torch.arange(idx.shape[0], device=idx.device)[:, None] // per_group
    return groups * group_rows + idx


def mix_rows(w: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """sum_j w[r, j] table[row(r, j)]: w [R, k], idx [R, k], table [G * N, D] -> [R, D]."""
    return (w[..., None] * table[_rows(idx, per_group, group_rows)]).sum(1)


def dot_rows(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """x[r] . table[row(r, j)]: x [R, D], idx [R, k], table [G * N, D] -> [R, k]."""
    return (x[:, None, :] * table[_rows(idx, per_group, group_rows)]).sum(-1)


def scatter_outer(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, per_group: int,
                  group_rows: int) -> torch.Tensor:
    """grad [G * N, D] += w[r, j] x[r] at the picked rows, in place; returns grad."""
    rows = _rows(idx, per_group, group_rows).flatten()
    return grad.index_add_(0, rows, (w[..., None] * x[:, None, :]).flatten(0, 1))
