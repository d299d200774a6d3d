"""Dropout whose CPU path is a compiled C kernel (dropout_cpu.c); elsewhere torch's own.

torch's CPU dropout draws a Bernoulli variable per element from a Mersenne twister: in the LRA
encoder at N = 2K (batch 8, 7 dropout layers) that took 150 ms of a 510 ms MiTA training step and
of full attention's too, time that says nothing about attention. The kernel keeps element i when
a hash of (seed, i) clears p 2^32, with one 64-bit seed per call drawn from torch's default
generator: ``torch.manual_seed`` makes runs repeat, a checkpoint's RNG state resumes them, and the
mask does not depend on the thread count. The backward applies the same mask to the gradient from
the seed alone. The masks are not torch's (a run with the kernel and one without draw different
dropout patterns); keep-rate and scaling are the same, 1 - p and 1 / (1 - p).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attentions.ops import native

LIBRARY = "dropout_cpu"
FOLDER = Path(__file__).resolve().parent


def library() -> Optional[ctypes.CDLL]:
    lib = native.load(LIBRARY, FOLDER)
    if lib is not None and not hasattr(lib, "_typed"):
        lib.dropout_apply.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
                                      ctypes.c_uint32, ctypes.c_float, ctypes.c_int64]
        lib.dropout_apply.restype = None
        lib._typed = True
    return lib


def fits(x: torch.Tensor, p: float) -> bool:
    """Whether the kernel takes this call: float32 on the CPU, 0 < p < 1, the kernel built here."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and 0.0 < p < 1.0 and library() is not None


def _apply(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    threshold = min(int(round(p * 2.0**32)), 2**32 - 1)
    library().dropout_apply(x.data_ptr(), out.data_ptr(), x.numel(), seed, threshold, 1.0 / (1.0 - p),
                            torch.get_num_threads())
    return out


class DropoutCPU(torch.autograd.Function):
    """x * keep / (1 - p), the mask a function of (seed, element index); float32 CPU tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        return _apply(x, seed, p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _apply(grad.to(torch.float32), ctx.seed, ctx.p), None, None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), on the kernel where it takes the call."""
    if not training or p == 0.0:
        return x
    if not fits(x, p):
        return F.dropout(x, p, training)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))  # from torch's default generator
    return DropoutCPU.apply(x, p, seed)


class Dropout(nn.Dropout):
    """nn.Dropout (same arguments, state and repr) whose CPU float32 path is the C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)
