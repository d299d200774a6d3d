"""Which form of grouped routed attention runs: the backends' ``kernel`` setting, the device, and what
each form takes (``refusals``: the reasons a form is not taken, as xformers' not_supported_reasons).

Forms: "torch" (reference.py, any device and dtype), "cpu" (cpu.py, the C kernel: float32 CPU
tensors, where a C compiler builds it; other inputs it hands to the PyTorch form), "triton"
(triton_op.py: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). "auto" is Triton on CUDA
when Triton is installed: on an NVIDIA H200 the kernels passed scripts/device_check.py and ran
MiTA's attention 1.4x-5.4x faster than the PyTorch form from 16K to 256K tokens
(results/throughput/attention-nvidia-h200-*); on the CPU it is the C kernel where it builds, else
PyTorch.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from ...base import AttentionError
from .. import native
from . import cpu, triton_op
from .cpu import grouped_attention_cpu
from .reference import grouped_attention
from .triton_op import grouped_attention_triton, triton_installed

KERNELS = ("auto", "torch", "triton", "cpu")


def refusals(q: torch.Tensor) -> Dict[str, List[str]]:
    """Each form's reasons for not taking queries like ``q`` [P, D] ([] for a form that takes them)."""
    return {"torch": [], "cpu": cpu.refusals(q), "triton": triton_op.refusals(q)}


def check_kernel(kernel: str, backend: str) -> None:
    """Raise an AttentionError for an unknown ``kernel`` setting, or one whose form cannot run here at all."""
    if kernel not in KERNELS:
        raise AttentionError(f"{backend} kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "triton" and not triton_installed():
        raise AttentionError(f"{backend} kernel='triton' needs Triton, which is not installed: pip install triton")
    if kernel == "cpu":
        native.check_buildable(cpu.LIBRARY, backend)


def pick_grouped(kernel: str, device: torch.device) -> Callable:
    """The grouped attention function of a backend's ``kernel`` setting (checked by check_kernel) for
    tensors on ``device``."""
    if kernel == "triton" or (kernel == "auto" and device.type == "cuda" and triton_installed()):
        return grouped_attention_triton
    if kernel == "cpu" and device.type != "cpu":
        raise AttentionError(f"kernel='cpu' runs on CPU tensors, these are on {device.type}; use kernel='auto'")
    if kernel == "cpu" or (kernel == "auto" and device.type == "cpu" and not cpu.refusals(torch.empty(0))):
        return grouped_attention_cpu
    return grouped_attention


def kernel_name(kernel: str, device: torch.device) -> str:
    """"triton", "cpu" or "torch": the grouped form that ``kernel`` picks on ``device`` (records name it;
    the C form hands inputs other than float32 to the PyTorch form)."""
    fn = pick_grouped(kernel, device)
    return {grouped_attention_triton: "triton", grouped_attention_cpu: "cpu"}.get(fn, "torch")
