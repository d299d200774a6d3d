"""Grouped routed attention on a compiled C kernel for the CPU (csrc/grouped_cpu.c): ``grouped_attention``
of reference.py (same arguments, same results up to float rounding) for float32 CPU tensors.

The PyTorch path runs each tile of queries as a few small batched matmuls, with the tables gathered
into tiles and scattered back; at LRA's lengths (an expert holds ~16 queries at N = 1K) those
small operations, not the arithmetic, set its time. The C kernel walks the experts instead: it
copies an expert's keys and values (read by index, ``rows``) into buffers that stay in the L1
cache, runs each of its queries through one softmax over the shared and routed keys, and in the
backward adds the expert's key gradients back once. The softmax rows are kept for the backward
when they fit in tuning.SAVE_ELEMENTS; otherwise the backward recomputes them from the
saved log-sum-exp (as flash attention does), and the kernel keeps O(P) floats.

The kernel's entries are torch.library operators (``lra::grouped_forward``, ``lra::grouped_backward``,
``lra::merge_parts``, ``lra::take_rows``, ...): the profiler names them, torch.compile keeps them in
its graph (their fake implementations give the output shapes), and autograd saves their tensors.
Other dtypes (bf16 under autocast) and CUDA tensors take the PyTorch path; a machine where the
kernel cannot be built (no C compiler) keeps the PyTorch path too: ``refusals`` says why
(ops/native.py).
"""

import ctypes
from typing import List, Optional, Tuple

import torch

from torch.library import custom_op, register_autograd, register_fake

from ...base import AttentionError
from .. import native, tuning
from .reference import gather_rows, grouped_attention, merge

LIBRARY = "grouped_cpu"
_f, _i64 = ctypes.c_float, ctypes.c_int64


class Grouped(ctypes.Structure):
    """The kernel's argument block (``Grouped`` in grouped_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("experts", "S", "D", "M", "group", "unit", "threads", "pairs",
                                          "query_rows")] + [
        ("scale", _f)] + [(name, ctypes.c_void_p) for name in (
            "q", "order", "offsets", "keys", "values", "rows", "key_ok", "skeys", "svalues", "sok", "out", "lse",
            "probs", "dout", "dlse", "weights", "offset", "dq", "dkeys", "dvalues", "dskeys", "dsvalues")] + [
        (name, _i64) for name in ("dout_heads", "dout_n")]


class Merge(ctypes.Structure):
    """The merge's argument block (``Merge`` in grouped_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("R", "E", "D", "threads", "slot_major")] + [
        (name, ctypes.c_void_p) for name in ("parts", "lse", "weights", "out", "dout", "dparts", "dlse")]


