"""Whether the row-product kernels (cpu.py) take an input; where they do not, the callers keep their
PyTorch form (Top-k attention's dense rows, topk.TopKChunk). ``refusals`` says why."""
from __future__ import annotations

from typing import List

import torch

from . import cpu


def refusals(x: torch.Tensor) -> List[str]:
    """Why the row-product kernels do not take tensors like ``x``; [] when they do."""
    return cpu.refusals(x)


def takes(x: torch.Tensor) -> bool:
    """Whether the row-product kernels take tensors like ``x`` (float32 on the CPU, built here)."""
    return not cpu.refusals(x)
