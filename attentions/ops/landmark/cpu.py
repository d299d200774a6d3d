"""MiTA's landmark pass and routing on a compiled C kernel for the CPU (csrc/landmark_cpu.c), float32.

``pool_queries`` is step 1 (the landmarks: bin means of the queries over each sequence's real
tokens) without the [B, m, N] pooling matrix the PyTorch path builds and multiplies by.

``landmark_pass`` is steps 2-3 of ``mita.reference`` for the shared expert: the landmarks' scores
against every key (which the routed experts are selected from) and softmax(scores) V, with its
backward. In PyTorch that is two batched matmuls and four [B, H, m, N] passes forward (the scores,
the mask, the softmax, its copy for the backward) and five more backward; at LRA's lengths they took
about half of MiTA's step. The kernel makes one pass over the keys in L1-sized blocks and keeps only
the scores and one log-sum-exp per landmark. ``route_best`` is step 4 for one expert per query:
q . L_j and the argmax in one pass, without the [B, H, N, m] gate tensor; ``route_order`` adds the
grouping of the queries by expert that the grouped kernel takes (a counting sort in the same call,
instead of the expert numbers, a sort, a count and two permutations in PyTorch).

Each gives its PyTorch form's results (reference.py) up to float rounding (tests/test_landmark_cpu.py);
other dtypes and devices, and machines where the kernel cannot be built, keep the PyTorch forms
(``refusals`` says why). The kernels' entries are torch.library operators (``lra::pool_bins``,
``lra::landmark_forward``, ``lra::route_best``, their backwards), with fake implementations for
torch.compile and autograd over saved tensors.
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch.library import custom_op, register_autograd, register_fake

from ... import masking
from .. import native

LIBRARY = "landmark_cpu"
_i64, _ptr_t = ctypes.c_int64, ctypes.c_void_p


class Landmarks(ctypes.Structure):
    """The kernel's argument block (``Landmarks`` in landmark_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("G", "m", "N", "D", "heads", "threads", "accumulate")] + [
        (name, _ptr_t) for name in (
            "marks", "keys", "values", "key_ok", "scores", "lse", "shared", "dshared", "dmarks", "dkeys", "dvalues")]


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(q: torch.Tensor) -> List[str]:
    """Why the kernels do not take tensors like ``q`` (they take float32 CPU tensors, once built here);
    [] when they do."""
    return native.refusals(q, LIBRARY)



def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the landmark CPU kernel could not allocate its per-thread buffers")


