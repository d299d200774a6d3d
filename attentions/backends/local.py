"""Local attention (Tay et al. 2021, Long Range Arena: A Benchmark for Efficient Transformers).

The sequence is cut into contiguous blocks of block_size tokens from token 0 (the last block may be
shorter) and each query attends, under one softmax, to the real keys of its own block only: no
neighbouring block, no overlap. Cost: O(N block_size D) time and O(N block_size) memory, as one
batched matmul over [B, H, N / block_size, block_size, block_size] scores.

The authors' LRA code (google-research/long-range-arena, models/local/local_attention.py) also
attends within the own block only, but it forms the blocks with a reshape of [B, N] into
[B, block_size, N / block_size] and attends over the first of those axes, so a "block" there is the
strided set {j : j mod (N / block_size) = const} spread over the whole sequence, not a contiguous
window; its padding mask is reshaped the contiguous way, so mask and tokens do not line up. The
published "Local Attention" rows carry that layout. This backend follows the mechanism the LRA paper
names (blocked local attention over contiguous blocks) and says so in docs/backends.md.
Padding: padded keys get no weight; every real query has a real key (itself) in its block; rows
at padded positions are zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_key_mask
from ..registry import register


@dataclass
class LocalConfig:
    # tokens per block, blocks fixed in position from token 0 (LRA JAX: 50; 64 for image and pathfinder)
    block_size: int = 50


def masked_softmax(scores: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis with the entries where ``ok`` (broadcast to scores) is False given
    no weight, float32 at least. ``scores`` is overwritten (one pass: a bias of 0 or the dtype's
    lowest value added in place; ok is [B, 1, ...], shared by the heads). A row with no ok entry is
    uniform: callers zero the rows that have no real key."""
    bias = torch.zeros(ok.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~ok, torch.finfo(scores.dtype).min)
    acc = torch.promote_types(scores.dtype, torch.float32)
    return scores.add_(bias).softmax(dim=-1, dtype=acc).to(scores.dtype)


def zero_padded_rows(out: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """out [B, H, N, D] with the rows at padded positions set to zero."""
    return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0.0)


def to_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [B, H, N, D] -> [B, H, ceil(N / size), size, D], zero rows after the last token."""
    b, h, n, d = x.shape
    blocks = -(-n // size)
    pad = blocks * size - n
    return (F.pad(x, (0, 0, 0, pad)) if pad else x).view(b, h, blocks, size, d)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, block_size: int = 50
) -> torch.Tensor:
    """Each query's keys gathered by index (its block's positions), then a softmax over the real ones."""
    b, h, n, d = q.shape
    start = torch.arange(n) // block_size * block_size  # [N] first position of each query's block
    index = start[:, None] + torch.arange(block_size)  # [N, block_size]
    inside = index < n
    index = index.clamp(max=n - 1)
    ok = inside[None, :, :] & real_key_mask(mask, q)[:, index]  # [B, N, block_size]
    scores = torch.einsum("bhnd,bhnkd->bhnk", q, k[:, :, index]) / math.sqrt(d)  # [B, H, N, block_size]
    weights = masked_softmax(scores, ok[:, None])
    return zero_padded_rows(torch.einsum("bhnk,bhnkd->bhnd", weights, v[:, :, index]), mask)


@register("local")
class LocalAttention(Attention):
    order = 3.1
    paper = "Tay et al. 2021, Long Range Arena: A Benchmark for Efficient Transformers (local attention baseline)"
    published_as = ("Local Attention",)
    Config = LocalConfig
    cost = "O(N block_size D)"
    whole_sequence = {"block_size": "one block of the whole sequence: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N/B blocks",
        expert_type="raw KV (contiguous block)",
        construction="fixed blocks",
        routing="by position (own block)",
    )

    def __init__(self, dims: AttnDims, cfg: LocalConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.block_size < 1:
            raise AttentionError(f"local block_size must be a positive integer (tokens per block), got {cfg.block_size}")

    def budget(self) -> str:
        return f"block_size = {self.cfg.block_size}"

    @classmethod
    def flops(cls, cfg: LocalConfig, n: int, d: int) -> Tuple[float, float]:
        """Q K^T and P V within each block, over the padded length: 4 N' block_size D; train = 3x."""
        size = min(cfg.block_size, n)
        forward = 4.0 * (-(-n // size) * size) * size * d
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        size = min(self.cfg.block_size, n)
        q_b, k_b, v_b = (to_blocks(x, size) for x in (q, k, v))  # [B, H, M, size, D]
        scores = (q_b * (1 / math.sqrt(d))) @ k_b.transpose(-1, -2)  # [B, H, M, size, size]
        blocks = q_b.shape[2]
        if mask is not None or blocks * size != n:
            real = F.pad(real_key_mask(mask, q), (0, blocks * size - n)).view(b, 1, blocks, 1, size)
            weights = masked_softmax(scores, real)
        else:
            weights = scores.softmax(dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = (weights @ v_b).view(b, h, blocks * size, d)[:, :, :n]  # [B, H, N, D]
        return zero_padded_rows(out, mask)
