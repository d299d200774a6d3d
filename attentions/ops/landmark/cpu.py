"""MiTA's landmark pass and routing on a compiled C kernel for the CPU (csrc/landmark_cpu.c), float32.

``pool_queries`` is step 1 (the landmarks: bin means of the queries over each sequence's real
tokens) without the [B, m, N] pooling matrix the PyTorch path builds and multiplies by.

``landmark_pass`` is steps 2-3 of ``mita.reference`` for the shared expert: the landmarks' scores
against every key (which the routed experts are selected from) and softmax(scores) V, with its
backward. In PyTorch that is two batched matmuls and four [B, H, m, N] passes forward (the scores,
the mask, the softmax, its copy for the backward) and five more backward; at LRA's lengths they took
about half of MiTA's step. The kernel makes one pass over the keys in L1-sized blocks and keeps only
the scores and one log-sum-exp per landmark. ``route_best`` is step 4 for one expert per query:
q . L_j and the argmax in one pass, without the [B, H, N, m] gate tensor.

Each gives its PyTorch form's results (reference.py) up to float rounding (tests/test_landmark_cpu.py);
other dtypes and devices, and machines where the kernel cannot be built, keep the PyTorch forms
(``refusals`` says why).
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch

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
    lib = native.load(LIBRARY)
    if lib is not None and not hasattr(lib, "_typed"):
        block = ctypes.POINTER(Landmarks)
        for fn in (lib.landmark_forward, lib.landmark_backward):
            fn.argtypes, fn.restype = [block], ctypes.c_int
        lib.route_best.argtypes, lib.route_best.restype = [block, _ptr_t, _ptr_t, _ptr_t], ctypes.c_int
        lib.pool_bins.argtypes, lib.pool_bins.restype = [ctypes.POINTER(Pool)], ctypes.c_int
        lib._typed = True
    return lib


def refusals(q: torch.Tensor) -> List[str]:
    """Why the kernels do not take tensors like ``q`` (they take float32 CPU tensors, once built here);
    [] when they do."""
    return native.refusals(q, LIBRARY)


def fits(q: torch.Tensor) -> bool:
    return not refusals(q)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the landmark CPU kernel could not allocate its per-thread buffers")


class Pool(ctypes.Structure):
    """The pooling kernel's argument block (``Pool`` in landmark_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("G", "m", "N", "D", "heads", "threads", "backward", "accumulate")] + [
        (name, _ptr_t) for name in ("starts", "ends", "x", "dout", "out", "dx")]


def pool_forward(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, heads: int) -> Tuple[torch.Tensor, Pool]:
    """Bin means of x [G, N, D] (contiguous float32) over bins [start, end) per sequence ([G / heads, m]
    each) -> [G, m, D], and the argument block that ``pool_backward`` takes."""
    g, n, d = x.shape
    out = x.new_empty(g, starts.shape[1], d)
    args = Pool(G=g, m=starts.shape[1], N=n, D=d, heads=heads, threads=torch.get_num_threads(), backward=0,
                starts=_ptr(starts), ends=_ptr(ends), x=_ptr(x), out=_ptr(out))
    _check(library().pool_bins(ctypes.byref(args)))
    return out, args


