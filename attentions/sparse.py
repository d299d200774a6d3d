"""Products with k table rows chosen per query (sparse_rows.c), for float32 CPU tensors.

Query r picks rows idx[r, :] of its group's block of N table rows (group = r // per_group, e.g. a
query's (batch, head) over that head's N keys). ``mix_rows`` is the weighted sum of the picked
rows, ``dot_rows`` their dot products with a query vector, ``scatter_outer`` adds w[r, j] x[r]
into the picked rows of a gradient. Each equals an indexed torch expression (``reference_*``,
which the tests compare against); ``available`` says whether the kernels are built here.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import native

LIBRARY = "sparse_rows"


def _library() -> Optional[ctypes.CDLL]:
    lib = native.load(LIBRARY)
    if lib is not None and not hasattr(lib, "_typed"):
        for fn in (lib.mix_rows, lib.dot_rows, lib.scatter_outer):
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64]
            fn.restype = ctypes.c_int
        lib._typed = True
    return lib


def available(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``'s kind of tensor: float32 on the CPU, with the kernels built here."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _library() is not None


def _rows(idx: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """The table row of every pick: [R, k]."""
    groups = torch.arange(idx.shape[0], device=idx.device)[:, None] // per_group
    return groups * group_rows + idx


def reference_mix(w: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int):
    return (w[..., None] * table[_rows(idx, per_group, group_rows)]).sum(1)


def reference_dot(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int):
    return (x[:, None, :] * table[_rows(idx, per_group, group_rows)]).sum(-1)


def reference_scatter(w, idx, x, grad: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    rows = _rows(idx, per_group, group_rows).flatten()
    return grad.index_add_(0, rows, (w[..., None] * x[:, None, :]).flatten(0, 1))


def mix_rows(w: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """w [R, k], idx [R, k], table [G * N, D] -> [R, D]."""
    w, idx, table = w.contiguous(), idx.contiguous(), table.contiguous()
    out = torch.empty(w.shape[0], table.shape[1], dtype=table.dtype)
    _library().mix_rows(w.data_ptr(), idx.data_ptr(), table.data_ptr(), w.shape[0], w.shape[1], table.shape[1],
                        per_group, group_rows, out.data_ptr(), torch.get_num_threads())
    return out


def dot_rows(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """x [R, D], idx [R, k], table [G * N, D] -> [R, k]."""
    x, idx, table = x.contiguous(), idx.contiguous(), table.contiguous()
    out = torch.empty(idx.shape, dtype=x.dtype)
    _library().dot_rows(x.data_ptr(), idx.data_ptr(), table.data_ptr(), idx.shape[0], idx.shape[1], x.shape[1],
                        per_group, group_rows, out.data_ptr(), torch.get_num_threads())
    return out


def scatter_outer(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, per_group: int,
                  group_rows: int) -> torch.Tensor:
    """grad [G * N, D] (contiguous, float32) += w[r, j] x[r] at the picked rows; returns grad."""
    w, idx, x = w.contiguous(), idx.contiguous(), x.contiguous()
    _library().scatter_outer(w.data_ptr(), idx.data_ptr(), x.data_ptr(), idx.shape[0], idx.shape[1], x.shape[1],
                             per_group, group_rows, grad.data_ptr(), torch.get_num_threads())
    return grad