SIGNATURES: native.Signatures = {
    "grouped_forward": ([ctypes.POINTER(Grouped)], ctypes.c_int),
    "grouped_backward": ([ctypes.POINTER(Grouped)], ctypes.c_int),
    "merge_parts": ([ctypes.POINTER(Merge), ctypes.c_int], ctypes.c_int),
    "take_rows": ([ctypes.c_void_p] * 3 + [_i64] * 3, None),
    "expert_runs": ([ctypes.c_void_p, _i64, _i64, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(x: torch.Tensor) -> List[str]:
    """Why the C kernel does not take tensors like ``x`` (it takes float32 CPU tensors, once built
    here); [] when it does."""
    return native.refusals(x, LIBRARY)


def takes(x: torch.Tensor) -> bool:
    """Whether the C kernel takes tensors like ``x`` (float32 on the CPU, built here)."""
    return not refusals(x)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None or t.numel() == 0 else t.data_ptr()


@custom_op("lra::take_rows", mutates_args=(), device_types="cpu")
def take_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index) for contiguous float32 x [R, D] and index [P] (int64 in [0, R))."""
    out = x.new_empty(index.shape[0], x.shape[1])
    library().take_rows(x.data_ptr(), index.data_ptr(), out.data_ptr(), index.shape[0], x.shape[1],
                        torch.get_num_threads())
    return out


@register_fake("lra::take_rows")
def _(x, index):
    return x.new_empty(index.shape[0], x.shape[1])


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index) for x [R, D] and index [P] (int64, values in [0, R)), on the kernel
    for contiguous float32 CPU tensors; not differentiable (the callers' Functions route gradients)."""
    if not (takes(x) and x.dim() == 2 and x.is_contiguous() and index.dtype == torch.int64 and index.is_contiguous()):
        return x.index_select(0, index)
    return take_rows_op(x, index)


@custom_op("lra::expert_runs", mutates_args=(), device_types="cpu")
def expert_runs_op(expert: torch.Tensor, experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """reference.expert_runs on the kernel (a counting sort) for contiguous int64 expert [P] in
    [0, experts]: order [P] and offsets [experts + 1]."""
    order, offsets = expert.new_empty(expert.shape[0]), expert.new_empty(experts + 1)
    status = library().expert_runs(expert.data_ptr(), expert.numel(), experts, order.data_ptr(), offsets.data_ptr())
    if status == 1:
        raise AttentionError(f"an expert number is outside [0, {experts}] (the experts and the no-expert number "
                             f"{experts})")
    if status != 0:
        raise MemoryError("the grouped CPU kernel could not allocate the counts of its expert runs")
    return order, offsets


@register_fake("lra::expert_runs")
def _(expert, experts):
    return torch.empty_like(expert), expert.new_empty(experts + 1)


def _call(fn_name: str, args: Grouped) -> None:
    if getattr(library(), fn_name)(ctypes.byref(args)) != 0:
        raise MemoryError("the grouped CPU kernel could not allocate its per-thread buffers")


def grouped_block(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets, group, scale,
                  unit, query_rows) -> Grouped:
    """The kernel's argument block for these inputs (the outputs' pointers are set by the caller). A key
    mask only sets each key's logit bias (0 or -inf), as no mask does for every key: one that is all
    True costs the kernel nothing, and a check of it on the host (a pass over the mask per call) is
    not made."""
    x, s = rows.shape if rows is not None else keys.shape[:2]
    m = 0 if shared_keys is None else shared_keys.shape[1]
    return Grouped(
        experts=x, S=s, D=q.shape[1], M=m, group=group, unit=unit, threads=torch.get_num_threads(),
        pairs=order.shape[0], query_rows=query_rows, scale=scale,
        q=_ptr(q), order=_ptr(order), offsets=_ptr(offsets), keys=_ptr(keys), values=_ptr(values), rows=_ptr(rows),
        key_ok=_ptr(key_ok), skeys=_ptr(shared_keys), svalues=_ptr(shared_values), sok=_ptr(shared_ok),
    )


def _saved_rows(pairs: int, keys: torch.Tensor, rows: Optional[torch.Tensor],
                shared_keys: Optional[torch.Tensor]) -> int:
    """Floats per pair of the softmax rows the forward keeps for the backward (M + S), 0 when they do
    not fit in tuning.SAVE_ELEMENTS (the backward then recomputes them)."""
    s = rows.shape[1] if rows is not None else keys.shape[1]
    width = s + (0 if shared_keys is None else shared_keys.shape[1])
    return width if pairs * width <= tuning.SAVE_ELEMENTS else 0


def _check_query_rows(q: torch.Tensor, order: torch.Tensor, query_rows: int) -> None:
    """With query_rows R, q holds R rows and the pairs are whole multiples of them (part p / R of
    query p % R)."""
    if query_rows and (q.shape[0] != query_rows or order.shape[0] % query_rows):
        raise AttentionError(f"query_rows={query_rows} needs q of {query_rows} rows (got {q.shape[0]}) and a "
                             f"whole number of parts per query ({order.shape[0]} pairs)")


@custom_op("lra::grouped_forward", mutates_args=(), device_types="cpu")
def grouped_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shared_keys: Optional[torch.Tensor],
                    shared_values: Optional[torch.Tensor], rows: Optional[torch.Tensor], key_ok: Optional[torch.Tensor],
                    shared_ok: Optional[torch.Tensor], order: torch.Tensor, offsets: torch.Tensor, group: int,
                    scale: float, unit: int, query_rows: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's forward on prepared inputs (see ``grouped_attention_cpu``): out [P, D], lse [P] and
    the softmax rows [P, M + S] kept for the backward ([P, 0] when they do not fit). query_rows R > 0:
    q holds R queries and pair p is part p / R of query p % R (a query's parts are then merged)."""
    _check_query_rows(q, order, query_rows)
    pairs = order.shape[0]
    # [P, D], [P] and the softmax rows in sorted pair order, all written by the kernel (a pair with no
    # expert gets 0, -inf and a row of 0)
    out, lse = q.new_empty(pairs, q.shape[1]), q.new_empty(pairs)
    probs = q.new_empty(pairs, _saved_rows(pairs, keys, rows, shared_keys))
    args = grouped_block(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets,
                         group, scale, unit, query_rows)
    args.out, args.lse, args.probs = _ptr(out), _ptr(lse), _ptr(probs)
    _call("grouped_forward", args)
    return out, lse, probs


@register_fake("lra::grouped_forward")
def _(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets, group, scale, unit,
      query_rows=0):
    pairs = order.shape[0]
    return (q.new_empty(pairs, q.shape[1]), q.new_empty(pairs),
            q.new_empty(pairs, _saved_rows(pairs, keys, rows, shared_keys)))


@custom_op("lra::grouped_backward", mutates_args=(), device_types="cpu")
def grouped_backward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shared_keys: Optional[torch.Tensor],
                     shared_values: Optional[torch.Tensor], rows: Optional[torch.Tensor], key_ok: Optional[torch.Tensor],
                     shared_ok: Optional[torch.Tensor], order: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, probs: torch.Tensor, d_out: torch.Tensor, d_lse: Optional[torch.Tensor],
                     group: int, scale: float, unit: int, query_rows: int = 0, weights: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward of ``grouped_forward`` (given its out, lse and softmax rows; where the
    rows were not kept it recomputes them from lse): dq [P, D] (a row per pair, also with
    query_rows), d keys, d values and the shared tables' gradients ([0] without shared tables), new
    tensors. With query_rows R and ``weights`` [R, P / R] (each part's weight in its query's merge,
    merge_parts): out and d_out are the merged rows [R, D] and d_lse is not taken, the merge's
    backward folded into the pairs' (see grouped_cpu.c: part_weight)."""
    _check_query_rows(q, order, query_rows)
    if weights is not None and (not query_rows or weights.numel() != order.shape[0]):
        raise AttentionError("weights need query_rows and one weight per pair")
    d_out = d_out.to(q.dtype).contiguous()
    d_lse = None if d_lse is None or weights is not None else d_lse.to(q.dtype).contiguous()  # [P]
    weights = None if weights is None else weights.to(q.dtype).contiguous()
    pairs = order.shape[0]
    dq = q.new_empty(pairs, q.shape[1])
    # without rows, keys [X, S, D] holds each expert's own keys: the kernel writes every expert's
    # gradient (zeros for one without pairs); with rows, experts share key rows and add into them
    fresh = torch.empty_like if rows is None else torch.zeros_like
    d_keys, d_values = fresh(keys), fresh(values)
    d_shared_keys = q.new_empty(0) if shared_keys is None else torch.zeros_like(shared_keys)
    d_shared_values = q.new_empty(0) if shared_values is None else torch.zeros_like(shared_values)
    offset = q.new_empty(pairs)  # [P], filled by the kernel
    args = grouped_block(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets,
                         group, scale, unit, query_rows)
    args.out, args.lse, args.probs = _ptr(out), _ptr(lse), _ptr(probs)
    args.dout, args.dlse, args.offset, args.dq = _ptr(d_out), _ptr(d_lse), _ptr(offset), _ptr(dq)
    args.weights = _ptr(weights)
    args.dkeys, args.dvalues = _ptr(d_keys), _ptr(d_values)
    args.dskeys, args.dsvalues = _ptr(d_shared_keys), _ptr(d_shared_values)
    _call("grouped_backward", args)
    return dq, d_keys, d_values, d_shared_keys, d_shared_values


@register_fake("lra::grouped_backward")
def _(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets, out, lse, probs, d_out,
      d_lse, group, scale, unit, query_rows=0, weights=None):
    shared = [q.new_empty(0) if t is None else torch.empty_like(t) for t in (shared_keys, shared_values)]
    return q.new_empty(order.shape[0], q.shape[1]), torch.empty_like(keys), torch.empty_like(values), *shared


def _grouped_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:10], *output)
    ctx.group, ctx.scale, ctx.unit, ctx.query_rows = inputs[10:]
    # the softmax rows [P, M + S] are kept for the backward only: no gradient flows into them, and
    # autograd makes no zeros for them (nor for an unused lse: the kernel then takes d_lse None)
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)


def _grouped_grad(ctx, d_out: Optional[torch.Tensor], d_lse: Optional[torch.Tensor], _d_probs):
    q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets, out, lse, probs = (
        ctx.saved_tensors)
    if d_out is None and d_lse is None:
        return (None,) * 14
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, d_keys, d_values, d_shared_keys, d_shared_values = grouped_backward(
        q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets, out, lse, probs, d_out,
        d_lse, ctx.group, ctx.scale, ctx.unit, ctx.query_rows)
    if ctx.query_rows:
        dq = dq.view(-1, ctx.query_rows, dq.shape[1]).sum(0)  # a query's parts
    if shared_keys is None:
        d_shared_keys = d_shared_values = None
    return dq, d_keys, d_values, d_shared_keys, d_shared_values, *[None] * 9


register_autograd("lra::grouped_forward", _grouped_grad, setup_context=_grouped_setup)


def grouped_attention_cpu(
    q: torch.Tensor,
    expert: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_ok: Optional[torch.Tensor],
    scale: float,
    with_lse: bool = False,
    shared: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]] = None,
    rows: Optional[torch.Tensor] = None,
    unit: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """reference.grouped_attention on the C kernel: the same arguments and results (see there), and
    the expert keys read by index: with ``rows`` [X, S] long, keys and values are [R, D] tables
    and expert x holds rows[x]; ``unit``: experts of different runs of ``unit`` experts share no
    key row (a thread takes whole runs; 1 without rows). Inputs the kernel does not take (not
    float32, not on the CPU) go to the PyTorch path."""
    if not takes(q):
        if rows is not None:
            keys, values = gather_rows(keys, rows), gather_rows(values, rows)  # [X, S, D]
        return grouped_attention(q, expert, keys, values, key_ok, scale, with_lse, shared)
    shared_keys, shared_values, shared_ok, group = shared if shared is not None else (None, None, None, 1)
    experts = rows.shape[0] if rows is not None else keys.shape[0]
    if shared_keys is not None and shared_keys.shape[0] * group < experts:
        raise AttentionError(f"{shared_keys.shape[0]} shared tables in groups of {group} cover fewer than the "
                             f"{experts} experts")
    if rows is None and unit % group:
        unit = unit * group
    # one dtype, contiguous; masks as bytes
    keys, values = keys.to(q.dtype).contiguous(), values.to(q.dtype).contiguous()
    if shared_keys is not None:
        shared_keys, shared_values = shared_keys.to(q.dtype).contiguous(), shared_values.to(q.dtype).contiguous()
    key_ok = None if key_ok is None else key_ok.contiguous().view(torch.uint8)
    shared_ok = None if shared_ok is None else shared_ok.contiguous().view(torch.uint8)
    rows = None if rows is None else rows.contiguous()
    order, offsets = expert_runs_op(expert.to(torch.long).contiguous(), experts)
    out, lse, _ = grouped_forward(q.contiguous(), keys, values, shared_keys, shared_values, rows, key_ok, shared_ok,
                                  order, offsets, group, scale, unit)
    return out, lse if with_lse else q.new_empty(0)


