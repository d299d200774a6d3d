"""MoBA's gate, the PyTorch form: each query's best key blocks by the dot product with the blocks'
mean keys, its own block forced in, all-padding blocks never chosen.

On the CPU it reads on the host whether any block is empty (skipping the fill when none is), a graph
break under torch.compile; the kernel's operator (cpu.py) has none.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import tuning


@torch.no_grad()
def choose_blocks(q: torch.Tensor, means: torch.Tensor, empty: torch.Tensor, block_size: int, per_query: int,
                  include_own: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``per_query`` best blocks [B, H, N, per_query] (in no order) and whether each holds
    a real key. q [B, H, N, D], means [B, H, blocks, D] (mean over each block's real keys), empty
    [B, blocks] bool (a block without a real key)."""
    b, h, n, _ = q.shape
    blocks = means.shape[2]
    # the results are made whole before the loop and each chunk's gate is freed before the next: a
    # loop that keeps small per-chunk results between gate-sized temporaries fragments the heap,
    # and the resident memory grows by about one gate per chunk, O(N^2 / block_size) in all
    chosen = torch.empty(b, h, n, per_query, dtype=torch.long, device=q.device)
    chosen_ok = torch.empty(b, h, n, per_query, dtype=torch.bool, device=q.device)
    empty = empty[:, None, None, :]  # [B, 1, 1, blocks]
    # (on a GPU the fill runs always: the check would wait for the GPU, a fill costs less)
    any_empty = q.is_cuda or bool(empty.any())
    # a chunk of queries at a time: the [B, H, chunk, blocks] gate stays small
    chunk = tuning.chunk_rows(tuning.GATE_ELEMENTS, b * h * blocks, q.device)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        gate = q[:, :, rows] @ means.transpose(-1, -2)  # [B, H, chunk, blocks]
        if include_own:
            own = torch.arange(rows.start, rows.stop, device=q.device) // block_size
            gate.scatter_(-1, own.expand(b, h, -1)[..., None], float("inf"))
        # an all-padding block is never chosen, not even as a padded query's own block
        if any_empty:
            gate.masked_fill_(empty, float("-inf"))
        top, index = gate.topk(per_query, dim=-1, sorted=False)  # [B, H, chunk, topk']
        chosen[:, :, rows] = index
        chosen_ok[:, :, rows] = top > float("-inf")
    return chosen, chosen_ok
