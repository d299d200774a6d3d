"""Shared test helpers."""
from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: a scale-free comparison for outputs and gradients."""
    got, ref = got.detach(), ref.detach()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def lengths_mask(lengths: list, n: int) -> torch.Tensor:
    """[B, N] bool, True for the first lengths[b] positions of row b."""
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
