"""Which form of MoBA's gate runs: the C kernel (cpu.py) where a backend asks for it (its grouped
kernel is the C one) and it takes the inputs, else the PyTorch form (reference.py); ``refusals``
says why the kernel is not taken."""
from __future__ import annotations

from typing import List, Tuple

import torch

from . import cpu, reference


def refusals(q: torch.Tensor, per_query: int) -> List[str]:
    """Why the kernel does not choose ``per_query`` blocks for queries like ``q``; [] when it does."""
    return cpu.refusals(q, per_query)


def choose_blocks(q: torch.Tensor, means: torch.Tensor, empty: torch.Tensor, block_size: int, per_query: int,
                  include_own: bool, kernel: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``per_query`` best blocks and whether each holds a real key (reference.choose_blocks);
    on the C kernel when ``kernel`` and it takes the inputs (its choice comes best first)."""
    if kernel and not refusals(q, per_query):
        return cpu.choose_blocks_cpu(q, means, empty, block_size, per_query, include_own)
    return reference.choose_blocks(q, means, empty, block_size, per_query, include_own)
