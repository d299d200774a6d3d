"""Host tuning: how much work one pass of the fast paths takes at a time, measured on one machine.

Every value here sets speed or memory only: results do not depend on them (the tests shrink them
to run the chunked and recomputing code paths on small inputs). They were measured on a 2-core AMD
EPYC (32 MB L3) and an NVIDIA H200; another machine may prefer others.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# a GPU scores 16x more queries at once than the CPU bounds of MiTA's routing and MoBA's gate
# (ROUTE_ELEMENTS, GATE_ELEMENTS: 16 MB of float32 scores, sized for a CPU's cache). Each chunk is a
# few kernel launches: at 64K tokens x batch 32 MiTA's routing took 128 chunks per layer; 16x is
# 256 MB of scores, little beside a GPU's memory
GPU_CHUNK_SCALE = 16
# MiTA's routing scores [B, H, chunk, m] computed at once on the CPU, in elements
ROUTE_ELEMENTS = 1 << 22
# MoBA's block scores [B, H, chunk, N / block_size] computed at once on the CPU, in elements
GATE_ELEMENTS = 1 << 22

# (batch x heads x tokens) that one CPU pass of a routing backend works on: past it the batch is
# split (sequences are independent). MiTA fwd+bwd at B=32, H=2, N=4096 took 943 ms in one pass (8x
# B=8: its temporaries left the cache), 600-660 ms split; at N=1024, 260 ms whole, 186 ms split in two
CPU_BATCH_TOKENS = 1 << 15

# grouped attention (ops/grouped): a chunk of the PyTorch form's tile loop holds CHUNK_SLOTS
# slots; the softmax weights of a call (PyTorch form) or its softmax rows (C kernel) are kept for the
# backward pass up to SAVE_ELEMENTS, else recomputed from the log-sum-exp
CHUNK_SLOTS = 32768
SAVE_ELEMENTS = 1 << 24
# fixed cost of one tile's small matmuls, in slots: the time per slot of a batched [tile, D=32] x
# [D, S=64] product goes as 1 + 20 / tile on the CPU (1.7x lower at tile 64 than 16); used only to
# pick the PyTorch form's tile size
TILE_OVERHEAD_SLOTS = 20


def chunk_rows(elements: int, per_row: int, device: torch.device) -> int:
    """Query rows per chunk of a [B, H, chunk, X] score tensor: ``elements`` scores at a time on the
    CPU, GPU_CHUNK_SCALE times as many on a GPU; per_row = B x H x X. At least one row."""
    scale = GPU_CHUNK_SCALE if device.type == "cuda" else 1
    return max(1, elements * scale // per_row)


def in_batch_chunks(
    forward: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """``forward`` over a few sequences at a time when a CPU batch is larger than CPU_BATCH_TOKENS
    (its temporaries then stay in cache); None when the batch runs whole."""
    b, h, n, _ = q.shape
    rows = max(1, CPU_BATCH_TOKENS // (h * n))
    if q.is_cuda or b <= rows:
        return None
    # torch.split, not one slice per part: a slice's backward makes a zero gradient of the whole
    # batch and copies its part in, so P parts cost P whole-batch fills and adds per input (at
    # B=32, N=4K that made MiTA's layer 1.8x slower per sequence than at B=8); a split's backward
    # is one concatenation
    masks = [None] * len(range(0, b, rows)) if mask is None else mask.split(rows)
    parts = [forward(*chunk, part_mask) for *chunk, part_mask in zip(q.split(rows), k.split(rows), v.split(rows), masks)]
    return torch.cat(parts, dim=0)
