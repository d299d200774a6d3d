"""The FFN's GELU and the dropout after it in one pass on the CPU (attentions/csrc/gelu_dropout_cpu.c);
elsewhere torch's GELU and the model's dropout (lra/model/dropout.py).

Apart, the two read and write the [B, N, FFN] activations twice in the forward and three times in
the backward. The kernel makes each block of GELU values and masks it while it is in the cache, with
the mask the dropout kernel would draw after a separate GELU (the same seed, drawn from torch's
generator as the dropout draws it, and the same hash: ``dropout.reference_keep``). GELU is x Phi(x)
with Phi from an erfc approximation (Abramowitz and Stegun 7.1.26): within 7.5e-8 |x| of the exact
GELU that torch's nn.GELU computes, not bit for bit. The operators ``lra::gelu_dropout`` and
``lra::gelu_dropout_backward`` are what torch.compile traces; eager calls take the same kernels
through an autograd Function (GELUDropoutFunction), as lra::dropout's do.
"""

import ctypes
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import custom_op, register_autograd, register_fake

from attentions.ops import native

from .dropout import draw_seed, dropout, reference_keep, threshold

LIBRARY = "gelu_dropout_cpu"

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: native.Signatures = {
    "gelu_dropout_forward": ([_p, _p, _i64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float, _i64], None),
    "gelu_dropout_backward": ([_p, _p, _p, _i64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float, _i64], None),
}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def fits(x: torch.Tensor, p: float) -> bool:
    """Whether the kernel takes this call: float32 on the CPU, 0 <= p < 1, the kernel built here."""
    return 0.0 <= p < 1.0 and not native.refusals(x, LIBRARY)


def _mask(p: float):
    """The kernel's threshold and scale for dropout probability p (0: keep every element)."""
    return threshold(p), 1.0 / (1.0 - p)


def _forward(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    library().gelu_dropout_forward(x.data_ptr(), out.data_ptr(), x.numel(), seed, *_mask(p), torch.get_num_threads())
    return out


def _backward(d_out: torch.Tensor, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    d_out = d_out.to(torch.float32).contiguous()
    dx = torch.empty_like(x)
    library().gelu_dropout_backward(d_out.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel(), seed, *_mask(p),
                                    torch.get_num_threads())
    return dx


@custom_op("lra::gelu_dropout", mutates_args=(), device_types="cpu")
def gelu_dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """dropout(gelu(x), p) with the mask of ``seed`` (a 0-dim int64 tensor) for float32 CPU x, 0 <= p < 1
    (p = 0: gelu(x))."""
    return _forward(x, p, int(seed))


@register_fake("lra::gelu_dropout")
def _(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("lra::gelu_dropout_backward", mutates_args=(), device_types="cpu")
def gelu_dropout_backward(d_out: torch.Tensor, x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gelu_dropout_op``'s output for d_out, at its input x (contiguous)."""
    return _backward(d_out, x, p, int(seed))


@register_fake("lra::gelu_dropout_backward")
def _(d_out, x, p, seed):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    x, ctx.p, seed = inputs
    ctx.save_for_backward(x.contiguous(), seed)


def _grad(ctx, d_out: torch.Tensor):
    x, seed = ctx.saved_tensors
    return gelu_dropout_backward(d_out, x, ctx.p, seed), None, None


register_autograd("lra::gelu_dropout", _grad, setup_context=_setup)


class GELUDropoutFunction(torch.autograd.Function):
    """The operator's forward and backward outside torch.compile: the same kernel calls without the
    operator's dispatch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        x = x.contiguous()
        ctx.p, ctx.seed = p, seed
        ctx.save_for_backward(x)
        return _forward(x, p, seed)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return _backward(d_out, x, ctx.p, ctx.seed), None, None


def gelu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """dropout(F.gelu(x), p, training), the exact GELU's form: on the kernel where it takes the call,
    else torch's GELU and the model's dropout (the same draws from torch's generator either way)."""
    if not training:
        p = 0.0
    if not fits(x, p):
        return dropout(F.gelu(x), p, training)
    # one seed, drawn as the dropout draws it (none when nothing is dropped)
    seed = draw_seed() if p > 0.0 else torch.zeros((), dtype=torch.int64)
    if torch.compiler.is_compiling():
        return gelu_dropout_op(x, p, seed)
    return GELUDropoutFunction.apply(x, p, int(seed))


def reference(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The kernel's result computed plainly: the exact GELU (float64 erf) of x, masked by
    dropout.reference_keep and scaled, in float64."""
    x64 = x.double()
    out = x64 * 0.5 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))
    if p > 0.0:
        keep = reference_keep(x.numel(), p, seed).view(x.shape)
        out = out * keep / (1.0 - p)
    return out
