"""Host tuning: how much work one pass of the fast paths takes at a time, measured on one machine.

Every value here sets speed or memory only: results do not depend on them (the tests shrink them
to run the chunked and recomputing code paths on small inputs). They were measured on a 2-core AMD
EPYC (512 KB L2 per core, 32 MB L3), a 2-core Intel Xeon (2 MB L2 per core) and an NVIDIA H200; the
CPU batch split follows the L2 size read from the machine, another machine may prefer other values.
"""
from __future__ import annotations

from pathlib import Path
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


def l2_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> Optional[int]:
    """The level-2 cache of one core in bytes (Linux sysfs: index*/level, type, size such as
    "2048K"), None where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in sorted(cpu.glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if level == "2" and kind in ("Unified", "Data") and size[:-1].isdigit() and size[-1:] in units:
            return int(size[:-1]) * units[size[-1]]
    return None


# (batch x heads x tokens) that one CPU pass of a routing backend works on: past it the batch is
# split (sequences are independent), so that a pass's temporaries stay in the cache. On the AMD EPYC
# (512 KB L2) 2^15: MiTA fwd+bwd at B=32, H=2, N=4096 took 943 ms in one pass, 600-660 ms split; at
# N=1024, 260 ms whole, 186 ms split in two. On the Intel Xeon (2 MB L2) 2^17: one thread, B=8-32,
# N=2K-4K, 5-11% less time than at 2^15 (MoBA's layer 5% at B=8, 4K), the same at 1K. L2 / 16 gives
# both; 2^15 where the L2 size cannot be read.
CPU_BATCH_TOKENS = (l2_bytes() or 1 << 19) // 16

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
