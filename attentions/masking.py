"""Padding-mask helpers: which keys are real, and pooling bins and blocks laid over each sequence's
own real tokens.

Padding must never change what a sequence computes, so a backend that pools (MiTA's landmarks,
Agent's agents) pools over the ``n`` real tokens of each sequence, not over the padded length.
Masks are right-padded: the real tokens of a row come first.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .base import AttentionError


RIGHT_PADDED = "padding masks must be right-padded (real tokens first, then padding)"
NOT_EMPTY = "every sequence needs at least one real token; got a row of padding only"


def real_lengths(mask: Optional[torch.Tensor], batch: int, n: int, device: torch.device) -> torch.Tensor:
    """Real length of each sequence [B] (long); ``n`` for every row when there is no mask."""
    if mask is None:
        return torch.full((batch,), n, dtype=torch.long, device=device)
    lengths = mask.sum(dim=-1)  # [B]
    positions = torch.arange(n, device=mask.device)
    if torch.compiler.is_compiling():
        # in a compiled graph the checks are asserts of the graph (a RuntimeError with the same
        # words), not a host read of the mask that would break the graph in two
        torch._assert_async((mask == (positions[None, :] < lengths[:, None])).all(), RIGHT_PADDED)
        torch._assert_async((lengths > 0).all(), NOT_EMPTY)
        return lengths
    if not torch.equal(mask, positions[None, :] < lengths[:, None]):
        raise AttentionError(RIGHT_PADDED)
    if bool((lengths == 0).any()):
        raise AttentionError(NOT_EMPTY)
    return lengths


def real_key_mask(mask: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """[B, N] bool, True = real key: the padding mask, or all True without one (q: [B, H, N, D])."""
    if mask is None:
        return torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    return mask


def adaptive_pool(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Adaptive average pool along the sequence with torch's bin rule (F.adaptive_avg_pool1d's).

    x: [B, H, n, D] -> [B, H, bins, D]; bin j covers floor(j*n/bins) .. ceil((j+1)*n/bins) - 1.
    Written out rather than calling F.adaptive_avg_pool1d, whose CUDA kernel fails an internal
    assertion ("Couldn't reduce launch bounds") on long sequences (64K tokens, torch 2.11, H200).
    """
    b, h, n, d = x.shape
    if n % bins == 0:
        # equal bins, no overlap: a reshape
        return x.reshape(b, h, bins, n // bins, d).mean(dim=3, dtype=torch.promote_types(x.dtype, torch.float32)).to(x.dtype)
    j = torch.arange(bins, device=x.device)
    starts = j * n // bins  # [bins]
    ends = -((-(j + 1) * n) // bins)  # [bins] ceil((j+1) n / bins)
    # the widest bin, from n and bins alone (no read back from the device)
    width = max(-(-(i + 1) * n // bins) - i * n // bins for i in range(bins))
    offsets = torch.arange(width, device=x.device)  # [W]
    inside = offsets[None, :] < (ends - starts)[:, None]  # [bins, W]
    index = (starts[:, None] + offsets[None, :]).clamp_max(n - 1)  # [bins, W]
    # accumulate in float32 at least (bf16 sums of long bins lose digits)
    acc = torch.promote_types(x.dtype, torch.float32)
    gathered = x[:, :, index.flatten()].reshape(b, h, bins, width, d).to(acc)  # [B, H, bins, W, D]
    weights = inside.to(acc) / inside.sum(dim=1, keepdim=True).to(acc)  # [bins, W]
    return (gathered * weights[None, None, :, :, None]).sum(dim=3).to(x.dtype)


def real_bins(lengths: torch.Tensor, bins: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bins laid over each sequence's real tokens (torch's adaptive-pool rule over ``length`` tokens,
    ``min(bins, length)`` bins): starts and ends [B, bins] (bin j covers [start, end); past a
    sequence's bin count the values are meaningless) and which bins are real [B, bins]."""
    count = lengths.clamp(max=bins)[:, None]  # [B, 1] bins of each sequence
    j = torch.arange(bins, device=lengths.device)[None, :]  # [1, bins]
    starts = j * lengths[:, None] // count  # [B, bins]
    ends = -((-(j + 1) * lengths[:, None]) // count)  # ceil((j+1) length / count)
    return starts, ends, j < count


def pool_real(x: torch.Tensor, mask: Optional[torch.Tensor], bins: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pool ``x`` into ``bins`` bins laid over each sequence's real tokens.

    x: [B, H, N, D], mask: [B, N] or None.
    Returns pooled [B, H, bins, D] and bin_mask [B, bins] (True = a real bin). A sequence with
    fewer real tokens than ``bins`` gets ``n`` bins (one per token); its other bins are zeros and
    masked out.
    """
    b, h, n, d = x.shape
    if mask is None:
        m = min(bins, n)
        pooled = adaptive_pool(x, m)
        if m < bins:
            pooled = F.pad(pooled, (0, 0, 0, bins - m))
        bin_mask = torch.zeros(b, bins, dtype=torch.bool, device=x.device)
        bin_mask[:, :m] = True
        return pooled, bin_mask
    starts, ends, bin_mask = real_bins(real_lengths(mask, b, n, x.device), bins)
    # one pooling matrix for the batch: row j of sequence i averages bin j of its real tokens,
    # zero for a missing bin
    position = torch.arange(n, device=x.device)
    inside = (position >= starts[..., None]) & (position < ends[..., None]) & bin_mask[..., None]  # [B, bins, N]
    # accumulate in float32 at least (bf16 sums of long bins lose digits)
    acc = torch.promote_types(x.dtype, torch.float32)
    weights = inside.to(acc) / (ends - starts).clamp(min=1).to(acc)[..., None]
    with torch.autocast(x.device.type, enabled=False):
        pooled = weights[:, None] @ x.to(acc)  # [B, H, bins, D]
    return pooled.to(x.dtype), bin_mask
