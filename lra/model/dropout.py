"""Dropout whose CPU path is a compiled C kernel (attentions/csrc/dropout_cpu.c); elsewhere torch's own.

torch's CPU dropout draws a Bernoulli variable per element from a Mersenne twister: in the LRA
encoder at N = 2K (batch 8, 7 dropout layers) that took 150 ms of a 510 ms MiTA training step and
of full attention's too, time that says nothing about attention. The kernel keeps element i when
a hash of (seed, i) clears p 2^32, with one 64-bit seed per call drawn from torch's default
generator: ``torch.manual_seed`` makes runs repeat, a checkpoint's RNG state resumes them, and the
mask does not depend on the thread count. The backward applies the same mask to the gradient from
the seed alone. The kernel is the torch.library operator ``lra::dropout``, which torch.compile
traces; eager calls take the same kernel through an autograd Function (DropoutFunction), without
the operator's dispatch. The masks are not torch's (a run with the kernel and one without draw
different dropout patterns); keep-rate and scaling are the same, 1 - p and 1 / (1 - p).
"""

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.library import custom_op, register_autograd, register_fake

from attentions.ops import native

LIBRARY = "dropout_cpu"


SIGNATURES: native.Signatures = {
    "dropout_apply": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32,
                       ctypes.c_float, ctypes.c_int64], None),
}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def fits(x: torch.Tensor, p: float) -> bool:
    """Whether the kernel takes this call: float32 on the CPU, 0 < p < 1, the kernel built here."""
    return 0.0 < p < 1.0 and not native.refusals(x, LIBRARY)


def threshold(p: float) -> int:
    """The hash value below which an element is dropped with probability p: p 2^32 (0: none)."""
    return min(int(round(p * 2.0**32)), 2**32 - 1)


def draw_seed() -> torch.Tensor:
    """A call's mask seed, a 0-dim int64 tensor from torch's default generator."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


def _apply(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The kernel's x * keep / (1 - p) for float32 CPU x (0 < p < 1), the mask of ``seed``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    library().dropout_apply(x.data_ptr(), out.data_ptr(), x.numel(), seed, threshold(p), 1.0 / (1.0 - p),
                            torch.get_num_threads())
    return out


@custom_op("lra::dropout", mutates_args=(), device_types="cpu")
def dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """x * keep / (1 - p), the mask a function of (seed, element index): float32 CPU x, 0 < p < 1, seed
    a 0-dim int64 tensor (a tensor, so that torch.compile draws it in its graph)."""
    return _apply(x, p, int(seed))


@register_fake("lra::dropout")
def _(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


def _grad(ctx, grad: torch.Tensor):
    (seed,) = ctx.saved_tensors
    # the backward applies the forward's mask: the same seed
    return dropout_op(grad.to(torch.float32), ctx.p, seed), None, None


register_autograd("lra::dropout", _grad, setup_context=_setup)


class DropoutFunction(torch.autograd.Function):
    """The operator's forward and backward outside torch.compile: the same kernel calls without the
    operator's dispatch, which cost about 150 µs of each call's forward and backward, as much as the
    kernel's own time at the encoder's [8, 1024, 64] (Intel Xeon, 2 threads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        return _apply(x, p, seed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the forward's mask: the same seed
        return _apply(grad.to(torch.float32), ctx.p, ctx.seed), None, None


def reference_keep(n: int, p: float, seed: int) -> torch.Tensor:
    """The kernel's mask of n elements, computed plainly (int64 tensors, each 32-bit operation masked):
    element i is kept when mix(mix(lo(i) * W ^ s0) ^ (s1 + hi(i))) >= p 2^32, mix the "lowbias32"
    multiply-xorshift round, W the Weyl constant, s0, s1 the seed's two 32-bit words. [n] bool."""
    word = 0xFFFFFFFF

    def mix(h: torch.Tensor) -> torch.Tensor:
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & word  # a product past 2^63 wraps in int64; its low 32 bits stay right
        h = h ^ (h >> 15)
        h = (h * 0x846CA68B) & word
        return h ^ (h >> 16)

    index = torch.arange(n, dtype=torch.int64)
    s0, s1 = seed & word, (seed >> 32) & word
    weyl = ((index & word) * 0x9E3779B9) & word
    bits = mix(mix(weyl ^ s0) ^ ((s1 + (index >> 32)) & word))
    return bits >= threshold(p)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), on the kernel where it takes the call."""
    if not training or p == 0.0:
        return x
    if not fits(x, p):
        return F.dropout(x, p, training)
    seed = draw_seed()
    if torch.compiler.is_compiling():
        return dropout_op(x, p, seed)
    return DropoutFunction.apply(x, p, int(seed))


class Dropout(nn.Dropout):
    """nn.Dropout (same arguments, state and repr) whose CPU float32 path is the C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)
