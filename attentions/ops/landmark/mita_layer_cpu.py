"""MiTA's default form (one routed expert per query, with the shared expert) on the CPU kernels as one
autograd Function over their operators: the same steps and kernels as mita.py's composed path
(landmark/cpu.py, grouped/cpu.py), with the backward written into one set of gradients. It saves
tensors only, and every step is a torch operator or a ``lra::`` operator, so torch.compile traces it
whole (no graph break) and the profiler names each kernel.

Composed of separate Functions, the backward would make each stage's q, k, v gradients as new
tensors for autograd to add: at N = 64K (B = 1, H = 4, D = 32) three [G, N, D] additions, three new
[G, N, D] tensors and a zero [G, m, N] gradient for the scores, about 15% of the step. Here the
grouped attention's gradients are the buffers, and the landmark pass adds its key, value and
landmark gradients into them in the same kernel call (``lra::mita_backward``, csrc/mita_layer_cpu.c:
a thread takes a head through both passes while its rows are in the cache, the same bits as the
two operators ``lra::grouped_backward`` and ``lra::landmark_backward_add`` in turn); the pooling
adds its query gradient into dq, in the same call where dq's rows are in query order (then the
head's dq rows are still in the cache; as ``lra::pool_bins_backward_add`` after it, the same bits).

The forward prepares the experts (steps 1-4: bins, pooling, landmark pass, top-k selection,
routing and grouping) in one call, ``lra::mita_prepare``: a thread takes a head through every step,
so that a landmark's scores are selected while they are in the cache, where four operators over
every head and about twenty small tensor operations between them each met their inputs in memory
(``prepare_composed``, the same bits; it runs where an expert holds every key, topk >= N).
tests/test_mita_cpu.py checks it against the composed path, ``mita.reference`` and the operators.
"""

import ctypes
import math
from functools import partial
from typing import Callable, List, Optional, Tuple

import torch
from torch.library import custom_op, register_fake

from ... import masking
from ...base import AttentionError
from .. import native
from ..grouped.cpu import Grouped, grouped_block, grouped_forward, take_rows
from .cpu import (Landmarks, Pool, kernel_bins, landmark_block, landmark_forward, pool_block, pool_bins,
                  pool_bins_backward_add, route_order)

LIBRARY = "mita_layer_cpu"


