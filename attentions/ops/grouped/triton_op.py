"""Grouped routed attention on Triton kernels: ``grouped_attention`` of reference.py (same arguments, same
results up to float rounding) for CUDA tensors, or for CPU tensors under Triton's interpreter.

The (query, expert) pairs are sorted by expert (``sort_by_expert``) and cut into work items of up
to BLOCK_Q pairs of one expert. Each kernel program reads its expert's keys and values by index
from the [X, S, D] tables (no gathered copies, no scatter-add), the shared table's [M, D] rows
before them, all under one online softmax (triton_kernels.py). With p = softmax(logits),
logits = scale q K^T, the backward is
    d_logits = p * (d_out V^T - d_out . out + d_lse),  dq = scale d_logits K,  dK = scale d_logits^T q,  dV = p^T d_out
with dq per work item and dK, dV per (expert, block of keys); the shared tables' gradients are
written per expert and summed over each group here. No atomics: results are deterministic.

Limits: float32, bfloat16 or float16 inputs (float32 accumulation); D <= 256; any S and M.
Triton is imported only when a kernel runs, so ``attentions`` works without it.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, List, Optional, Tuple

import torch

from ...base import AttentionError
from .reference import expert_runs

# pairs per work item lie in [MIN_TILE, MAX_TILE], a power of two near the mean pairs per expert
MIN_TILE, MAX_TILE = 16, 64
# keys per block of a kernel's loop; the head dim is padded to a power of two, at most MAX_HEAD_DIM
BLOCK_K = 64
MAX_HEAD_DIM = 256
# tl.dot's input precision: float32 products in full, so that results match the PyTorch path (not TF32)
DOT_PRECISION = "ieee"


@torch.compiler.assume_constant_result
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1 asks for Triton's interpreter (it runs kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def refusals(q: torch.Tensor) -> List[str]:
    """Why the Triton kernels do not take queries like ``q`` [P, D]; [] when they do."""
    reasons = []
    if not triton_installed():
        reasons.append("Triton is not installed: pip install triton")
    if q.device.type != "cuda" and not interpreting():
        reasons.append(f"the Triton kernels run on CUDA tensors, these are on {q.device.type} "
                       "(TRITON_INTERPRET=1 runs them in Triton's interpreter on the CPU: slow, for tests)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"the Triton kernels take float32, bfloat16 or float16, not {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        reasons.append(f"the Triton kernels take head_dim <= {MAX_HEAD_DIM}, not {q.shape[-1]}")
    return reasons


def kernels() -> ModuleType:
    """triton_kernels.py, imported on first use (``attentions`` works without Triton).

    Triton runs kernels compiled or in its interpreter as TRITON_INTERPRET was when triton.language
    was first imported; a later change would mix interpreted and compiled functions, so it is an error."""
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language as tl

    from . import triton_kernels

    was = isinstance(tl.zeros, InterpretedFunction)
    if {was, isinstance(triton_kernels.grouped_forward, InterpretedFunction)} != {interpreting()}:
        raise AttentionError(
            f"Triton's interpreter is {'on' if was else 'off'} (TRITON_INTERPRET as it was when triton was first "
            f"imported) but TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r} now: set it before anything "
            "imports triton (the tests: tests/conftest.py)"
        )
    return triton_kernels


@dataclass
class Layout:
    """Pairs sorted by expert (CSR) and cut into work items of up to ``block_q`` pairs of one expert."""

    # [P] pair numbers sorted by expert (the pairs with no expert last); expert x owns order[offsets[x]:offsets[x+1]]
    order: torch.Tensor
    # [X + 1]
    offsets: torch.Tensor
    # [W] per work item: its expert, its first position in order, its number of pairs (0: no work)
    item_expert: torch.Tensor
    item_first: torch.Tensor
    item_rows: torch.Tensor
    block_q: int


def sort_by_expert(expert: torch.Tensor, num_experts: int) -> Layout:
    """Sort pairs by expert; expert: [P] long in [0, X], X = no expert. No host synchronisation:
    W is an upper bound on the work items, and the items past the last real one have 0 pairs."""
    pairs, x = expert.numel(), num_experts
    # pairs per item: a power of two near the mean pairs per expert, in [MIN_TILE, MAX_TILE]
    mean = max(1, pairs // x)
    block_q = min(max(1 << (mean.bit_length() - 1), MIN_TILE), MAX_TILE)
    order, offsets = expert_runs(expert, x)  # [P], [X + 1]
    counts = offsets.diff()  # [X]
    items = (counts + block_q - 1) // block_q  # [X] work items per expert
    items_end = torch.cumsum(items, 0)  # [X]
    # sum over experts of ceil(count / block_q) <= ceil(P / block_q) + (non-empty experts)
    w = torch.arange((pairs + block_q - 1) // block_q + min(x, pairs), device=expert.device)  # [W]
    item_expert = torch.searchsorted(items_end, w, right=True)  # [W] in [0, X]; X past the last item
    e = item_expert.clamp(max=x - 1)
    item_first = offsets[e] + (w - (items_end[e] - items[e])) * block_q
    item_rows = (offsets[e + 1] - item_first).clamp(0, block_q).masked_fill(item_expert == x, 0)
    return Layout(order, offsets, e, item_first, item_rows, block_q)


def launch_meta(d: int, s: int, m: int, block_q: int) -> Dict[str, object]:
    """The kernels' compile-time sizes for head dim d, S routed and M shared keys (speed only: results
    do not depend on them). tl.dot needs every tile dimension >= 16; the warps and key block keep the
    registers from spilling at D <= 64 on sm_90 (scripts/compile_check.py reports them)."""
    if d > MAX_HEAD_DIM:
        raise AttentionError(f"the Triton grouped kernels take head_dim <= {MAX_HEAD_DIM}, got {d}; use kernel='torch'")
    block_d = max(16, _next_pow2(d))
    block_k = min(BLOCK_K if block_d <= 64 else BLOCK_K // 2, max(16, _next_pow2(max(s, m))))
    return dict(D=d, BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_D=block_d, DOT=DOT_PRECISION,
                num_warps=8 if block_q * block_d >= 64 * 64 else 4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tables(keys, values, shared_keys, shared_values, key_ok, shared_ok) -> Tuple[torch.Tensor, ...]:
    """The six table arguments of a kernel; an absent one is replaced by ``keys``, never read (HAS_* off)."""
    if shared_keys is None:
        shared_keys, shared_values = keys, values
    return (keys, values, keys if key_ok is None else key_ok, shared_keys, shared_values,
            keys if shared_ok is None else shared_ok)


class GroupedAttentionTriton(torch.autograd.Function):
    """softmax(scale q K_e^T) V_e for each pair with its log-sum-exp, on the kernels of triton_kernels.py."""

    @staticmethod
    def forward(ctx, q, keys, values, shared_keys, shared_values, key_ok, shared_ok, group: int, scale: float,
                layout: Layout, with_lse: bool):
        k = kernels()
        s, m = keys.shape[1], 0 if shared_keys is None else shared_keys.shape[1]
        meta = dict(launch_meta(q.shape[1], s, m, layout.block_q), HAS_KEY_OK=key_ok is not None,
                    HAS_SHARED_OK=shared_ok is not None)
        if interpreting() and q.dtype != torch.float32:
            meta["DOT"] = "upcast"
        tables = _tables(keys, values, shared_keys, shared_values, key_ok, shared_ok)
        out = torch.zeros_like(q)  # [P, D]; a pair with no expert keeps 0 ...
        lse = torch.full(q.shape[:1], float("-inf"), dtype=torch.float32, device=q.device)  # [P] ... and -inf
        k.grouped_forward[(layout.item_rows.numel(),)](
            q, layout.order, layout.item_expert, layout.item_first, layout.item_rows, *tables, out, lse,
            s, m, group, scale, HAS_SHARED=shared_keys is not None, **meta,
        )
        ctx.save_for_backward(q, keys, values, shared_keys, shared_values, key_ok, shared_ok, out, lse)
        ctx.group, ctx.scale, ctx.layout, ctx.with_lse, ctx.meta = group, scale, layout, with_lse, meta
        return out, lse.to(q.dtype) if with_lse else q.new_empty(0)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        q, keys, values, shared_keys, shared_values, key_ok, shared_ok, out, lse = ctx.saved_tensors
        k, layout, meta, group = kernels(), ctx.layout, ctx.meta, ctx.group
        x, s, d = keys.shape
        g, m = (0, 0) if shared_keys is None else shared_keys.shape[:2]
        tables = _tables(keys, values, shared_keys, shared_values, key_ok, shared_ok)
        d_out = d_out.to(q.dtype).contiguous()
        # d_logits = p * (d_out . v + offset), offset = d_lse - d_out . out [P] float32, computed and
        # written by the dq kernel for the pairs it owns (a pair with no expert is read by no kernel)
        has_d_lse = ctx.with_lse and d_lse is not None
        d_lse = d_lse.contiguous() if has_d_lse else lse  # without one, lse stands in: never read (HAS_DLSE off)
        offset = torch.empty(q.shape[:1], dtype=torch.float32, device=q.device)
        dq = torch.zeros_like(q)  # [P, D]; a pair with no expert keeps 0
        k.grouped_backward_dq[(layout.item_rows.numel(),)](
            q, d_out, out, d_lse, lse, offset, layout.order, layout.item_expert, layout.item_first, layout.item_rows,
            *tables, dq, s, m, group, ctx.scale, HAS_SHARED=shared_keys is not None, HAS_DLSE=has_d_lse, **meta,
        )
        # each (expert, key block) program writes its own block of d_keys, d_values: no zeros, no atomics;
        # the shared tables' gradients per expert [X, M, D] in float32, summed over each group below
        d_keys, d_values = torch.empty_like(keys), torch.empty_like(values)
        d_shared = torch.zeros(2, max(g * group, 1), max(m, 1), d, dtype=torch.float32, device=q.device)
        blocks = -(-s // meta["BLOCK_K"]) + -(-m // meta["BLOCK_K"])
        k.grouped_backward_dkdv[(x, blocks)](
            q, d_out, lse, offset, layout.order, layout.offsets, *tables, d_keys, d_values, d_shared[0], d_shared[1],
            s, m, group, ctx.scale, **meta,
        )
        d_shared_keys = d_shared_values = None
        if shared_keys is not None:
            d_shared = d_shared.view(2, g, group, m, d).sum(2)  # [2, G, M, D]
            d_shared_keys, d_shared_values = d_shared[0].to(shared_keys.dtype), d_shared[1].to(shared_values.dtype)
        return dq, d_keys, d_values, d_shared_keys, d_shared_values, None, None, None, None, None, None


def grouped_attention_triton(
    q: torch.Tensor,
    expert: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_ok: Optional[torch.Tensor],
    scale: float,
    with_lse: bool = False,
    shared: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """reference.grouped_attention on Triton kernels: the same arguments and results (see there).

    An expert whose keys are all masked gives its pairs out 0 and lse -inf (the PyTorch path: nan);
    the backends never build one."""
    if q.device.type != "cuda" and not interpreting():
        raise AttentionError(
            f"kernel='triton' runs on CUDA tensors, these are on {q.device.type}; set TRITON_INTERPRET=1 to run "
            "the kernels in Triton's interpreter on the CPU (slow: for tests), or use kernel='torch'"
        )
    shared_keys, shared_values, shared_ok, group = shared if shared is not None else (None, None, None, 1)
    if shared_keys is not None and shared_keys.shape[0] * group < keys.shape[0]:
        raise AttentionError(f"{shared_keys.shape[0]} shared tables in groups of {group} cover fewer than the "
                             f"{keys.shape[0]} experts")
    layout = sort_by_expert(expert, keys.shape[0])
    # one dtype for the kernels, q's (as grouped_attention); masks as bytes
    keys, values = keys.to(q.dtype).contiguous(), values.to(q.dtype).contiguous()
    if shared_keys is not None:
        shared_keys, shared_values = shared_keys.to(q.dtype).contiguous(), shared_values.to(q.dtype).contiguous()
    key_ok = None if key_ok is None else key_ok.contiguous().view(torch.uint8)
    shared_ok = None if shared_ok is None else shared_ok.contiguous().view(torch.uint8)
    return GroupedAttentionTriton.apply(
        q.contiguous(), keys, values, shared_keys, shared_values, key_ok, shared_ok, group, scale, layout, with_lse
    )
