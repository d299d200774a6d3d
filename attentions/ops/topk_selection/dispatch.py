"""Which form of top-k selection runs: the C kernel (cpu.py) for inputs it takes, torch.topk
(reference.py) for the rest; ``refusals`` says why the kernel is not taken."""
from __future__ import annotations

from typing import List, Tuple

import torch

from . import cpu, reference


def refusals(x: torch.Tensor, k: int) -> List[str]:
    """Why the kernel does not select ``k`` of the last dim of ``x``; [] when it does."""
    reasons = cpu.refusals(x)
    n = x.shape[-1]
    if not 1 <= k < n:
        reasons.append(f"the kernel selects 1 <= k < n of n values, not k = {k} of {n}")
    if x.requires_grad:
        reasons.append("the kernel's selection is not differentiable (select under no_grad)")
    return reasons


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes tensors like ``x`` (float32 on the CPU, built here), for some k."""
    return not cpu.refusals(x)


def topk_unsorted(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along the last dim and their indices, in no order. [..., n] -> [..., k] x 2.
    Not differentiable on the kernel (the backends select under no_grad and keep the indices)."""
    if refusals(x, k):
        return reference.topk_unsorted(x, k)
    return cpu.topk_rows(x, k)