def pool_backward(args: Pool, d_out: torch.Tensor, dx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of ``pool_forward`` for d_out [G, m, D]: a new [G, N, D] tensor, or added to ``dx``
    (contiguous float32) when given. The forward's starts and ends must still be alive."""
    d_out = d_out.to(torch.float32).contiguous()
    accumulate = dx is not None
    if dx is None:
        dx = d_out.new_empty(args.G, args.N, args.D)
    args.backward, args.accumulate, args.dout, args.dx = 1, int(accumulate), _ptr(d_out), _ptr(dx)
    _check(library().pool_bins(ctypes.byref(args)))
    return dx


class PoolBinsCPU(torch.autograd.Function):
    """Bin means of x [G, N, D] over bins [start, end) per sequence ([G / heads, m] each) -> [G, m, D]."""

    @staticmethod
    def forward(ctx, x, starts, ends, heads: int):
        out, ctx.args = pool_forward(x, starts, ends, heads)
        ctx.save_for_backward(starts, ends)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        _ = ctx.saved_tensors  # (starts, ends: the pointers in ctx.args)
        return pool_backward(ctx.args, d_out), None, None, None


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
    pooled = PoolBinsCPU.apply(q.reshape(b * h, n, d).contiguous(), starts, ends, h)
    return pooled.view(b, h, bins, d), real


def landmark_forward(
    marks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_ok: Optional[torch.Tensor], heads: int
) -> Tuple[torch.Tensor, torch.Tensor, Landmarks]:
    """Shared values [G, m, D], scores [G, m, N] and the argument block of ``landmark_backward``, for
    pre-scaled marks [G, m, D], keys and values [G, N, D] (contiguous float32), key_ok [G / heads, N]
    uint8 or None. The block points into the inputs and results: keep them alive for the backward."""
    g, m, d = marks.shape
    n = keys.shape[1]
    scores, lse, shared = marks.new_empty(g, m, n), marks.new_empty(g, m), marks.new_empty(g, m, d)
    args = Landmarks(G=g, m=m, N=n, D=d, heads=heads, threads=torch.get_num_threads(), marks=_ptr(marks),
                     keys=_ptr(keys), values=_ptr(values), key_ok=_ptr(key_ok), scores=_ptr(scores),
                     lse=_ptr(lse), shared=_ptr(shared))
    _check(library().landmark_forward(ctypes.byref(args)))
    args._lse = lse  # (only the kernel reads it)
    return shared, scores, args


def landmark_backward(
    args: Landmarks, d_shared: torch.Tensor, grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d marks [G, m, D], d keys, d values [G, N, D] of ``landmark_forward`` for d_shared [G, m, D]:
    new tensors, or added to ``grads`` (three contiguous float32 tensors of those shapes) when given."""
    d_shared = d_shared.to(torch.float32).contiguous()
    if grads is None:
        grads = (d_shared.new_empty(args.G, args.m, args.D), d_shared.new_empty(args.G, args.N, args.D),
                 d_shared.new_empty(args.G, args.N, args.D))
        args.accumulate = 0
    else:
        args.accumulate = 1
    args.dshared, args.dmarks, args.dkeys, args.dvalues = _ptr(d_shared), *[_ptr(t) for t in grads]
    _check(library().landmark_backward(ctypes.byref(args)))
    return grads


class LandmarkPassCPU(torch.autograd.Function):
    """(softmax(S) V, S) with S = marks K^T (-inf at masked keys), per head, on landmark_cpu.c."""

    @staticmethod
    def forward(ctx, marks, keys, values, key_ok, heads: int):
        shared, scores, ctx.args = landmark_forward(marks, keys, values, key_ok, heads)
        ctx.save_for_backward(marks, keys, values, key_ok, scores, shared)
        ctx.mark_non_differentiable(scores)
        # the scores' gradient is never used: no [G, m, N] zeros made for it
        ctx.set_materialize_grads(False)
        return shared, scores

    @staticmethod
    def backward(ctx, d_shared: Optional[torch.Tensor], _d_scores: None):
        _ = ctx.saved_tensors  # (the forward's own tensors: the pointers in ctx.args still hold)
        if d_shared is None:
            return None, None, None, None, None
        return (*landmark_backward(ctx.args, d_shared), None, None)


def landmark_pass(
    marks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shared values softmax(S) V [B, H, m, D] and the scores S = marks K^T [B, H, m, N] (-inf at
    padded keys; not differentiable), for landmarks ``marks`` [B, H, m, D] already scaled by
    1 / sqrt(D). Float32 CPU tensors with the kernel built (``fits``)."""
    b, h, m, d = marks.shape
    n = k.shape[2]
    key_ok = None if mask is None else mask.contiguous().view(torch.uint8)  # [B, N]
    shared, scores = LandmarkPassCPU.apply(
        marks.reshape(b * h, m, d).contiguous(), k.reshape(b * h, n, d).contiguous(),
        v.reshape(b * h, n, d).contiguous(), key_ok, h)
    return shared.view(b, h, m, d), scores.view(b, h, m, n)


@torch.no_grad()
def route_best(q: torch.Tensor, marks: torch.Tensor, real_marks: Optional[torch.Tensor]) -> torch.Tensor:
    """Each query's best real landmark: argmax_j q . marks_j over the landmarks with real_marks
    (the first of equal values), -1 where a head has none. q [G, N, D], marks [G, m, D],
    real_marks [G, m] bool or None (all real) -> [G, N] long."""
    g, n, d = q.shape
    m = marks.shape[1]
    best = torch.empty(g, n, dtype=torch.long)
    q, marks = q.contiguous(), marks.contiguous()  # (named, so they live through the call)
    mark_ok = None if real_marks is None else real_marks.contiguous().view(torch.uint8)
    args = Landmarks(G=g, m=m, N=n, D=d, heads=1, threads=torch.get_num_threads(), marks=_ptr(marks))
    _check(library().route_best(ctypes.byref(args), _ptr(q), _ptr(mark_ok), _ptr(best)))
    return best
