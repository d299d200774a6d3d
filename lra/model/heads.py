"""The Q/K/V projection's output split into heads, each in the layout attention wants.

``x.view(B, N, 3, H, D).permute(2, 0, 3, 1, 4)`` gives q, k, v as strided views of the
projection's output, and every backend that needs them contiguous would copy them (once or more per
tensor); in the backward autograd stacks dq, dk, dv into one [3, B, H, N, D] tensor and
then copies that into the projection's [B, N, 3, H, D] layout. ``split_heads`` does each direction
as one transposing copy: q, k, v come out contiguous [B, H, N, D] (slices of one [3, B, H, N, D]
tensor), and their gradients are written straight into the projection's layout. Pure data
movement: the results are the view's, bit for bit.
"""
from __future__ import annotations

from typing import Tuple

import torch


class SplitHeads(torch.autograd.Function):
    """[B, N, 3 H D] -> 3 x contiguous [B, H, N, D]."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int):
        b, n, width = qkv.shape
        d = width // (3 * heads)
        out = qkv.new_empty(3, b, heads, n, d)
        out.copy_(qkv.view(b, n, 3, heads, d).permute(2, 0, 3, 1, 4))
        ctx.shape = (b, n, heads, d)
        return out[0], out[1], out[2]

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        # (an unused part's gradient arrives as zeros: autograd materialises them)
        b, n, heads, d = ctx.shape
        d_qkv = dq.new_empty(b, n, 3, heads, d)
        # one copy per (q/k/v, head): a [B, N, D] slab each; one strided copy per q/k/v is about 3x slower
        for i, grad in enumerate((dq, dk, dv)):
            for h in range(heads):
                d_qkv[:, :, i, h].copy_(grad[:, h])
        return d_qkv.view(b, n, 3 * heads * d), None


def split_heads(qkv: torch.Tensor, heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, N, D], contiguous, from the projection's output qkv [B, N, 3 H D]
    (the H D features of q first, then k's, then v's, as ``view(B, N, 3, H, D)`` reads them)."""
    return SplitHeads.apply(qkv, heads)