class Prepare(ctypes.Structure):
    """The forward preparation's argument block (``Prepare`` in mita_layer_cpu.c, field for field)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("B", "heads", "m", "N", "D", "keys", "threads")] + [
        (name, ctypes.c_void_p) for name in ("q", "k", "v", "mask", "starts", "ends", "mark_ok", "marks", "scaled",
                                             "shared", "scores", "lse", "rows", "key_ok", "order", "offsets",
                                             "inverse", "sorted")]


SIGNATURES: native.Signatures = {
    "mita_backward": ([ctypes.POINTER(Grouped), ctypes.POINTER(Landmarks), ctypes.POINTER(Pool), ctypes.c_float],
                      ctypes.c_int),
    "mita_prepare": ([ctypes.POINTER(Prepare)], ctypes.c_int),
}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(q: torch.Tensor) -> List[str]:
    """Why the layer's kernels do not take tensors like ``q`` (float32 CPU tensors, once built here); []
    when they do."""
    return native.refusals(q, LIBRARY)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


@custom_op("lra::mita_backward", mutates_args=(), device_types="cpu")
def mita_backward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, marks: torch.Tensor,
                  shared_values: torch.Tensor, rows: torch.Tensor, key_ok: Optional[torch.Tensor],
                  shared_ok: Optional[torch.Tensor], order: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, probs: torch.Tensor, d_out: torch.Tensor, token_ok: Optional[torch.Tensor],
                  scores: torch.Tensor, marks_lse: torch.Tensor, heads: int, scale: float,
                  starts: Optional[torch.Tensor] = None, ends: Optional[torch.Tensor] = None,
                  merged_d_out: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of MiTA's grouped attention and landmark pass, head by head: ``lra::grouped_backward``
    of the first ten arguments (G m experts over the [G N, D] keys and values by ``rows`` [G m, k], each
    expert's rows among its own head's N rows; the pre-scaled landmarks ``marks`` [G, m, D] and
    ``shared_values`` as each head's shared tables, a group and a thread unit of m experts; its out,
    lse, softmax rows and d_out) followed by
    ``lra::landmark_backward_add`` of the landmark pass (token_ok [G / heads, N] or None, its scores
    [G, m, N] and log-sum-exps [G, m]) into its gradients. Returns dq [P, D] (a row per pair), d keys,
    d values [G N, D] and d marks [G, m, D], new tensors. With the pooling's bins ``starts``, ``ends``
    [G / heads, m] (the pairs in query order, P = G N): the landmarks were pooled from q and scaled
    by ``scale``, and each head's pooling backward runs in the same call, after its other passes:
    d marks come back multiplied by ``scale`` (the gradient of the pooled, unscaled landmarks) and
    spread over the bins' rows of dq, as ``pool_bins_backward_add(d_marks * scale, ...)`` would
    (the same bits). ``merged_d_out``: the pairs are the queries in query order and d_out is in the
    layout the model's heads merge leaves it, [G / heads, N, heads, D] (read in place, as its copy
    into [G N, D] would be read)."""
    g, m, d = marks.shape
    n = keys.shape[0] // g
    pairs = order.shape[0]
    dq, offset = q.new_empty(pairs, d), q.new_empty(pairs)  # both filled by the kernel
    d_keys, d_values, d_marks, d_shared = (torch.empty_like(t) for t in (keys, values, marks, shared_values))
    d_out = d_out.contiguous()
    pass_ = grouped_block(q, keys, values, marks, shared_values, rows, key_ok, shared_ok, order, offsets, m, scale,
                          m, 0)
    pass_.out, pass_.lse, pass_.probs = _ptr(out), _ptr(lse), _ptr(probs)
    pass_.dout, pass_.offset, pass_.dq = _ptr(d_out), _ptr(offset), _ptr(dq)
    if merged_d_out:
        pass_.dout_heads, pass_.dout_n = heads, n
    pass_.dkeys, pass_.dvalues, pass_.dskeys, pass_.dsvalues = _ptr(d_keys), _ptr(d_values), _ptr(d_marks), _ptr(
        d_shared)
    marks_pass = landmark_block(marks, keys.view(g, n, d), values.view(g, n, d), token_ok, heads)
    marks_pass.scores, marks_pass.lse, marks_pass.shared, marks_pass.accumulate = (
        _ptr(scores), _ptr(marks_lse), _ptr(shared_values), 1)
    marks_pass.dshared, marks_pass.dmarks, marks_pass.dkeys, marks_pass.dvalues = (
        _ptr(d_shared), _ptr(d_marks), _ptr(d_keys), _ptr(d_values))
    pool = None
    if starts is not None and ends is not None:
        pool = pool_block(starts, ends, heads, g, n, d)
        pool.backward, pool.accumulate, pool.dout, pool.dx = 1, 1, _ptr(d_marks), _ptr(dq)
    if library().mita_backward(ctypes.byref(pass_), ctypes.byref(marks_pass),
                               None if pool is None else ctypes.byref(pool), scale) != 0:
        raise MemoryError("the MiTA layer's CPU kernel could not allocate its per-thread buffers")
    return dq, d_keys, d_values, d_marks


@register_fake("lra::mita_backward")
def _(q, keys, values, marks, shared_values, rows, key_ok, shared_ok, order, offsets, out, lse, probs, d_out,
      token_ok, scores, marks_lse, heads, scale, starts=None, ends=None, merged_d_out=False):
    return q.new_empty(order.shape[0], q.shape[1]), torch.empty_like(keys), torch.empty_like(values), torch.empty_like(
        marks)


# mita_prepare's outputs, in order
PREPARED = ("starts", "ends", "shared_ok", "marks", "scaled", "shared_values", "scores", "landmark_lse", "rows",
            "expert_ok", "order", "offsets", "inverse", "q_sorted")


