"""Top-k selection, the PyTorch form: torch.topk along the last dim, in no order."""
from __future__ import annotations

from typing import Tuple

import torch


def topk_unsorted(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along the last dim and their indices, in no order. [..., n] -> [..., k] x 2."""
    return x.topk(k, dim=-1, sorted=False)
