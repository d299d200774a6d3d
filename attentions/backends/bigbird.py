"""BigBird (Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences), block-sparse ITC form.

The sequence is cut into blocks of block_size tokens from token 0. A query of block i attends,
under one softmax, to the keys of: the two global blocks (the first block and the last real
block), its window (blocks i-1, i, i+1) and num_random_blocks random blocks drawn without
replacement from the other blocks; the queries of the two global blocks attend to every key. Cost
O(N (5 + r) b D) for the sparse rows plus O(2 b N D) for the global rows; memory linear in N.
The random draws are a seeded buffer, so a checkpoint reloads the same pattern.

Where the authors' code and the paper differ (the paper is followed; docs/backends.md):
- Skyformer's ``src/models/attention_bigbird.py`` (HF transformers' block-sparse code, which the
  PyTorch LRA numbers ran) calls ``np.random.seed(None)`` (its config sets no ``random_seed``), so
  the pattern changes at every forward; google-research/bigbird and the JAX LRA code fix it per
  layer. Here it is fixed, seeded and saved.
- Skyformer's code takes the last block of the padded length as global and draws from all of its
  blocks, so padding changes what real tokens see; here the last *real* block is global and the
  random blocks are drawn among real blocks, so padding changes nothing.
- Its old random plan (lengths 1024, 3072, 4096) can draw a window block again for the last
  rows, counting those keys twice; here the random blocks never repeat a window or global block.
- It needs N to be a multiple of block_size; here the last block may be short.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_lengths
from ..registry import register

# random draws are integers in [0, 2^31): an integer buffer survives module.to(dtype) unchanged
DRAW_BITS = 31
# queries whose block rows are computed at once (speed only: the gathered keys and scores of a chunk
# stay in cache; 4096 ran the N = 64K forward about 1.7x faster than one pass on a 2-core Xeon)
QUERIES_PER_CHUNK = 4096


@dataclass
class BigBirdConfig:
    # tokens per block (window, global and random keys all come in blocks of this size)
    block_size: int = 64
    # random key blocks per query block
    num_random_blocks: int = 3
    # seed of the random blocks; None draws it from torch's generator when the module is built, so
    # each layer of a seeded model gets its own pattern (google-research/bigbird seeds by layer)
    seed: Optional[int] = None


def block_pattern(lengths: torch.Tensor, blocks: int, block_size: int, draws: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Key blocks of each query block: indices [B, blocks, H, 5 + r] and whether each slot is used.

    Slots: first block, last real block, window i-1, i, i+1, then r random blocks. ``draws``
    [>= blocks, H, r] are the seeded integers; a sequence of m real blocks draws its random blocks
    from the middle blocks 1 .. m-2 outside the window, without replacement (a slot is unused
    where fewer remain). A slot that repeats an earlier one, or lies past the real blocks, is unused.
    """
    m = (lengths + block_size - 1).div(block_size, rounding_mode="floor")[:, None, None]  # [B, 1, 1] real blocks
    i = torch.arange(blocks, device=lengths.device)[None, :, None]  # [1, blocks, 1]
    heads, r = draws.shape[1], draws.shape[2]
    draws = draws[:blocks][None]  # [1, blocks, H, r]
    # the window's share of the middle blocks 1 .. m-2: [lo, hi], `excluded` blocks
    lo, hi = (i - 1).clamp(min=1), torch.minimum(i + 1, m - 2)
    excluded = (hi - lo + 1).clamp(min=0)
    free = (m - 2 - excluded).clamp(min=0)  # [B, blocks, 1] blocks to draw from
    chosen = []
    for t in range(r):
        # the y-th of the free blocks not drawn yet, y uniform in [0, free - t)
        y = (draws[..., t] * (free - t).clamp(min=0)) >> DRAW_BITS  # [B, blocks, H]
        for earlier in (torch.stack(chosen, -1).sort(-1).values.unbind(-1) if chosen else ()):
            y = y + (y >= earlier).long()
        chosen.append(y)
    ranks = torch.stack(chosen, -1) if r else lo.new_zeros(m.shape[0], blocks, heads, 0)  # [B, blocks, H, r]
    lo4, excluded4 = lo[..., None], excluded[..., None]
    rand = 1 + ranks + torch.where(1 + ranks >= lo4, excluded4, 0)
    rand_ok = torch.arange(r, device=lengths.device) < free[..., None]  # [B, blocks, 1, r]
    fixed = torch.cat([t.expand(m.shape[0], blocks, 1) for t in (torch.zeros_like(i), m - 1, i - 1, i, i + 1)], -1)  # [B, blocks, 5]
    fixed = fixed[:, :, None, :].expand(-1, -1, heads, -1)
    index = torch.cat([fixed, rand], -1)  # [B, blocks, H, 5 + r]
    used = (index >= 0) & (index < m[..., None]) & (i < m)[..., None]
    used = used & torch.cat([used.new_ones(fixed.shape), rand_ok.expand_as(rand)], -1)
    earlier_same = (index[..., :, None] == index[..., None, :]) & used[..., None, :]  # [.., slot, earlier slot]
    used = used & ~earlier_same.tril(-1).any(-1)
    return index.clamp(0, blocks - 1), used


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], block_size: int, draws: torch.Tensor,
) -> torch.Tensor:
    """BigBird one query block at a time: softmax over the real keys of the blocks it reaches."""
    b, h, n, d = q.shape
    lengths = real_lengths(mask, b, n, q.device)
    blocks = math.ceil(n / block_size)
    index, used = block_pattern(lengths, blocks, block_size, draws)  # [B, blocks, H, S]
    out = torch.zeros_like(q)
    for row, length in enumerate(lengths.tolist()):
        m = -(-length // block_size)
        for head in range(h):
            for i in range(m):
                # global rows (the first and the last real block) reach every block
                reached = range(m) if i in (0, m - 1) else index[row, i, head][used[row, i, head]].tolist()
                keys = torch.cat([torch.arange(j * block_size, min((j + 1) * block_size, length)) for j in reached])
                rows = slice(i * block_size, min((i + 1) * block_size, length))
                scores = q[row, head, rows] @ k[row, head, keys].T / math.sqrt(d)
                out[row, head, rows] = scores.softmax(-1) @ v[row, head, keys]
    return out


@register("bigbird")
class BigBirdAttention(Attention):
    order = 3.4
    paper = "Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences"
    published_as = ("BigBird",)
    Config = BigBirdConfig
    cost = "O(N (5 + r) b D + 2 b N D)"
    whole_sequence = {"block_size": "one block of the whole sequence: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N/b blocks",
        expert_type="raw KV (contiguous block)",
        construction="fixed blocks",
        routing="fixed pattern: 2 global + 3 window + r seeded random blocks",
    )

    def __init__(self, dims: AttnDims, cfg: BigBirdConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.block_size < 1 or cfg.num_random_blocks < 0:
            raise AttentionError(
                f"bigbird needs block_size >= 1 and num_random_blocks >= 0; got {cfg.block_size}, {cfg.num_random_blocks}"
            )
        seed = cfg.seed if cfg.seed is not None else int(torch.randint(2**62, ()))
        gen = torch.Generator().manual_seed(seed)
        blocks = math.ceil(max(dims.max_len, 1) / cfg.block_size)
        # [max blocks, H, r]: the random draws of every (query block, head), saved with the model
        self.register_buffer("draws", torch.randint(2**DRAW_BITS, (blocks, dims.num_heads, cfg.num_random_blocks), generator=gen))

    def budget(self) -> str:
        r, size = self.cfg.num_random_blocks, self.cfg.block_size
        return f"(2 global + 3 window + {r} random) x {size} = {(5 + r) * size}"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Optional[Tuple[float, float]]:
        blocks = math.ceil(n / cfg.block_size)
        keys = min(5 + cfg.num_random_blocks, blocks) * cfg.block_size
        forward = 4.0 * n * keys * d + 2 * 4.0 * min(cfg.block_size, n) * n * d
        return forward, 3 * forward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        size = self.cfg.block_size
        blocks = math.ceil(n / size)
        if blocks > self.draws.shape[0]:
            raise AttentionError(f"bigbird was built for max_len={self.dims.max_len} but got N={n}; build it with max_len >= {n}")
        pad = blocks * size - n
        lengths = real_lengths(mask, b, n, q.device)
        real = F.pad(torch.arange(n, device=q.device)[None] < lengths[:, None], (0, pad))  # [B, blocks * size]
        # the scale on the queries (N D work) rather than on the scores (N (5 + r) b work)
        qb, kb, vb = (F.pad(x, (0, 0, 0, pad)) if pad else x for x in (q * (1 / math.sqrt(d)), k, v))
        qb, kb, vb = (x.reshape(b, h, blocks, size, d) for x in (qb, kb, vb))  # [B, H, blocks, b, D]
        index, used = block_pattern(lengths, blocks, size, self.draws)  # [B, blocks, H, S]
        slots = index.shape[-1]
        index = index.permute(0, 2, 1, 3)  # [B, H, blocks, S]
        key_ok = used.permute(0, 2, 1, 3)  # [B, H, blocks, S]
        rows = torch.arange(b, device=q.device)
        bi, hi = rows[:, None, None, None], torch.arange(h, device=q.device)[None, :, None, None]
        # query blocks a chunk at a time: the gathered keys and the scores stay cache-sized
        chunk = max(1, QUERIES_PER_CHUNK // size)
        outs = []
        for start in range(0, blocks, chunk):
            reached = index[:, :, start:start + chunk]  # [B, H, C, S]
            c = reached.shape[2]
            keys = kb[bi, hi, reached].view(b, h, c, slots * size, d)  # [B, H, C, S b, D]
            values = vb[bi, hi, reached].view(b, h, c, slots * size, d)
            ok = real.view(b, 1, blocks, size)[bi, 0, reached] & key_ok[:, :, start:start + chunk, :, None]  # [B, H, C, S, b]
            scores = qb[:, :, start:start + chunk] @ keys.transpose(-1, -2)  # [B, H, C, b, S b]
            # masked in place with the lowest finite score: a row of padded queries with no key stays finite
            scores = scores.masked_fill_(~ok.view(b, h, c, 1, slots * size), torch.finfo(scores.dtype).min)
            outs.append(scores.softmax(-1) @ values)
        out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]  # [B, H, blocks, b, D]
        # the global blocks' queries (block 0 and the last real block) attend to every real key
        last = (lengths + size - 1).div(size, rounding_mode="floor") - 1  # [B]
        q_global = torch.stack([qb[:, :, 0], qb[rows, :, last]], 2).view(b, h, 2 * size, d)  # [B, H, 2b, D]
        k_all, v_all = kb.view(b, h, blocks * size, d), vb.view(b, h, blocks * size, d)
        g_scores = q_global @ k_all.transpose(-1, -2)  # [B, H, 2b, N']
        g_scores = g_scores.masked_fill_(~real[:, None, None, :], torch.finfo(g_scores.dtype).min)
        g_out = (g_scores.softmax(-1) @ v_all).view(b, h, 2, size, d)
        at = (rows[:, None], torch.arange(h, device=q.device)[None, :])  # [B, 1], [1, H]
        out = out.index_put((*at, last[:, None]), g_out[:, :, 1]).index_put((*at, torch.zeros_like(last)[:, None]), g_out[:, :, 0])
        out = out.view(b, h, blocks * size, d)[:, :, :n]
        return torch.where(real[:, None, :n, None], out, 0.0)
