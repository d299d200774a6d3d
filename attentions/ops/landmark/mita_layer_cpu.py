"""MiTA's default form (one routed expert per query, with the shared expert) on the CPU kernels as one
autograd Function over their operators: the same steps and kernels as mita.py's composed path
(landmark/cpu.py, grouped/cpu.py), with the backward written into one set of gradients. It saves
tensors only, and every step is a torch operator or a ``lra::`` operator, so torch.compile traces it
whole (no graph break) and the profiler names each kernel.

Composed of separate Functions, the backward would make each stage's q, k, v gradients as new
tensors for autograd to add: at N = 64K (B = 1, H = 4, D = 32) three [G, N, D] additions, three new
[G, N, D] tensors and a zero [G, m, N] gradient for the scores, about 15% of the step. Here the
grouped kernel's gradients are the buffers: the landmark pass adds its key, value and landmark
gradients into them and the pooling adds its query gradient into dq (the ``*_add`` operators).
tests/test_mita_cpu.py checks it against the composed path and ``mita.reference``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ..grouped.cpu import grouped_backward, grouped_forward, take_rows
from .cpu import kernel_bins, landmark_backward_add, landmark_forward, pool_bins, pool_bins_backward_add, route_order


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
        # 1. landmarks: bin means of the queries over each sequence's real tokens
        starts, ends, real_marks = kernel_bins(mask, b, n, m, q.device)  # [B, m] each
        marks = pool_bins(q.view(g, n, d), starts, ends, h)  # [G, m, D]
        scaled = marks / math.sqrt(d)  # the landmarks as keys: q . L gets 1 / D, L . k gets 1 / sqrt(D)
        # 2-3. the landmarks' scores against every key and the shared values
        mask_bytes = None if mask is None else mask.contiguous().view(torch.uint8)  # [B, N]
        k_rows, v_rows = k.view(g, n, d), v.view(g, n, d)
        shared_values, scores, landmark_lse = landmark_forward(scaled, k_rows, v_rows, mask_bytes, h)
        index, key_ok = select(scores.view(b, h, m, n), keys)  # [B, H, m, keys] each
        # (the kernels drop masks that are all True themselves: no host read here)
        expert_ok = None if mask is None else key_ok.reshape(g * m, keys).contiguous().view(torch.uint8)
        # 4. each query to its best real landmark, as expert g m + j of head g (none: after every run)
        real_marks = real_marks.repeat_interleave(h, dim=0)  # [G, m]
        # 5. the grouped attention: expert e of head x holds key rows index[e] of k and v [G N, D];
        # the queries in expert order, so that the kernel reads q and writes out (and in the backward
        # reads d_out and writes dq) in consecutive rows: 8% less time at 64K than rows scattered
        # over the table; out and dq go back to query order by the inverse permutation (a gather:
        # half the time of index_copy_ with order, 12 vs 22 ms at G N = 262,144 rows, and on the
        # kernel's take_rows half again, 7 ms)
        order, offsets, inverse, q_sorted = route_order(q.view(g, n, d), marks, real_marks)  # [G N], [G m + 1], ...
        heads = torch.arange(g, device=q.device)[:, None]  # [G, 1]
        rows = (index.view(g, m * keys) + heads * n).view(g * m, keys)
        shared_ok = real_marks.contiguous().view(torch.uint8)
        in_order = torch.arange(g * n, device=q.device)
        grouped = (q_sorted, k.view(g * n, d), v.view(g * n, d), scaled, shared_values, rows, expert_ok, shared_ok,
                   in_order, offsets)
        out_sorted, lse, probs = grouped_forward(*grouped, m, scale, m)
        out = take_rows(out_sorted, inverse)
        ctx.save_for_backward(*grouped, out_sorted, lse, probs, order, inverse, starts, ends, mask_bytes, k_rows,
                              v_rows, scores, landmark_lse)
        ctx.dims, ctx.scale, ctx.landmarks = (b, h, n, d), scale, m
        return out.view(b, h, n, d)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        (*grouped, out_sorted, lse, probs, order, inverse, starts, ends, mask_bytes, k_rows, v_rows, scores,
         landmark_lse) = ctx.saved_tensors
        b, h, n, d = ctx.dims
        g, m = b * h, ctx.landmarks
        scaled, shared_values = grouped[3], grouped[4]
        # the grouped attention's gradients, new tensors: dq, dk, dv [G N, D], d scaled, d shared values [G, m, D]
        d_out_sorted = take_rows(d_out.reshape(g * n, d).contiguous(), order)  # [G N, D], expert order
        dq_sorted, dk, dv, d_scaled, d_shared_values = grouped_backward(
            *grouped, out_sorted, lse, probs, d_out_sorted, None, m, ctx.scale, m)
        dq = take_rows(dq_sorted, inverse)
        # the landmark pass adds its d scaled marks, dk, dv to them; the pooling its dq
        landmark_backward_add(scaled, k_rows, v_rows, mask_bytes, scores, landmark_lse, shared_values, d_shared_values,
                              h, d_scaled, dk.view(g, n, d), dv.view(g, n, d))
        pool_bins_backward_add(d_scaled * ctx.scale, starts, ends, h, dq.view(g, n, d))
        return dq.view(b, h, n, d), dk.view(b, h, n, d), dv.view(b, h, n, d), None, None, None, None
