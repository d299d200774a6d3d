"""LayerNorm whose CPU path is a compiled C kernel (attentions/csrc/layer_norm_cpu.c); elsewhere torch's own.

torch's CPU layer norm takes 4-5 times as long as one pass over its rows at the encoder's shapes
([B N, 64] rows): the forward and backward of the encoder's five layer norms cost 3.7 ms of a 40 ms
training step at N = 1K, batch 8, time that says nothing about attention. The kernel makes each
row's mean and variance, the normalised row and, in the backward, its gradient in one pass over
the row, and sums the weight and bias gradients per block of rows in a fixed order (the same bits
for any thread count). It is the torch.library operator ``lra::layer_norm`` (its backward
``lra::layer_norm_backward``), which torch.compile traces; eager calls take the same kernel
through an autograd Function (LayerNormFunction), without the operator's dispatch. The results
equal torch's to float rounding (the sums run in another order), not bit for bit.
"""

import ctypes
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.library import custom_op, register_autograd, register_fake

from attentions.ops import native

LIBRARY = "layer_norm_cpu"
# rows per block of the backward's weight and bias sums (BLOCK in layer_norm_cpu.c)
BLOCK = 256

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: native.Signatures = {
    "layer_norm_forward": ([_p] * 6 + [_i64, _i64, ctypes.c_float, _i64], None),
    "layer_norm_backward": ([_p] * 9 + [_i64, _i64, _i64], None),
}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def fits(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> bool:
    """Whether the kernel takes this call: float32 CPU input, weight and bias (float32), the kernel built
    here."""
    return (weight is not None and bias is not None and weight.dtype == bias.dtype == torch.float32
            and not native.refusals(x, LIBRARY))


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
             eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's forward of contiguous x: y, mean and rstd (see layer_norm_op)."""
    c = x.shape[-1]
    rows = x.numel() // c if c else 0
    y, mean, rstd = torch.empty_like(x), x.new_empty(rows), x.new_empty(rows)
    if rows:
        library().layer_norm_forward(x.data_ptr(), weight.contiguous().data_ptr(), bias.contiguous().data_ptr(),
                                     y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, c, eps,
                                     torch.get_num_threads())
    return y, mean, rstd


@custom_op("lra::layer_norm", mutates_args=(), device_types="cpu")
def layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """F.layer_norm over the last dim C of x (float32 CPU) with weight, bias [C]: y (x's shape,
    contiguous) and each row's mean and 1 / sqrt(var + eps) [rows], which the backward reads."""
    return _forward(x.contiguous(), weight, bias, eps)


@register_fake("lra::layer_norm")
def _(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows), x.new_empty(rows)


def _backward(d_y: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward of contiguous d_y and x (see layer_norm_backward)."""
    c = x.shape[-1]
    rows = x.numel() // c if c else 0
    dx, d_weight, d_bias = torch.empty_like(x), x.new_empty(c), x.new_empty(c)
    partial = x.new_empty(2 * c * ((rows + BLOCK - 1) // BLOCK))  # each block's sums, filled by the kernel
    if rows:
        library().layer_norm_backward(d_y.data_ptr(), x.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                                      weight.contiguous().data_ptr(), dx.data_ptr(), d_weight.data_ptr(),
                                      d_bias.data_ptr(), partial.data_ptr(), rows, c, torch.get_num_threads())
    else:
        d_weight.zero_(), d_bias.zero_()
    return dx, d_weight, d_bias


@custom_op("lra::layer_norm_backward", mutates_args=(), device_types="cpu")
def layer_norm_backward(d_y: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``layer_norm_op``'s y for d_y: dx (x's shape), d weight and d bias [C]."""
    return _backward(d_y.contiguous(), x.contiguous(), mean, rstd, weight)


@register_fake("lra::layer_norm_backward")
def _(d_y, x, mean, rstd, weight):
    c = x.shape[-1]
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(c), x.new_empty(c)


def _setup(ctx, inputs, output) -> None:
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    # mean and rstd are for the backward only: autograd makes no zero gradients for them
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _grad(ctx, d_y: Optional[torch.Tensor], _d_mean, _d_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if d_y is None:
        return None, None, None, None
    dx, d_weight, d_bias = layer_norm_backward(d_y.to(torch.float32), x, mean, rstd, weight)
    return dx, d_weight, d_bias, None


register_autograd("lra::layer_norm", _grad, setup_context=_setup)


class LayerNormFunction(torch.autograd.Function):
    """The operator's forward and backward outside torch.compile: the same kernel calls without the
    operator's dispatch (about 150 µs of a call's forward and backward, as for lra::dropout)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        y, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, d_y: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        return (*_backward(d_y.to(torch.float32).contiguous(), x, mean, rstd, weight), None)


def layer_norm(x: torch.Tensor, normalized_shape: Tuple[int, ...], weight: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """F.layer_norm(x, normalized_shape, weight, bias, eps), on the kernel where it takes the call (one
    normalised dimension, weight and bias)."""
    if len(normalized_shape) != 1 or not fits(x, weight, bias):
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    if torch.compiler.is_compiling():
        return layer_norm_op(x, weight, bias, eps)[0]
    return LayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same arguments, parameters, state and repr) whose CPU float32 path is the C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