@custom_op("lra::mita_prepare", mutates_args=(), device_types="cpu")
def mita_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
                 landmarks: int, keys: int, sort_rows: bool) -> List[torch.Tensor]:
    """Steps 1-4 of MiTA's default form on q, k, v [G, N, D] (G = B heads; mask [B, N] uint8, right-padded,
    or None) in one call, a head at a time (csrc/mita_layer_cpu.c): the tensors of ``PREPARED``, those
    that ``prepare_composed`` makes with the separate operators, bit for bit. starts, ends [B, m] (long),
    shared_ok [G, m] (uint8), marks, scaled, shared_values [G, m, D], scores [G, m, N], landmark_lse
    [G, m], rows [G m, keys] (long), expert_ok [G m, keys] (uint8; [0] without a mask), order [G N],
    offsets [G m + 1], inverse [G N] (long) and q_sorted [G N, D] ([0] and [0, D] without ``sort_rows``).
    keys < N."""
    g, n, d = q.shape
    b, m = g // heads, landmarks
    out = dict(starts=q.new_empty(b, m, dtype=torch.long), ends=q.new_empty(b, m, dtype=torch.long),
               shared_ok=q.new_empty(g, m, dtype=torch.uint8), marks=q.new_empty(g, m, d),
               scaled=q.new_empty(g, m, d), shared_values=q.new_empty(g, m, d), scores=q.new_empty(g, m, n),
               landmark_lse=q.new_empty(g, m), rows=q.new_empty(g * m, keys, dtype=torch.long),
               expert_ok=q.new_empty(0 if mask is None else g * m, keys, dtype=torch.uint8),
               order=q.new_empty(g * n, dtype=torch.long), offsets=q.new_empty(g * m + 1, dtype=torch.long),
               inverse=q.new_empty(g * n if sort_rows else 0, dtype=torch.long),
               q_sorted=q.new_empty(g * n if sort_rows else 0, d))
    args = Prepare(B=b, heads=heads, m=m, N=n, D=d, keys=keys, threads=torch.get_num_threads(), q=_ptr(q),
                   k=_ptr(k), v=_ptr(v), mask=_ptr(mask), starts=_ptr(out["starts"]), ends=_ptr(out["ends"]),
                   mark_ok=_ptr(out["shared_ok"]), marks=_ptr(out["marks"]), scaled=_ptr(out["scaled"]),
                   shared=_ptr(out["shared_values"]), scores=_ptr(out["scores"]), lse=_ptr(out["landmark_lse"]),
                   rows=_ptr(out["rows"]), key_ok=_ptr(out["expert_ok"]), order=_ptr(out["order"]),
                   offsets=_ptr(out["offsets"]), inverse=_ptr(out["inverse"]), sorted=_ptr(out["q_sorted"]))
    status = library().mita_prepare(ctypes.byref(args))
    if status == 2:
        raise AttentionError(masking.RIGHT_PADDED)
    if status == 3:
        raise AttentionError(masking.NOT_EMPTY)
    if status != 0:
        raise MemoryError("the MiTA layer's CPU kernel could not allocate its per-thread buffers")
    return [out[name] for name in PREPARED]


@register_fake("lra::mita_prepare")
def _(q, k, v, mask, heads, landmarks, keys, sort_rows):
    g, n, d = q.shape
    b, m = g // heads, landmarks
    rows = g * n if sort_rows else 0
    return [q.new_empty(b, m, dtype=torch.long), q.new_empty(b, m, dtype=torch.long),
            q.new_empty(g, m, dtype=torch.uint8), q.new_empty(g, m, d), q.new_empty(g, m, d), q.new_empty(g, m, d),
            q.new_empty(g, m, n), q.new_empty(g, m), q.new_empty(g * m, keys, dtype=torch.long),
            q.new_empty(0 if mask is None else g * m, keys, dtype=torch.uint8), q.new_empty(g * n, dtype=torch.long),
            q.new_empty(g * m + 1, dtype=torch.long), q.new_empty(rows, dtype=torch.long), q.new_empty(rows, d)]


