"""TTT's dual form on a compiled C kernel for the CPU (csrc/ttt_cpu.c), float32.

The PyTorch dual form (dual.py) runs the recurrence over mini-batches as a Python loop of small
matmuls, N / 16 of them, each a dozen torch operations forward and as many backward: at LRA widths
([16, 32] x [32, 32] per head) per-operation overhead, not arithmetic, sets its time. The kernel runs
a (batch, head) group's whole sequence in C, forward and backward: each mini-batch's step sizes and
targets, the recurrence, the output's layer norm and residual. The forward keeps what the backward
reads: the state each mini-batch starts from and the mini-batch's products (its pre-norm outputs, and
for TTT-MLP the hidden layer's inputs and the like: saved_size), so the backward repeats no matmul of
the forward. Left to PyTorch: each key's learning rate (the gate) and
the factor per place, whose gradients the kernel returns. Same outputs and gradients as dual.py
(tests/test_ttt_cpu.py). The kernel is the torch.library operator ``lra::ttt_forward`` (its backward
``lra::ttt_backward``).
"""

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch
from torch.library import custom_op, register_autograd, register_fake

from .. import native

LIBRARY = "ttt_cpu"
_i64, _ptr_t = ctypes.c_int64, ctypes.c_void_p


class Args(ctypes.Structure):
    """The kernel's argument block (``TTT`` in ttt_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("G", "M", "K", "D", "E", "threads")] + [("eps", ctypes.c_double)] + [
        (name, _ptr_t) for name in ("q", "k", "v", "lr", "ts", "w0", "lnw", "lnb", "out", "states", "saved",
                                    "dout", "dq", "dk", "dv", "dlr", "dts", "dw0", "dlnw", "dlnb")]


SIGNATURES: native.Signatures = {"ttt_forward": ([ctypes.POINTER(Args)], ctypes.c_int),
                                 "ttt_backward": ([ctypes.POINTER(Args)], ctypes.c_int),
                                 "ttt_saved_size": ([_i64, _i64, _i64], _i64),
                                 "ttt_state_size": ([_i64, _i64], _i64)}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(x: torch.Tensor) -> List[str]:
    """Why the kernel does not take tensors like ``x`` (float32 CPU tensors, once built here); [] when it does."""
    return native.refusals(x, LIBRARY)


def state_size(d: int, hidden: int) -> int:
    """Floats in one group's state: [W D x D, b D] (hidden 0, the linear model) or [W1, b1, W2, b2]."""
    return d * d + d if hidden == 0 else 2 * d * hidden + hidden + d


def saved_size(size: int, d: int, hidden: int) -> int:
    """Floats the forward keeps per mini-batch of ``size`` tokens for the backward (ttt_cpu.c saved_size):
    the pre-norm outputs and the products the backward reads."""
    return 2 * size * d if hidden == 0 else 2 * size * d + 3 * size * hidden + size * size


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _args(q, k, v, lr, ts, lnw, lnb, eps: float, hidden: int) -> Args:
    g, m, size, d = q.shape
    return Args(G=g, M=m, K=size, D=d, E=hidden, threads=torch.get_num_threads(), eps=eps, q=_ptr(q), k=_ptr(k),
                v=_ptr(v), lr=_ptr(lr), ts=_ptr(ts), lnw=_ptr(lnw), lnb=_ptr(lnb))


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the TTT CPU kernel could not allocate its per-thread buffers")


