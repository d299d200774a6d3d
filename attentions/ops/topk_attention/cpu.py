"""Top-k attention's forward on a compiled C kernel for float32 CPU tensors (csrc/topk_attention.c):
scores, selection, softmax and the mix of the chosen values for a block of queries at a time, so
that the [C, N] scores never leave the cache. The choice of keys is lra::topk_select's (ties to the
lower index; torch.topk promises no order among ties). The kernel is the torch.library operator
``lra::topk_attention``; it is not differentiable (Top-k attention's backward runs on the row
products of ops/row_products, from the indices and weights it returns).
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch.library import custom_op, register_fake

from .. import native

LIBRARY = "topk_attention"


class _Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("G", "C", "N", "D", "k", "heads", "threads")] + [
        ("scale", ctypes.c_float)] + [(name, ctypes.c_void_p) for name in
                                      ("q", "kt", "v", "bias", "out", "index", "weights")]


SIGNATURES: native.Signatures = {"topk_attention_forward": ([ctypes.POINTER(_Args)], ctypes.c_int)}


def _library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(x: torch.Tensor) -> List[str]:
    """Why the kernel does not take tensors like ``x`` (float32 CPU tensors, once built here); [] when it does."""
    return native.refusals(x, LIBRARY)


@custom_op("lra::topk_attention", mutates_args=(), device_types="cpu")
def topk_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor],
                   keys: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, C, D], k_t [B, H, D, N], v [B, H, N, D], key_bias [B, 1, 1, N] (0 or -inf) or None ->
    out [B, H, C, D], indices [B, H, C, keys], weights [B, H, C, keys]; 1 <= keys <= N."""
    b, h, c, d = q.shape
    n = k_t.shape[-1]
    q, k_t, v = q.contiguous(), k_t.contiguous(), v.contiguous()
    bias = None if key_bias is None else key_bias.reshape(b, n).to(q.dtype).contiguous()
    out = torch.empty(b, h, c, d, dtype=q.dtype)
    index = torch.empty(b, h, c, keys, dtype=torch.long)
    weights = torch.empty(b, h, c, keys, dtype=q.dtype)
    args = _Args(G=b * h, C=c, N=n, D=d, k=keys, heads=h, threads=torch.get_num_threads(), scale=d ** -0.5,
                 q=q.data_ptr(), kt=k_t.data_ptr(), v=v.data_ptr(), bias=None if bias is None else bias.data_ptr(),
                 out=out.data_ptr(), index=index.data_ptr(), weights=weights.data_ptr())
    if b * h * c and _library().topk_attention_forward(ctypes.byref(args)) != 0:
        raise MemoryError("the top-k attention kernel could not allocate its per-thread buffers")
    return out, index, weights


@register_fake("lra::topk_attention")
def _(q, k_t, v, key_bias, keys):
    shape = (*q.shape[:-1], keys)
    return q.new_empty(q.shape), q.new_empty(shape, dtype=torch.long), q.new_empty(shape)