class Pool(ctypes.Structure):
    """The pooling kernel's argument block (``Pool`` in landmark_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("G", "m", "N", "D", "heads", "threads", "backward", "accumulate")] + [
        (name, _ptr_t) for name in ("starts", "ends", "x", "dout", "out", "dx")]


SIGNATURES: native.Signatures = {
    "landmark_forward": ([ctypes.POINTER(Landmarks)], ctypes.c_int),
    "landmark_backward": ([ctypes.POINTER(Landmarks)], ctypes.c_int),
    "route_best": ([ctypes.POINTER(Landmarks), _ptr_t, _ptr_t, _ptr_t], ctypes.c_int),
    "route_order": ([ctypes.POINTER(Landmarks)] + [_ptr_t] * 7, ctypes.c_int),
    "pool_bins": ([ctypes.POINTER(Pool)], ctypes.c_int),
}


def pool_block(starts: torch.Tensor, ends: torch.Tensor, heads: int, g: int, n: int, d: int) -> Pool:
    return Pool(G=g, m=starts.shape[1], N=n, D=d, heads=heads, threads=torch.get_num_threads(), starts=_ptr(starts),
                ends=_ptr(ends))


@custom_op("lra::pool_bins", mutates_args=(), device_types="cpu")
def pool_bins(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, heads: int) -> torch.Tensor:
    """Bin means of x [G, N, D] (contiguous float32) over bins [start, end) per sequence (starts, ends
    [G / heads, m] long) -> [G, m, D]."""
    g, n, d = x.shape
    out = x.new_empty(g, starts.shape[1], d)
    args = pool_block(starts, ends, heads, g, n, d)
    args.backward, args.x, args.out = 0, _ptr(x), _ptr(out)
    _check(library().pool_bins(ctypes.byref(args)))
    return out


@register_fake("lra::pool_bins")
def _(x, starts, ends, heads):
    return x.new_empty(x.shape[0], starts.shape[1], x.shape[2])


@custom_op("lra::pool_bins_backward_add", mutates_args=("dx",), device_types="cpu")
def pool_bins_backward_add(d_out: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, heads: int,
                           dx: torch.Tensor) -> None:
    """Adds the gradient of ``pool_bins`` for d_out [G, m, D] into dx [G, N, D] (contiguous float32)."""
    g, n, d = dx.shape
    d_out = d_out.to(torch.float32).contiguous()
    args = pool_block(starts, ends, heads, g, n, d)
    args.backward, args.accumulate, args.dout, args.dx = 1, 1, _ptr(d_out), _ptr(dx)
    _check(library().pool_bins(ctypes.byref(args)))


@custom_op("lra::pool_bins_backward", mutates_args=(), device_types="cpu")
def pool_bins_backward(d_out: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, heads: int,
                       n: int) -> torch.Tensor:
    """The gradient of ``pool_bins`` for d_out [G, m, D]: a new [G, n, D] tensor."""
    d_out = d_out.to(torch.float32).contiguous()
    g, _, d = d_out.shape
    dx = d_out.new_empty(g, n, d)
    args = pool_block(starts, ends, heads, g, n, d)
    args.backward, args.accumulate, args.dout, args.dx = 1, 0, _ptr(d_out), _ptr(dx)
    _check(library().pool_bins(ctypes.byref(args)))
    return dx


@register_fake("lra::pool_bins_backward")
def _(d_out, starts, ends, heads, n):
    return d_out.new_empty(d_out.shape[0], n, d_out.shape[2], dtype=torch.float32)


def _pool_setup(ctx, inputs, output) -> None:
    x, starts, ends, ctx.heads = inputs
    ctx.n = x.shape[1]
    ctx.save_for_backward(starts, ends)


def _pool_grad(ctx, d_out: torch.Tensor):
    starts, ends = ctx.saved_tensors
    return pool_bins_backward(d_out, starts, ends, ctx.heads, ctx.n), None, None, None


register_autograd("lra::pool_bins", _pool_grad, setup_context=_pool_setup)


def kernel_bins(mask: Optional[torch.Tensor], b: int, n: int, bins: int, device: torch.device
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """masking.real_bins as the pooling kernel takes them: starts, ends [B, bins] (a missing bin empty,
    end == start) and which bins are real [B, bins]."""
    starts, ends, real = masking.real_bins(masking.real_lengths(mask, b, n, device), bins)  # [B, bins] each
    return starts.masked_fill(~real, 0).contiguous(), ends.masked_fill(~real, 0).contiguous(), real


def pool_queries(q: torch.Tensor, mask: Optional[torch.Tensor], bins: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """masking.pool_real on the kernel: q [B, H, N, D] pooled into ``bins`` bins laid over each
    sequence's real tokens (torch's bin rule; a sequence shorter than ``bins`` gets one bin per token
    and zeros beyond) -> landmarks [B, H, bins, D] and real bins [B, bins]."""
    b, h, n, d = q.shape
    starts, ends, real = kernel_bins(mask, b, n, bins, q.device)
    pooled = pool_bins(q.reshape(b * h, n, d).contiguous(), starts, ends, h)
    return pooled.view(b, h, bins, d), real


def landmark_block(marks, keys, values, key_ok, heads: int) -> Landmarks:
    """The kernel's argument block for these inputs (the outputs' pointers are set by the caller)."""
    g, m, d = marks.shape
    return Landmarks(G=g, m=m, N=keys.shape[1], D=d, heads=heads, threads=torch.get_num_threads(), marks=_ptr(marks),
                     keys=_ptr(keys), values=_ptr(values), key_ok=_ptr(key_ok))


@custom_op("lra::landmark_forward", mutates_args=(), device_types="cpu")
def landmark_forward(marks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_ok: Optional[torch.Tensor],
                     heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared values [G, m, D], scores [G, m, N] and each landmark's log-sum-exp [G, m] (which the
    backward reads), for pre-scaled marks [G, m, D], keys and values [G, N, D] (contiguous float32),
    key_ok [G / heads, N] uint8 or None."""
    g, m, d = marks.shape
    n = keys.shape[1]
    scores, lse, shared = marks.new_empty(g, m, n), marks.new_empty(g, m), marks.new_empty(g, m, d)
    args = landmark_block(marks, keys, values, key_ok, heads)
    args.scores, args.lse, args.shared = _ptr(scores), _ptr(lse), _ptr(shared)
    _check(library().landmark_forward(ctypes.byref(args)))
    return shared, scores, lse


