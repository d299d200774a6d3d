"""Top-k selection along the last dim on a compiled C kernel for float32 CPU tensors
(csrc/topk_select.c): ``torch.topk(k, dim=-1, sorted=False)``, which the routing backends call per
query or landmark.

On the CPU torch.topk sorts (value, index) pairs: 14 ns per score for k = 128 of 1,024 on a
2-core AMD EPYC, 8x the time of the matmul that made the scores, so Top-k attention spent most
of its step selecting. The kernel bisects on the value with vectorised counting passes instead.
The chosen set is the same as torch.topk's except among equal values at the boundary (the kernel
takes the lower indices; torch.topk promises no order); values and indices come in no order.
Other dtypes and devices, and machines where the kernel cannot be built, use torch.topk (dispatch.py).
The kernel is the torch.library operator ``lra::topk_select``.
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch.library import custom_op, register_fake

from .. import native

LIBRARY = "topk_select"


SIGNATURES: native.Signatures = {
    "topk_rows": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64], ctypes.c_int),
}


def _library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(x: torch.Tensor) -> List[str]:
    """Why the kernel does not take tensors like ``x`` (float32 CPU tensors, once built here); [] when it does."""
    return native.refusals(x, LIBRARY)


@custom_op("lra::topk_select", mutates_args=(), device_types="cpu")
def topk_rows(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along the last dim of x (float32 on the CPU, 1 <= k < n) and their
    indices, in no order. [..., n] -> [..., k] x 2. Not differentiable."""
    n = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // n if n else 0
    values = torch.empty(*x.shape[:-1], k, dtype=x.dtype)
    indices = torch.empty(*x.shape[:-1], k, dtype=torch.long)
    if rows and _library().topk_rows(x.data_ptr(), rows, n, k, values.data_ptr(), indices.data_ptr(),
                                     torch.get_num_threads()) != 0:
        raise MemoryError("the top-k selection kernel could not allocate its per-thread buffers")
    return values, indices


@register_fake("lra::topk_select")
def _(x, k):
    return x.new_empty(*x.shape[:-1], k), x.new_empty(*x.shape[:-1], k, dtype=torch.long)