@custom_op("lra::ttt_forward", mutates_args=(), device_types="cpu")
def ttt_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, ts: torch.Tensor,
                w0: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, eps: float, hidden: int,
                keep_states: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dual form's outputs q + LN(z) [G, M, K, D] over contiguous float32 q, k, v [G, M, K, D] (G groups
    of M mini-batches of K tokens), each key's learning rate lr [G, M, K], the factor per place ts [K],
    initial states w0 [G, S] (state_size) and the inner layer norm's lnw, lnb [G, D]; and, with
    ``keep_states`` (for the backward), the state each mini-batch starts from [G, M, S] and what its
    backward reads [G, M, saved_size] (else empty tensors)."""
    # (named: the tensor a pointer is taken of must outlive the call)
    q, k, v, lr, ts, w0, lnw, lnb = (x.contiguous() for x in (q, k, v, lr, ts, w0, lnw, lnb))
    out, states, saved = _new_outputs(q, hidden, keep_states)
    args = _args(q, k, v, lr, ts, lnw, lnb, eps, hidden)
    args.w0, args.out = _ptr(w0), _ptr(out)
    args.states, args.saved = (_ptr(states), _ptr(saved)) if keep_states else (None, None)
    _check(library().ttt_forward(ctypes.byref(args)))
    return out, states, saved


def _new_outputs(q: torch.Tensor, hidden: int, keep_states: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, m, size, d = q.shape
    if not keep_states:
        return q.new_empty(q.shape), q.new_empty(0), q.new_empty(0)
    return (q.new_empty(q.shape), q.new_empty(g, m, state_size(d, hidden)),
            q.new_empty(g, m, saved_size(size, d, hidden)))


@register_fake("lra::ttt_forward")
def _(q, k, v, lr, ts, w0, lnw, lnb, eps, hidden, keep_states):
    return _new_outputs(q, hidden, keep_states)


Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
              torch.Tensor]


@custom_op("lra::ttt_backward", mutates_args=(), device_types="cpu")
def ttt_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, ts: torch.Tensor,
                 lnw: torch.Tensor, lnb: torch.Tensor, states: torch.Tensor, saved: torch.Tensor,
                 dout: torch.Tensor, eps: float, hidden: int) -> Grads:
    """d q, d k, d v, d lr, d ts [G, K] (per group), d w0, d lnw, d lnb of ``ttt_forward`` (given the
    states and saved products it kept) for d out [G, M, K, D]: new tensors."""
    # (named: the tensor a pointer is taken of must outlive the call)
    q, k, v, lr, ts, lnw, lnb, states, saved = (x.contiguous() for x in (q, k, v, lr, ts, lnw, lnb, states, saved))
    dout = dout.to(torch.float32).contiguous()
    grads = _new_grads(q, k, v, lr, ts, lnw, lnb, states)
    args = _args(q, k, v, lr, ts, lnw, lnb, eps, hidden)
    args.states, args.saved, args.dout = _ptr(states), _ptr(saved), _ptr(dout)
    args.dq, args.dk, args.dv, args.dlr, args.dts, args.dw0, args.dlnw, args.dlnb = (_ptr(x) for x in grads)
    _check(library().ttt_backward(ctypes.byref(args)))
    return grads


def _new_grads(q, k, v, lr, ts, lnw, lnb, states) -> Grads:
    g = q.shape[0]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lr.new_empty(lr.shape),
            q.new_empty(g, ts.shape[0]), q.new_empty(g, states.shape[-1]), lnw.new_empty(lnw.shape),
            lnb.new_empty(lnb.shape))


@register_fake("lra::ttt_backward")
def _(q, k, v, lr, ts, lnw, lnb, states, saved, dout, eps, hidden):
    return _new_grads(q, k, v, lr, ts, lnw, lnb, states)


def _setup(ctx, inputs, output) -> None:
    q, k, v, lr, ts, _w0, lnw, lnb, ctx.eps, ctx.hidden, keep_states = inputs
    if not keep_states:
        raise RuntimeError("lra::ttt_forward was called with keep_states=False under autograd; its backward "
                           "needs the states")
    ctx.save_for_backward(q, k, v, lr, ts, lnw, lnb, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _grad(ctx, dout: Optional[torch.Tensor], _dstates, _dsaved):
    if dout is None:
        return (None,) * 11
    q, k, v, lr, ts, lnw, lnb, states, saved = ctx.saved_tensors
    dq, dk, dv, dlr, dts, dw0, dlnw, dlnb = ttt_backward(q, k, v, lr, ts, lnw, lnb, states, saved, dout, ctx.eps,
                                                         ctx.hidden)
    return dq, dk, dv, dlr, dts.sum(0), dw0, dlnw, dlnb, None, None, None


register_autograd("lra::ttt_forward", _grad, setup_context=_setup)


def _groups(x: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, N, ...] -> [B H, M, size, ...] contiguous, zeros appended to the last mini-batch."""
    b, h, n = x.shape[:3]
    m = -(-n // size)
    if m * size != n:
        x = torch.cat([x, x.new_zeros(b, h, m * size - n, *x.shape[3:])], dim=2)
    return x.reshape(b * h, m, size, *x.shape[3:]).contiguous()


def dual_form_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Sequence[torch.Tensor],
                  ln_weight: torch.Tensor, ln_bias: torch.Tensor, lr: torch.Tensor, token_scale: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """dual.dual_form on the kernel: the same arguments (float32 CPU tensors, ``refusals`` empty) and outputs."""
    b, h, n, d = q.shape
    size = token_scale.shape[0]
    hidden = 0 if len(state) == 2 else state[0].shape[-1]
    # one flat state per head, [W1, b1(, W2, b2)], as many copies as the batch
    w0 = torch.cat([w.reshape(h, -1) for w in state], dim=1).expand(b, h, -1).reshape(b * h, -1)  # [G, S]
    lnw, lnb = (x.reshape(h, d).expand(b, h, d).reshape(b * h, d) for x in (ln_weight, ln_bias))  # [G, D]
    keep = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, lr, token_scale, ln_weight,
                                                                       ln_bias, *state))
    out, _, _ = ttt_forward(*(_groups(x, size) for x in (q, k, v, lr)), token_scale.contiguous(), w0, lnw, lnb, eps,
                            hidden, keep)  # [G, M, K, D]
    return out.view(b, h, -1, d)[:, :, :n]  # [B, H, N, D]
