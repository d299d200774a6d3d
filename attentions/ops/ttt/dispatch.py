"""Which form of TTT's dual form runs: the backends' ``kernel`` setting, the device and the dtype
(``refusals``: the reasons the C kernel is not taken, as xformers' not_supported_reasons).

Forms: "torch" (dual.py, any device and dtype) and "cpu" (cpu.py, the C kernel: float32 CPU tensors,
where a C compiler builds it; other inputs it hands to the PyTorch form). "auto" is the C kernel on
the CPU where it builds, else PyTorch.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from ...base import AttentionError
from .. import native
from . import cpu
from .cpu import dual_form_cpu
from .dual import dual_form

KERNELS = ("auto", "torch", "cpu")


def refusals(x: torch.Tensor) -> List[str]:
    """Why the C kernel does not take tensors like ``x``; [] when it does."""
    return cpu.refusals(x)


def check_kernel(kernel: str, backend: str) -> None:
    """Raise an AttentionError for an unknown ``kernel`` setting, or 'cpu' where the kernel cannot be built."""
    if kernel not in KERNELS:
        raise AttentionError(f"{backend} kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "cpu":
        native.check_buildable(cpu.LIBRARY, backend)


def pick_dual(kernel: str, x: torch.Tensor) -> Callable:
    """The dual form that ``kernel`` (checked by check_kernel) runs for inputs like ``x``: the C kernel where
    it is asked for (or "auto") and takes them, else the PyTorch form."""
    if kernel == "cpu" and x.device.type != "cpu":
        raise AttentionError(f"kernel='cpu' runs on CPU tensors, these are on {x.device.type}; use kernel='auto'")
    if kernel in ("auto", "cpu") and not refusals(x):
        return dual_form_cpu
    return dual_form


def kernel_name(kernel: str, device: torch.device) -> str:
    """"cpu" or "torch": the dual form that ``kernel`` runs for float32 tensors on ``device`` (records name it)."""
    probe = torch.empty(0, device=device) if device.type == "cpu" else None
    return "cpu" if probe is not None and kernel in ("auto", "cpu") and not refusals(probe) else "torch"