def _merge_shapes(parts: torch.Tensor, slot_major: bool) -> Tuple[int, int, int]:
    """(R, E, D) of parts [R, E, D], or [E, R, D] when slot_major."""
    e, r, d = parts.shape if slot_major else (parts.shape[1], parts.shape[0], parts.shape[2])
    return r, e, d


def _merge_block(parts: torch.Tensor, lse: torch.Tensor, slot_major: bool) -> Merge:
    r, e, d = _merge_shapes(parts, slot_major)
    return Merge(R=r, E=e, D=d, threads=torch.get_num_threads(), slot_major=int(slot_major), parts=_ptr(parts),
                 lse=_ptr(lse))


@custom_op("lra::merge_parts", mutates_args=(), device_types="cpu")
def merge_parts(parts: torch.Tensor, lse: torch.Tensor, slot_major: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """reference.merge on the kernel, contiguous float32: out [R, D] and the parts' weights [R, E]."""
    r, e, d = _merge_shapes(parts, slot_major)
    weights, out = parts.new_empty(r, e), parts.new_empty(r, d)
    args = _merge_block(parts, lse, slot_major)
    args.weights, args.out = _ptr(weights), _ptr(out)
    library().merge_parts(ctypes.byref(args), 0)
    return out, weights


@register_fake("lra::merge_parts")
def _(parts, lse, slot_major):
    r, e, d = _merge_shapes(parts, slot_major)
    return parts.new_empty(r, d), parts.new_empty(r, e)


@custom_op("lra::merge_parts_backward", mutates_args=(), device_types="cpu")
def merge_parts_backward(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                         d_out: torch.Tensor, slot_major: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``merge_parts`` for d_out [R, D]: d parts and d lse, in the parts' layout."""
    d_out = d_out.to(parts.dtype).contiguous()
    d_parts, d_lse = torch.empty_like(parts), torch.empty_like(lse)
    args = _merge_block(parts, lse, slot_major)
    args.weights, args.out = _ptr(weights), _ptr(out)
    args.dout, args.dparts, args.dlse = _ptr(d_out), _ptr(d_parts), _ptr(d_lse)
    library().merge_parts(ctypes.byref(args), 1)
    return d_parts, d_lse


@register_fake("lra::merge_parts_backward")
def _(parts, lse, out, weights, d_out, slot_major):
    return torch.empty_like(parts), torch.empty_like(lse)


def _merge_setup(ctx, inputs, output) -> None:
    parts, lse, ctx.slot_major = inputs
    ctx.save_for_backward(parts, lse, *output)
    # the weights are kept for the backward only
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _merge_grad(ctx, d_out: Optional[torch.Tensor], _d_weights):
    if d_out is None:
        return None, None, None
    parts, lse, out, weights = ctx.saved_tensors
    d_parts, d_lse = merge_parts_backward(parts, lse, out, weights, d_out, ctx.slot_major)
    return d_parts, d_lse, None


register_autograd("lra::merge_parts", _merge_grad, setup_context=_merge_setup)


def merge_cpu(parts: torch.Tensor, lse: torch.Tensor, slot_major: bool = False) -> torch.Tensor:
    """reference.merge (one softmax over each row's E partial results, [R, E, D] and [R, E] -> [R, D];
    slot_major: [E, R, D] and [E, R]) on the C kernel: one pass forward and one backward instead of
    about ten tensor operations each. Inputs the kernel does not take go to reference.merge."""
    if not takes(parts):
        return merge(parts, lse, slot_major)
    return merge_parts(parts.contiguous(), lse.to(parts.dtype).contiguous(), slot_major)[0]
