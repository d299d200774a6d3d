"""Sparse Sinkhorn attention (Tay et al. 2020, Sparse Sinkhorn Attention), non-causal form.

The sequence is cut into blocks of block_size tokens from token 0. A sort network scores, from the
sum of each block's keys, every block against every block: R [m, m] (m real blocks); Sinkhorn
balancing (sinkhorn_iters rounds of row then column normalisation in the log domain, at
temperature T) turns exp(R / T) into a near doubly-stochastic S, and block i's sorted keys and
values are sum_j S_ij (block j). Each query attends to the sorted block at its own block's
place; with ``local`` it also attends to its own block, under a second softmax, and the two
outputs are added (the LRA JAX code's ``x + sorted_x``). Cost O(N b D) for the block attention
plus O((N/b)^2 b D) for sorting the blocks; memory O(N D + (N/b)^2).

Where the LRA JAX code (long-range-arena ``models/sinkhorn_transformer/sinkhorn_attention.py``)
differs, this follows the paper (docs/backends.md):
- its einsum ``'bskhd,bnhl->bsnhd'`` sums over both block indices, so every "sorted" block is the
  sum of all blocks and the sort network gets no gradient; here sorted block i = sum_j S_ij block j;
- its blocks are strided (token t in block t mod N/b) while its padding mask is cut in contiguous
  blocks; here blocks are contiguous and padding is exact: padded tokens add nothing to a sorted
  block or to the sort network, and padded blocks take no part in the balancing;
- it sorts with a row softmax (``sort_activation`` is never set), which is ``sinkhorn_iters: 0``
  here, and its Sinkhorn operator clips the balanced log-weights to [-1, 1]; no clip here;
- no Gumbel noise in either (the paper's Gumbel-Sinkhorn noise is optional).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_lengths
from ..registry import register


@dataclass
class SinkhornConfig:
    # tokens per block (the LRA JAX model default; its image and pathfinder configs set 64)
    block_size: int = 50
    # rounds of row-then-column normalisation; 0 = one row softmax (the sort the LRA JAX code runs)
    sinkhorn_iters: int = 1
    # the sort logits are divided by it before balancing
    temperature: float = 1.0
    # also attend to the query's own block (a second softmax, added), as the LRA JAX code does
    local: bool = True


def balance(logits: torch.Tensor, real_blocks: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn balancing of logits [B, H, M, M] over each sequence's real blocks [B, M] -> S.

    Entries between a real and a padded block are -inf; a padded block keeps only itself, so the
    real m x m corner is balanced exactly as if the padding were not there.
    """
    m = logits.shape[-1]
    both = real_blocks[:, None, :, None] & real_blocks[:, None, None, :]  # [B, 1, M, M]
    eye = torch.eye(m, dtype=torch.bool, device=logits.device)
    alone = eye & ~real_blocks[:, None, :, None]
    log_s = torch.where(both, logits, torch.where(alone, 0.0, float("-inf")).to(logits.dtype))
    if iters == 0:
        return log_s.softmax(-1)
    for _ in range(iters):
        log_s = log_s - log_s.logsumexp(-1, keepdim=True)
        log_s = log_s - log_s.logsumexp(-2, keepdim=True)
    return log_s.exp()


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], sort_weight: torch.Tensor,
    block_size: int, iters: int, temperature: float, local: bool,
) -> torch.Tensor:
    """The same computation one sequence and one block at a time, on each sequence's real tokens."""
    b, h, n, d = q.shape
    out = torch.zeros_like(q)
    for row, length in enumerate(real_lengths(mask, b, n, q.device).tolist()):
        m = -(-length // block_size)
        spans = [slice(i * block_size, min((i + 1) * block_size, length)) for i in range(m)]
        qs, ks, vs = q[row], k[row], v[row]  # [H, N, D]
        # 1. sort logits from each block's key sum, then Sinkhorn balancing
        pooled = torch.stack([ks[:, s].sum(1) for s in spans], 1)  # [H, m, D]
        log_s = (pooled @ sort_weight[:m].T) / temperature  # [H, m, m]
        if iters == 0:
            log_s = log_s.log_softmax(-1)
        for _ in range(iters):
            log_s = log_s - log_s.logsumexp(-1, keepdim=True)
            log_s = log_s - log_s.logsumexp(-2, keepdim=True)
        s = log_s.exp()
        # 2. block i's sorted keys and values: sum_j S_ij (block j), the missing slots of a short block as zeros
        blocks_k = torch.zeros(h, m, block_size, d, dtype=q.dtype)
        blocks_v, slot_real = torch.zeros_like(blocks_k), torch.zeros(m, block_size, dtype=q.dtype)
        for j, sj in enumerate(spans):
            width = sj.stop - sj.start
            blocks_k[:, j, :width], blocks_v[:, j, :width], slot_real[j, :width] = ks[:, sj], vs[:, sj], 1.0
        sorted_k = torch.einsum("hij,hjsd->hisd", s, blocks_k)
        sorted_v = torch.einsum("hij,hjsd->hisd", s, blocks_v)
        fed = torch.einsum("hij,js->his", s, slot_real) > 0  # [H, m, b] slots some real token feeds
        # 3. each query block attends to its sorted block (and to itself when local)
        for i, si in enumerate(spans):
            scores = qs[:, si] @ sorted_k[:, i].transpose(-1, -2) / math.sqrt(d)
            y = scores.masked_fill(~fed[:, i, None, :], float("-inf")).softmax(-1) @ sorted_v[:, i]
            if local:
                y = y + (qs[:, si] @ ks[:, si].transpose(-1, -2) / math.sqrt(d)).softmax(-1) @ vs[:, si]
            out[row, :, si] = y
    return out


@register("sinkhorn")
class SinkhornAttention(Attention):
    order = 4.2
    paper = "Tay et al. 2020, Sparse Sinkhorn Attention"
    published_as = ("Sinkhorn",)
    Config = SinkhornConfig
    cost = "O(N b D + (N/b)^2 b D)"
    whole_sequence = {"block_size": "one block of the whole sequence: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N/b blocks",
        expert_type="raw KV (own block) + a soft-sorted mixture of blocks",
        construction="fixed blocks mixed by a Sinkhorn-balanced sort",
        routing="per-block soft permutation (learned sort network)",
    )

    def __init__(self, dims: AttnDims, cfg: SinkhornConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.block_size < 1 or cfg.sinkhorn_iters < 0 or not cfg.temperature > 0:
            raise AttentionError(
                "sinkhorn needs block_size >= 1, sinkhorn_iters >= 0 and temperature > 0; "
                f"got {cfg.block_size}, {cfg.sinkhorn_iters}, {cfg.temperature}"
            )
        # the sort network: a block's key sum -> its logits over (up to) every block, shared by the
        # heads and without bias, Xavier-uniform, as in the LRA JAX code
        self.sort_net = nn.Linear(dims.head_dim, math.ceil(max(dims.max_len, 1) / cfg.block_size), bias=False)
        nn.init.xavier_uniform_(self.sort_net.weight)

    def budget(self) -> str:
        size = self.cfg.block_size
        if self.cfg.local:
            return f"own block + sorted block = 2 x {size} = {2 * size}"
        return f"sorted block = {size}"

    @classmethod
    def flops(cls, cfg: SinkhornConfig, n: int, d: int) -> Optional[Tuple[float, float]]:
        blocks = math.ceil(n / cfg.block_size)
        attend = (2 if cfg.local else 1) * 4.0 * n * cfg.block_size * d
        forward = attend + 2.0 * blocks * d * blocks + 2 * 2.0 * blocks * blocks * cfg.block_size * d
        return forward, 3 * forward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        cfg = self.cfg
        b, h, n, d = q.shape
        size = cfg.block_size
        blocks = math.ceil(n / size)
        if blocks > self.sort_net.out_features:
            raise AttentionError(f"sinkhorn was built for max_len={self.dims.max_len} but got N={n}; build it with max_len >= {n}")
        pad = blocks * size - n
        lengths = real_lengths(mask, b, n, q.device)
        real = F.pad(torch.arange(n, device=q.device)[None] < lengths[:, None], (0, pad))  # [B, M b]
        keep = real[:, None, :, None]
        qb = F.pad(q, (0, 0, 0, pad)).view(b, h, blocks, size, d)  # [B, H, M, b, D]
        kb = torch.where(keep, F.pad(k, (0, 0, 0, pad)), 0.0).view(b, h, blocks, size, d)
        vb = torch.where(keep, F.pad(v, (0, 0, 0, pad)), 0.0).view(b, h, blocks, size, d)
        # 1. sort logits from each block's key sum [B, H, M, M], then Sinkhorn balancing
        logits = self.sort_net(kb.sum(-2).to(self.sort_net.weight.dtype))[..., :blocks].to(q.dtype) / cfg.temperature
        real_blocks = torch.arange(blocks, device=q.device)[None] * size < lengths[:, None]  # [B, M]
        s = balance(logits, real_blocks, cfg.sinkhorn_iters)
        # 2. sorted keys and values of every block [B, H, M, b, D]; a slot no real token feeds is masked
        sorted_k = (s @ kb.view(b, h, blocks, size * d)).view(b, h, blocks, size, d)
        sorted_v = (s @ vb.view(b, h, blocks, size * d)).view(b, h, blocks, size, d)
        fed = (s @ real.view(b, 1, blocks, size).to(s.dtype)) > 0  # [B, H, M, b]
        # 3. each query block attends to its sorted block, and to itself when local
        scores = qb @ sorted_k.transpose(-1, -2) / math.sqrt(d)  # [B, H, M, b, b]
        low = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~fed[..., None, :], low)
        out = scores.softmax(-1) @ sorted_v  # [B, H, M, b, D]
        if cfg.local:
            scores = (qb @ kb.transpose(-1, -2) / math.sqrt(d)).masked_fill(~real.view(b, 1, blocks, 1, size), low)
            out = out + scores.softmax(-1) @ vb
        out = out.view(b, h, blocks * size, d)[:, :, :n]
        return torch.where(keep[:, :, :n], out, 0.0)
