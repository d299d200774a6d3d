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

Other dtypes (bf16 under autocast) and CUDA tensors take the PyTorch path; a machine where the
kernel cannot be built (no C compiler) keeps the PyTorch path too: ``refusals`` says why
(ops/native.py).
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch

from ...base import AttentionError
from .. import native, tuning
from .reference import expert_runs, gather_rows, grouped_attention, merge

LIBRARY = "grouped_cpu"
_f, _i64 = ctypes.c_float, ctypes.c_int64


class Grouped(ctypes.Structure):
    """The kernel's argument block (``Grouped`` in grouped_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("experts", "S", "D", "M", "group", "unit", "threads", "pairs")] + [
        ("scale", _f)] + [(name, ctypes.c_void_p) for name in (
            "q", "order", "offsets", "keys", "values", "rows", "key_ok", "skeys", "svalues", "sok", "out", "lse",
            "probs", "dout", "dlse", "offset", "dq", "dkeys", "dvalues", "dskeys", "dsvalues")]


class Merge(ctypes.Structure):
    """The merge's argument block (``Merge`` in grouped_cpu.c, field for field)."""

    _fields_ = [(name, _i64) for name in ("R", "E", "D", "threads", "slot_major")] + [
        (name, ctypes.c_void_p) for name in ("parts", "lse", "weights", "out", "dout", "dparts", "dlse")]


def library() -> Optional[ctypes.CDLL]:
    lib = native.load(LIBRARY)
    if lib is not None and not hasattr(lib, "_typed"):
        for fn in (lib.grouped_forward, lib.grouped_backward):
            fn.argtypes, fn.restype = [ctypes.POINTER(Grouped)], ctypes.c_int
        lib.merge_parts.argtypes, lib.merge_parts.restype = [ctypes.POINTER(Merge), ctypes.c_int], ctypes.c_int
        lib.take_rows.argtypes = [ctypes.c_void_p] * 3 + [_i64] * 3
        lib.take_rows.restype = None
        lib._typed = True
    return lib


def refusals(x: torch.Tensor) -> List[str]:
    """Why the C kernel does not take tensors like ``x`` (it takes float32 CPU tensors, once built
    here); [] when it does."""
    return native.refusals(x, LIBRARY)


