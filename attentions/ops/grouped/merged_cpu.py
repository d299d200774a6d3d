"""Grouped attention whose queries have several parts, merged by one softmax over the parts, on the
CPU kernels as one autograd Function: MoBA's blocks (each query attends to its chosen key blocks,
a part per block, the parts merged by their log-sum-exps).

Composed of ``grouped_attention_cpu`` and ``merge_cpu``, the step repeats the queries once per
part, runs the merge's backward as a pass of its own (each part's output gradient w_e d_out and
log-sum-exp gradient [P, D] and [P] written, then read by the grouped backward) and sums the parts'
query gradients through the repeat. Here the kernel reads a part's query row in place
(``query_rows``), and its backward takes the merged d_out and the merge's weights: a part's output
gradient is w_e d_out and its offset -w_e d_out . out (grouped_cpu.c: part_weight), so the merge's
backward is no pass and no tensor of its own. The same results up to float rounding
(tests/test_grouped.py compares the two).
"""
from __future__ import annotations

import torch

from .cpu import expert_runs_op, grouped_backward, grouped_forward, merge_parts


class MergedPartsCPU(torch.autograd.Function):
    """out [R, D] of queries q [R, D] (contiguous float32 CPU) with E parts each: pair p = e R + r
    (part e of query r) attends to expert[p] of the [X, S, D] key and value blocks (expert X: none,
    the part weighs 0), the parts merged by one softmax over their log-sum-exps."""

    @staticmethod
    def forward(ctx, q, expert, keys, values, key_ok, scale: float):
        r, d = q.shape
        parts = expert.shape[0] // r
        order, offsets = expert_runs_op(expert, keys.shape[0])
        part_out, lse, probs = grouped_forward(q, keys, values, None, None, None, key_ok, None, order, offsets, 1,
                                               scale, 1, r)  # [P, D], [P], [P, S]
        out, weights = merge_parts(part_out.view(parts, r, d), lse.view(parts, r), True)  # [R, D], [R, E]
        ctx.save_for_backward(q, keys, values, key_ok, order, offsets, out, lse, probs, weights)
        ctx.scale, ctx.parts = scale, parts
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, keys, values, key_ok, order, offsets, out, lse, probs, weights = ctx.saved_tensors
        r, d = q.shape
        dq, d_keys, d_values, _, _ = grouped_backward(q, keys, values, None, None, None, key_ok, None, order, offsets,
                                                      out, lse, probs, d_out, None, 1, ctx.scale, 1, r, weights)
        return dq.view(ctx.parts, r, d).sum(0), None, d_keys, d_values, None, None


def merged_attention_cpu(q: torch.Tensor, expert: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         key_ok, scale: float) -> torch.Tensor:
    """MergedPartsCPU on prepared inputs: q [R, D], expert [E R] (part-major), keys and values
    [X, S, D], key_ok [X, S] bool or None; inputs of another dtype are cast to q's."""
    keys, values = keys.to(q.dtype).contiguous(), values.to(q.dtype).contiguous()
    key_ok = None if key_ok is None else key_ok.contiguous().view(torch.uint8)
    return MergedPartsCPU.apply(q.contiguous(), expert.to(torch.long).contiguous(), keys, values, key_ok, scale)
