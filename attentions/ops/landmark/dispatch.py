"""Which form of MiTA's landmark operators runs: the C kernels (cpu.py) where a backend asks for
them (its grouped kernel is the C one) and they take the inputs, else the PyTorch forms
(reference.py); ``refusals`` says why the kernels are not taken."""
from __future__ import annotations

from typing import List

import torch

from . import cpu


def refusals(q: torch.Tensor) -> List[str]:
    """Why the landmark kernels do not take tensors like ``q``; [] when they do."""
    return cpu.refusals(q)


def takes(q: torch.Tensor) -> bool:
    """Whether the landmark kernels take tensors like ``q`` (float32 on the CPU, built here)."""
    return not cpu.refusals(q)
