"""Products with k table rows chosen per query on compiled C kernels (csrc/sparse_rows.c), for
float32 CPU tensors.

Query r picks rows idx[r, :] of its group's block of N table rows (group = r // per_group, e.g. a
query's (batch, head) over that head's N keys). ``mix_rows`` is the weighted sum of the picked
rows, ``dot_rows`` their dot products with a query vector, ``scatter_outer`` adds w[r, j] x[r]
into the picked rows of a gradient. Each equals an indexed torch expression (reference.py, which
the tests compare against); ``refusals`` says why the kernels do not take an input. The kernels
are the torch.library operators ``lra::mix_rows``, ``lra::dot_rows`` and ``lra::scatter_outer``.
"""

import ctypes
from typing import List, Optional

import torch
from torch.library import custom_op, register_fake

from .. import native

LIBRARY = "sparse_rows"


# mix_rows, dot_rows, scatter_outer: three arrays, five sizes, an array and the thread count
_ROWS = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int)
SIGNATURES: native.Signatures = {"mix_rows": _ROWS, "dot_rows": _ROWS, "scatter_outer": _ROWS}


def _library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(x: torch.Tensor) -> List[str]:
    """Why the kernels do not take tensors like ``x`` (float32 CPU tensors, once built here); [] when they do."""
    return native.refusals(x, LIBRARY)


@custom_op("lra::mix_rows", mutates_args=(), device_types="cpu")
def mix_rows(w: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """w [R, k], idx [R, k], table [G * N, D] -> [R, D]."""
    w, idx, table = w.contiguous(), idx.contiguous(), table.contiguous()
    out = torch.empty(w.shape[0], table.shape[1], dtype=table.dtype)
    _library().mix_rows(w.data_ptr(), idx.data_ptr(), table.data_ptr(), w.shape[0], w.shape[1], table.shape[1],
                        per_group, group_rows, out.data_ptr(), torch.get_num_threads())
    return out


@register_fake("lra::mix_rows")
def _(w, idx, table, per_group, group_rows):
    return table.new_empty(w.shape[0], table.shape[1])


@custom_op("lra::dot_rows", mutates_args=(), device_types="cpu")
def dot_rows(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor, per_group: int, group_rows: int) -> torch.Tensor:
    """x [R, D], idx [R, k], table [G * N, D] -> [R, k]."""
    x, idx, table = x.contiguous(), idx.contiguous(), table.contiguous()
    out = torch.empty(idx.shape, dtype=x.dtype)
    _library().dot_rows(x.data_ptr(), idx.data_ptr(), table.data_ptr(), idx.shape[0], idx.shape[1], x.shape[1],
                        per_group, group_rows, out.data_ptr(), torch.get_num_threads())
    return out


@register_fake("lra::dot_rows")
def _(x, idx, table, per_group, group_rows):
    return x.new_empty(idx.shape)


@custom_op("lra::scatter_outer", mutates_args=("grad",), device_types="cpu")
def scatter_outer_op(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, per_group: int,
                     group_rows: int) -> None:
    """grad [G * N, D] (contiguous, float32) += w[r, j] x[r] at the picked rows, in place."""
    w, idx, x = w.contiguous(), idx.contiguous(), x.contiguous()
    _library().scatter_outer(w.data_ptr(), idx.data_ptr(), x.data_ptr(), idx.shape[0], idx.shape[1], x.shape[1],
                             per_group, group_rows, grad.data_ptr(), torch.get_num_threads())


def scatter_outer(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, per_group: int,
                  group_rows: int) -> torch.Tensor:
    """grad [G * N, D] (contiguous, float32) += w[r, j] x[r] at the picked rows; returns grad."""
    scatter_outer_op(w, idx, x, grad, per_group, group_rows)
    return grad