def fits(x: torch.Tensor) -> bool:
    return not refusals(x)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index) for x [R, D] and index [P] (int64, values in [0, R)), on the kernel
    for contiguous float32 CPU tensors; not differentiable (the callers' Functions route gradients)."""
    if not (fits(x) and x.dim() == 2 and x.is_contiguous() and index.dtype == torch.int64 and index.is_contiguous()):
        return x.index_select(0, index)
    out = x.new_empty(index.shape[0], x.shape[1])
    library().take_rows(x.data_ptr(), index.data_ptr(), out.data_ptr(), index.shape[0], x.shape[1],
                        torch.get_num_threads())
    return out


def _call(fn_name: str, args: Grouped) -> None:
    if getattr(library(), fn_name)(ctypes.byref(args)) != 0:
        raise MemoryError("the grouped CPU kernel could not allocate its per-thread buffers")


def forward_call(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets,
                 group: int, scale: float, unit: int) -> Tuple[torch.Tensor, torch.Tensor, Grouped]:
    """The kernel's forward on prepared inputs (see ``grouped_attention_cpu``): out [P, D], lse [P]
    and the argument block that ``backward_call`` takes, which points into the inputs (keep them alive
    until the backward) and holds the saved softmax rows. ``backward_call`` takes out and lse again."""
    x, s = rows.shape if rows is not None else keys.shape[:2]
    m = 0 if shared_keys is None else shared_keys.shape[1]
    out, lse = torch.empty_like(q), q.new_empty(q.shape[0])  # [P, D], [P]: the kernel writes every pair ...
    none = order[offsets[-1]:]  # ... in an expert's run; a pair with no expert gets 0 and -inf
    out[none], lse[none] = 0.0, float("-inf")
    # the softmax rows [P, M + S] are kept for the backward when they fit (else recomputed)
    probs = q.new_empty(q.shape[0], m + s) if q.shape[0] * (m + s) <= tuning.SAVE_ELEMENTS else None
    args = Grouped(
        experts=x, S=s, D=q.shape[1], M=m, group=group, unit=unit, threads=torch.get_num_threads(),
        pairs=q.shape[0], scale=scale,
        q=_ptr(q), order=_ptr(order), offsets=_ptr(offsets), keys=_ptr(keys), values=_ptr(values), rows=_ptr(rows),
        key_ok=_ptr(key_ok), skeys=_ptr(shared_keys), svalues=_ptr(shared_values), sok=_ptr(shared_ok),
        out=_ptr(out), lse=_ptr(lse), probs=_ptr(probs),
    )
    _call("grouped_forward", args)
    args.probs_tensor = probs
    return out, lse, args


def backward_call(args: Grouped, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  shared_keys: Optional[torch.Tensor], shared_values: Optional[torch.Tensor],
                  order: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  d_out: torch.Tensor, d_lse: Optional[torch.Tensor]):
    """The kernel's backward for the forward whose block ``args`` is, given that forward's out and lse
    (the backward reads both: where the softmax rows were not saved it recomputes them from lse): dq, d keys, d values and the shared tables' gradients (None without
    them), new tensors."""
    d_out = d_out.to(q.dtype).contiguous()
    d_lse = None if d_lse is None else d_lse.to(q.dtype).contiguous()  # [P]
    dq = torch.empty_like(q)
    d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
    d_shared_keys = None if shared_keys is None else torch.zeros_like(shared_keys)
    d_shared_values = None if shared_values is None else torch.zeros_like(shared_values)
    # pairs with no expert are outside every expert's run: their dq is set here
    dq[order[offsets[-1]:]] = 0.0
    # the saved tensors are the forward's own (no copies): the forward's pointers still hold
    offset = q.new_empty(q.shape[0])  # [P], filled by the kernel
    args.out, args.lse = _ptr(out), _ptr(lse)
    args.dout, args.dlse, args.offset, args.dq = _ptr(d_out), _ptr(d_lse), _ptr(offset), _ptr(dq)
    args.dkeys, args.dvalues = _ptr(d_keys), _ptr(d_values)
    args.dskeys, args.dsvalues = _ptr(d_shared_keys), _ptr(d_shared_values)
    _call("grouped_backward", args)
    return dq, d_keys, d_values, d_shared_keys, d_shared_values


class GroupedAttentionCPU(torch.autograd.Function):
    """softmax(scale q K_e^T) V_e for each pair with its log-sum-exp, on grouped_cpu.c."""

    @staticmethod
    def forward(ctx, q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, order, offsets,
                group: int, scale: float, unit: int, with_lse: bool):
        out, lse, ctx.args = forward_call(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok,
                                          order, offsets, group, scale, unit)
        ctx.save_for_backward(q, keys, values, shared_keys, shared_values, rows, key_ok, shared_ok, out, lse,
                              order, offsets)
        ctx.with_lse = with_lse
        return out, lse if with_lse else q.new_empty(0)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        q, keys, values, shared_keys, shared_values, _, _, _, out, lse, order, offsets = ctx.saved_tensors
        grads = backward_call(ctx.args, q, keys, values, shared_keys, shared_values, order, offsets, out, lse, d_out,
                              d_lse if ctx.with_lse else None)
        return *grads, *[None] * 9


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
    if not fits(q):
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
    order, offsets = expert_runs(expert, experts)
    return GroupedAttentionCPU.apply(q.contiguous(), keys, values, shared_keys, shared_values, rows, key_ok, shared_ok,
                                     order, offsets, group, scale, unit, with_lse)


class MergeCPU(torch.autograd.Function):
    """reference.merge on grouped_cpu.c: parts [R, E, D], lse [R, E] -> [R, D] (slot_major: parts
    [E, R, D], lse [E, R])."""

    @staticmethod
    def forward(ctx, parts: torch.Tensor, lse: torch.Tensor, slot_major: bool):
        e, r, d = parts.shape if slot_major else (parts.shape[1], parts.shape[0], parts.shape[2])
        weights, out = parts.new_empty(r, e), parts.new_empty(r, d)
        args = Merge(R=r, E=e, D=d, threads=torch.get_num_threads(), slot_major=int(slot_major), parts=_ptr(parts),
                     lse=_ptr(lse), weights=_ptr(weights), out=_ptr(out))
        library().merge_parts(ctypes.byref(args), 0)
        ctx.save_for_backward(parts, lse, weights, out)
        ctx.args = args
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        parts, lse, *_ = ctx.saved_tensors  # (the forward's own tensors: its pointers still hold)
        d_out = d_out.to(parts.dtype).contiguous()
        d_parts, d_lse = torch.empty_like(parts), torch.empty_like(lse)
        args = ctx.args
        args.dout, args.dparts, args.dlse = _ptr(d_out), _ptr(d_parts), _ptr(d_lse)
        library().merge_parts(ctypes.byref(args), 1)
        return d_parts, d_lse, None


def merge_cpu(parts: torch.Tensor, lse: torch.Tensor, slot_major: bool = False) -> torch.Tensor:
    """reference.merge (one softmax over each row's E partial results, [R, E, D] and [R, E] -> [R, D];
    slot_major: [E, R, D] and [E, R]) on the C kernel: one pass forward and one backward instead of
    about ten tensor operations each. Inputs the kernel does not take go to reference.merge."""
    if not fits(parts):
        return merge(parts, lse, slot_major)
    return MergeCPU.apply(parts.contiguous(), lse.to(parts.dtype).contiguous(), slot_major)