def prepare_composed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], heads: int,
                     landmarks: int, keys: int, sort_rows: bool,
                     select: Callable[[torch.Tensor, int], Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
    """``mita_prepare`` composed of the separate operators and tensor operations (any keys <= N):
    the readable form, and the one for keys = N; ``select`` is mita.top_keys."""
    g, n, d = q.shape
    b, m = g // heads, landmarks
    mask_bool = None if mask is None else mask.view(torch.bool)
    # 1. landmarks: bin means of the queries over each sequence's real tokens
    starts, ends, real_marks = kernel_bins(mask_bool, b, n, m, q.device)  # [B, m] each
    marks = pool_bins(q, starts, ends, heads)  # [G, m, D]
    scaled = marks / math.sqrt(d)  # the landmarks as keys: q . L gets 1 / D, L . k gets 1 / sqrt(D)
    # 2-3. the landmarks' scores against every key and the shared values
    shared_values, scores, landmark_lse = landmark_forward(scaled, k, v, mask, heads)
    index, key_ok = select(scores.view(b, heads, m, n), keys)  # [B, H, m, keys] each
    # (a mask that is all True costs the kernels nothing: no host read of it here)
    expert_ok = (q.new_empty(0, keys, dtype=torch.uint8) if mask is None
                 else key_ok.reshape(g * m, keys).contiguous().view(torch.uint8))
    # 4. each query to its best real landmark (route_order: padded queries to none)
    real_marks = real_marks.repeat_interleave(heads, dim=0)  # [G, m]
    order, offsets, inverse, q_sorted = route_order(q, marks, real_marks, sort_rows, mask_bool)
    # expert g m + j holds key rows index[g, j] of k and v [G N, D]
    rows = (index.view(g, m * keys) + torch.arange(g, device=q.device)[:, None] * n).view(g * m, keys)
    return [starts, ends, real_marks.contiguous().view(torch.uint8), marks, scaled, shared_values, scores,
            landmark_lse, rows, expert_ok, order, offsets, inverse, q_sorted]


# the bytes of a head's query rows (N x D floats) from which the layer copies the queries into expert
# order (see MiTACPU.forward): N = 32K at D = 32; below, the kernels read and write them in query order
SORTED_ROWS_BYTES = 4 << 20


def sorted_rows(n: int, d: int) -> bool:
    """Whether the layer sorts a head's n query rows of d floats into expert order."""
    return n * d * 4 >= SORTED_ROWS_BYTES


class MiTACPU(torch.autograd.Function):
    """MiTA (experts_per_query = 1, shared expert) of q, k, v [B, H, N, D] (contiguous float32 CPU);
    ``select`` is mita.top_keys (scores [B, H, m, N], keys -> key index, real [B, H, m, keys]), the
    one selection the composed path and ``selected_keys`` use."""

    @staticmethod
    def forward(ctx, q, k, v, mask: Optional[torch.Tensor], landmarks: int, keys: int,
                select: Callable[[torch.Tensor, int], Tuple[torch.Tensor, torch.Tensor]]):
        b, h, n, d = q.shape
        g, m = b * h, landmarks
        scale = 1 / math.sqrt(d)
        mask_bytes = None if mask is None else mask.contiguous().view(torch.uint8)  # [B, N]
        q_rows, k_rows, v_rows = q.view(g, n, d), k.view(g, n, d), v.view(g, n, d)
        # Long rows (sorted_rows): the queries copied into expert order, so that the kernel reads q and
        # writes out (and in the backward reads d_out and writes dq) in consecutive rows, 8% less time
        # at 64K than rows scattered over the table (AMD EPYC); out and dq go back to query order by
        # the inverse permutation (lra::take_rows, 7 ms at G N = 262,144 rows). Shorter rows: the
        # kernel reads and writes them where they lie, in query order, which saves the copy and the
        # three gathers (the layer's forward and backward 7% faster at 1K-2K, batch 8, 2 heads of 32,
        # 4% at 4K-8K; Intel Xeon).
        sort = sorted_rows(n, d)
        # steps 1-4 (pooling, landmark pass, top-k selection, routing; a padded query to no expert, so
        # its output is 0 and it costs the grouped attention nothing), in one call where it selects
        prepare = mita_prepare if keys < n else partial(prepare_composed, select=select)
        (starts, ends, shared_ok, marks, scaled, shared_values, scores, landmark_lse, rows, expert_ok, order, offsets,
         inverse, q_sorted) = prepare(q_rows, k_rows, v_rows, mask_bytes, h, m, keys, sort)
        expert_ok = None if mask is None else expert_ok
        # 5. the grouped attention: expert g m + j of head g holds key rows ``rows`` of k and v [G N, D]
        pairs = (q_sorted, torch.arange(g * n, device=q.device)) if sort else (q.view(g * n, d), order)
        grouped = (pairs[0], k.view(g * n, d), v.view(g * n, d), scaled, shared_values, rows, expert_ok, shared_ok,
                   pairs[1], offsets)
        out_pairs, lse, probs = grouped_forward(*grouped, m, scale, m)  # out [G N, D]: pair order
        out = take_rows(out_pairs, inverse) if sort else out_pairs
        ctx.save_for_backward(*grouped, out_pairs, lse, probs, order, inverse, starts, ends, mask_bytes, scores,
                              landmark_lse)
        ctx.dims, ctx.scale, ctx.landmarks, ctx.sorted = (b, h, n, d), scale, m, sort
        return out.view(b, h, n, d)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        (*grouped, out_pairs, lse, probs, order, inverse, starts, ends, mask_bytes, scores,
         landmark_lse) = ctx.saved_tensors
        b, h, n, d = ctx.dims
        g = b * h
        # the grouped attention's and the landmark pass's gradients: dq [G N, D] in pair order (expert
        # order with sorted rows, else query order), dk, dv [G N, D], d scaled [G, m, D]
        # in query order, a gradient in the layout of the model's heads merge ([B, N, H, D] memory, as
        # the backward of its transpose(1, 2).reshape leaves it) is read in place, not copied first
        merged = not ctx.sorted and d_out.transpose(1, 2).is_contiguous()
        if merged:
            d_out_pairs = d_out.transpose(1, 2)  # [B, N, H, D]
        else:
            d_out = d_out.reshape(g * n, d).contiguous()
            d_out_pairs = take_rows(d_out, order) if ctx.sorted else d_out  # [G N, D]
        # in query order, the pooling's dq is added by the same call, a head at a time
        bins = (None, None) if ctx.sorted else (starts, ends)
        dq_pairs, dk, dv, d_marks = mita_backward(*grouped, out_pairs, lse, probs, d_out_pairs, mask_bytes, scores,
                                                  landmark_lse, h, ctx.scale, *bins, merged_d_out=merged)
        if ctx.sorted:
            dq = take_rows(dq_pairs, inverse)
            pool_bins_backward_add(d_marks * ctx.scale, starts, ends, h, dq.view(g, n, d))
        else:
            dq = dq_pairs
        return dq.view(b, h, n, d), dk.view(b, h, n, d), dv.view(b, h, n, d), None, None, None, None