@register_fake("lra::landmark_forward")
def _(marks, keys, values, key_ok, heads):
    g, m, d = marks.shape
    return marks.new_empty(g, m, d), marks.new_empty(g, m, keys.shape[1]), marks.new_empty(g, m)


def _landmark_backward(marks, keys, values, key_ok, scores, lse, shared, d_shared, heads, grads, accumulate) -> None:
    args = landmark_block(marks, keys, values, key_ok, heads)
    args.scores, args.lse, args.shared, args.accumulate = _ptr(scores), _ptr(lse), _ptr(shared), int(accumulate)
    # (named: the tensor a pointer is taken of must outlive the call)
    d_shared = d_shared.to(torch.float32).contiguous()
    args.dshared = _ptr(d_shared)
    args.dmarks, args.dkeys, args.dvalues = (_ptr(t) for t in grads)
    _check(library().landmark_backward(ctypes.byref(args)))


@custom_op("lra::landmark_backward", mutates_args=(), device_types="cpu")
def landmark_backward(marks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_ok: Optional[torch.Tensor],
                      scores: torch.Tensor, lse: torch.Tensor, shared: torch.Tensor, d_shared: torch.Tensor,
                      heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d marks [G, m, D], d keys, d values [G, N, D] of ``landmark_forward`` (given its scores, lse and
    shared values) for d_shared [G, m, D], new tensors."""
    grads = (torch.empty_like(marks), torch.empty_like(keys), torch.empty_like(values))
    _landmark_backward(marks, keys, values, key_ok, scores, lse, shared, d_shared, heads, grads, False)
    return grads


@register_fake("lra::landmark_backward")
def _(marks, keys, values, key_ok, scores, lse, shared, d_shared, heads):
    return torch.empty_like(marks), torch.empty_like(keys), torch.empty_like(values)


@custom_op("lra::landmark_backward_add", mutates_args=("d_marks", "d_keys", "d_values"), device_types="cpu")
def landmark_backward_add(marks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          key_ok: Optional[torch.Tensor], scores: torch.Tensor, lse: torch.Tensor,
                          shared: torch.Tensor, d_shared: torch.Tensor, heads: int, d_marks: torch.Tensor,
                          d_keys: torch.Tensor, d_values: torch.Tensor) -> None:
    """``landmark_backward`` added into d_marks, d_keys, d_values (contiguous float32) instead of new tensors."""
    _landmark_backward(marks, keys, values, key_ok, scores, lse, shared, d_shared, heads, (d_marks, d_keys, d_values),
                       True)


def _landmark_setup(ctx, inputs, output) -> None:
    marks, keys, values, key_ok, ctx.heads = inputs
    ctx.save_for_backward(marks, keys, values, key_ok, *output)
    # the scores feed a top-k choice only, and the log-sum-exp the backward: neither takes a gradient
    # (and no [G, m, N] zeros are made for the scores')
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _landmark_grad(ctx, d_shared: Optional[torch.Tensor], _d_scores, _d_lse):
    marks, keys, values, key_ok, shared, scores, lse = ctx.saved_tensors
    if d_shared is None:
        return None, None, None, None, None
    return (*landmark_backward(marks, keys, values, key_ok, scores, lse, shared, d_shared, ctx.heads), None, None)


register_autograd("lra::landmark_forward", _landmark_grad, setup_context=_landmark_setup)


def landmark_pass(
    marks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shared values softmax(S) V [B, H, m, D] and the scores S = marks K^T [B, H, m, N] (-inf at
    padded keys; not differentiable), for landmarks ``marks`` [B, H, m, D] already scaled by
    1 / sqrt(D). Float32 CPU tensors with the kernel built (``refusals`` empty)."""
    b, h, m, d = marks.shape
    n = k.shape[2]
    key_ok = None if mask is None else mask.contiguous().view(torch.uint8)  # [B, N]
    shared, scores, _ = landmark_forward(
        marks.reshape(b * h, m, d).contiguous(), k.reshape(b * h, n, d).contiguous(),
        v.reshape(b * h, n, d).contiguous(), key_ok, h)
    return shared.view(b, h, m, d), scores.detach().view(b, h, m, n)


@custom_op("lra::route_best", mutates_args=(), device_types="cpu")
def route_best_op(q: torch.Tensor, marks: torch.Tensor, mark_ok: Optional[torch.Tensor]) -> torch.Tensor:
    """argmax_j q . marks_j over the landmarks with mark_ok (uint8 [G, m], or None: all real), -1 where
    a head has none: q [G, N, D], marks [G, m, D] contiguous float32 -> [G, N] long."""
    g, n, d = q.shape
    best = torch.empty(g, n, dtype=torch.long)
    mark_ok = None if mark_ok is None or bool(mark_ok.all()) else mark_ok
    args = Landmarks(G=g, m=marks.shape[1], N=n, D=d, heads=1, threads=torch.get_num_threads(), marks=_ptr(marks))
    _check(library().route_best(ctypes.byref(args), _ptr(q), _ptr(mark_ok), _ptr(best)))
    return best


@register_fake("lra::route_best")
def _(q, marks, mark_ok):
    return q.new_empty(q.shape[0], q.shape[1], dtype=torch.long)


def route_best(q: torch.Tensor, marks: torch.Tensor, real_marks: Optional[torch.Tensor]) -> torch.Tensor:
    """Each query's best real landmark: argmax_j q . marks_j over the landmarks with real_marks
    (the first of equal values), -1 where a head has none. q [G, N, D], marks [G, m, D],
    real_marks [G, m] bool or None (all real) -> [G, N] long."""
    mark_ok = None if real_marks is None else real_marks.contiguous().view(torch.uint8)
    return route_best_op(q.detach().contiguous(), marks.detach().contiguous(), mark_ok)


@custom_op("lra::route_order", mutates_args=(), device_types="cpu")
def route_order_op(q: torch.Tensor, marks: torch.Tensor, mark_ok: Optional[torch.Tensor], sort_rows: bool = True,
                   token_ok: Optional[torch.Tensor] = None, heads: int = 1
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_best_op's routes as the grouping of the queries by expert: order [G N], offsets [G m + 1],
    inverse [G N] (long) and the queries in that order [G N, D] (see ``route_order``); without
    ``sort_rows``, inverse [0] and the queries [0, D] (not made); token_ok [G / heads, N] uint8: the
    padded queries in no expert."""
    g, n, d = q.shape
    m = marks.shape[1]
    rows = g * n if sort_rows else 0
    mark_ok = None if mark_ok is None or bool(mark_ok.all()) else mark_ok
    best, order, inverse = (torch.empty(size, dtype=torch.long) for size in (g * n, g * n, rows))
    offsets = torch.empty(g * m + 1, dtype=torch.long)
    ordered = q.new_empty(rows, d)
    args = Landmarks(G=g, m=m, N=n, D=d, heads=heads, threads=torch.get_num_threads(), marks=_ptr(marks),
                     key_ok=_ptr(token_ok))
    _check(library().route_order(ctypes.byref(args), _ptr(q), _ptr(mark_ok), _ptr(best), _ptr(order), _ptr(offsets),
                                 _ptr(inverse) if sort_rows else None, _ptr(ordered) if sort_rows else None))
    return order, offsets, inverse, ordered


@register_fake("lra::route_order")
def _(q, marks, mark_ok, sort_rows=True, token_ok=None, heads=1):
    g, n, d = q.shape
    rows = g * n if sort_rows else 0
    return (q.new_empty(g * n, dtype=torch.long), q.new_empty(g * marks.shape[1] + 1, dtype=torch.long),
            q.new_empty(rows, dtype=torch.long), q.new_empty(rows, d))


def route_order(q: torch.Tensor, marks: torch.Tensor, real_marks: Optional[torch.Tensor], sort_rows: bool = True,
                mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query routed to its best real landmark (``route_best``) and the queries grouped by the
    expert that makes, g m + j for landmark j of head g, as grouped.reference.expert_runs groups
    them (stable; the queries of a head with no real landmark last): order [G N] (query rows in
    expert order), offsets [G m + 1] (expert x owns order[offsets[x]:offsets[x + 1]]), inverse
    [G N] (each query's position in order) and the queries in that order [G N, D]. q [G, N, D],
    marks [G, m, D], real_marks [G, m] bool or None (all real). Without ``sort_rows`` inverse and the
    sorted queries are empty (not made). With ``mask`` [G / heads, N] bool (True = real) the padded
    queries join no expert, as those of a head with no real landmark."""
    mark_ok = None if real_marks is None else real_marks.contiguous().view(torch.uint8)
    token_ok = None if mask is None else mask.contiguous().view(torch.uint8)
    heads = 1 if mask is None else q.shape[0] // mask.shape[0]
    return route_order_op(q.detach().contiguous(), marks.detach().contiguous(), mark_ok, sort_rows, token_ok, heads)
