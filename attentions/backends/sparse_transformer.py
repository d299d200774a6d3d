"""Sparse Transformer, fixed pattern (Child et al. 2019, Generating Long Sequences with Sparse Transformers).

The "fixed" factorized pattern, both halves merged into one softmax (the paper's merged head, as
the LRA code does): query i attends to the keys of its own block of block_size tokens,
A1 = {j : floor(j / l) = floor(i / l)}, and to the summary columns, A2 = {j : j mod l >= l - c}, the
last c positions of every block. Non-causal: the encoder sees summaries before and after it. One
query reaches l + c (N / l - 1) keys, so the cost is O(N (l + c N / l) D): quadratic with the
constant c / l (1/4 at the LRA values l = 128, c = 32) unless l grows as sqrt(N) (the paper's
O(N sqrt N)). Computed as blocked local scores plus one shared [N, S] score matrix against the S
summary keys, chunked over queries (recomputed in the backward), so memory is O(chunk (l + S))
per chunk and no N x N matrix is built.

The authors' LRA code (google-research/long-range-arena, models/sparse_transformer/
sparse_attention.py) builds both halves as dense N x N masks (its timings say nothing of the cost),
makes every pattern causal (a lower-triangular mask, encoder included), takes the summary set as
j mod l in {0} and {l - c, ..., l - 1} (c + 1 columns per block), and with CLS pooling makes the CLS
token attend to and be attended by all. This backend follows the paper: non-causal for the encoder,
c summary columns per block, no CLS special case (the 2-layer protocol pools by the mean).
Padding: padded keys get no weight; every real query has a real key (itself) in its own block; rows
at padded positions are zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_key_mask
from ..registry import register
from .local import masked_softmax, to_blocks, zero_padded_rows


@dataclass
class SparseTransformerConfig:
    # l: tokens per block (LRA JAX Fixed1Pattern / Fixed2Pattern block_size = 128)
    block_size: int = 128
    # c: summary columns at the end of every block (LRA JAX Fixed2Pattern c = 32)
    summary: int = 32
    # queries scored at once against the summary keys; memory is O(chunk_size (block_size + S))
    chunk_size: int = 1024


def summary_positions(n: int, block_size: int, summary: int, device: torch.device) -> torch.Tensor:
    """The summary columns [S] of a length-n sequence: the last ``summary`` positions of every block
    (from n and the settings alone: no read back from the device, a constant under torch.compile)."""
    starts = range(block_size - summary, n, block_size)
    return torch.tensor([j for s in starts for j in range(s, min(s + summary, n))], dtype=torch.long, device=device)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
    block_size: int = 128, summary: int = 32,
) -> torch.Tensor:
    """Each query's own-block positions and the summary positions outside its block gathered by
    index, one softmax over the real ones."""
    b, h, n, d = q.shape
    # 1. A1: the own block (summary columns in it included)
    own = torch.arange(n)[:, None] // block_size * block_size + torch.arange(block_size)  # [N, l]
    inside = own < n
    # 2. A2: the summary columns of the other blocks
    columns = summary_positions(n, block_size, summary, q.device)  # [S]
    index = torch.cat([own.clamp(max=n - 1), columns.expand(n, -1)], dim=1)  # [N, l + S]
    other = columns[None, :] // block_size != torch.arange(n)[:, None] // block_size  # [N, S]
    ok = torch.cat([inside, other], dim=1)[None] & real_key_mask(mask, q)[:, index]  # [B, N, l + S]
    scores = torch.einsum("bhnd,bhnkd->bhnk", q, k[:, :, index]) / math.sqrt(d)
    out = torch.einsum("bhnk,bhnkd->bhnd", masked_softmax(scores, ok[:, None]), v[:, :, index])
    return zero_padded_rows(out, mask)


def chunk_attention(
    q_b: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor, ok_b: torch.Tensor,
    k_s: torch.Tensor, v_s: torch.Tensor, ok_s: torch.Tensor,
) -> torch.Tensor:
    """Blocks of scaled queries q_b [B, H, C, l, D] over their own blocks' keys k_b, v_b [B, H, C, l, D]
    (usable where ok_b [B, 1, C, 1, l]) and the summary keys k_s, v_s [B, H, S, D] (ok_s [B, S]),
    one softmax over both -> [B, H, C, l, D]."""
    b, h, blocks, size, d = q_b.shape
    s = k_s.shape[2]
    if s:
        # the summary keys joined to every block's own keys: a copy of S D per block (1 / D of the scores)
        k_b = torch.cat([k_b, k_s[:, :, None].expand(b, h, blocks, s, d)], dim=3)  # [B, H, C, l + S, D]
        v_b = torch.cat([v_b, v_s[:, :, None].expand(b, h, blocks, s, d)], dim=3)
        ok_b = torch.cat([ok_b, ok_s[:, None, None, None, :].expand(b, 1, blocks, 1, s)], dim=-1)  # [B, 1, C, 1, l + S]
    scores = q_b @ k_b.transpose(-1, -2)  # [B, H, C, l, l + S]
    return masked_softmax(scores, ok_b) @ v_b


@register("sparse_transformer")
class SparseTransformerAttention(Attention):
    order = 3.2
    paper = "Child et al. 2019, Generating Long Sequences with Sparse Transformers"
    published_as = ("Sparse Transformer",)
    Config = SparseTransformerConfig
    cost = "O(N (block_size + summary N / block_size) D)"
    whole_sequence = {"block_size": "one block of the whole sequence: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N/B blocks + 1 shared summary set",
        expert_type="raw KV (contiguous block) + summary columns",
        construction="fixed blocks and fixed columns",
        routing="by position (own block + every summary column)",
    )

    def __init__(self, dims: AttnDims, cfg: SparseTransformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.block_size < 1 or cfg.chunk_size < 1:
            raise AttentionError(
                f"sparse_transformer block_size and chunk_size must be positive integers, got {cfg.block_size}, {cfg.chunk_size}"
            )
        if not 0 <= cfg.summary <= cfg.block_size:
            raise AttentionError(
                f"sparse_transformer summary (columns per block) must be in 0..block_size={cfg.block_size}, got {cfg.summary}"
            )

    @staticmethod
    def keys_per_query(cfg: SparseTransformerConfig, n: int) -> int:
        """Keys a query of the first block reaches at length n: its block plus the other blocks' summaries."""
        size = min(cfg.block_size, n)
        columns = len(summary_positions(n, cfg.block_size, cfg.summary, torch.device("cpu")))
        return size + columns - max(0, size - (cfg.block_size - cfg.summary))

    def budget(self) -> str:
        n = self.dims.max_len
        return f"block_size + summary (N / block_size - 1), N {n} = {self.keys_per_query(self.cfg, n)}"

    @classmethod
    def flops(cls, cfg: SparseTransformerConfig, n: int, d: int) -> Tuple[float, float]:
        """Q K^T and P V over each padded block and the S summary columns: 4 N' (l + S) D; train = forward
        + the recomputed forward + a backward of twice the forward."""
        size = min(cfg.block_size, n)
        padded = -(-n // size) * size
        s = len(summary_positions(n, cfg.block_size, cfg.summary, torch.device("cpu")))
        forward = 4.0 * padded * (size + s) * d
        return forward, 4.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        cfg = self.cfg
        b, h, n, d = q.shape
        size = min(cfg.block_size, n)
        q_b, k_b, v_b = to_blocks(q * (1 / math.sqrt(d)), size), to_blocks(k, size), to_blocks(v, size)  # [B, H, M, l, D]
        blocks = q_b.shape[2]
        real = real_key_mask(mask, q)  # [B, N]
        # A1 without its summary columns (they are A2's): in-block column r is a summary when r >= l - c
        in_block = torch.arange(size, device=q.device) < cfg.block_size - cfg.summary  # [l]
        ok_b = (F.pad(real, (0, blocks * size - n)).view(b, 1, blocks, 1, size) & in_block)  # [B, 1, M, 1, l]
        columns = summary_positions(n, cfg.block_size, cfg.summary, q.device)  # [S]
        k_s, v_s, ok_s = k[:, :, columns], v[:, :, columns], real[:, columns]  # [B, H, S, D], [B, S]
        step = max(1, cfg.chunk_size // size)
        train = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        parts = []
        for start in range(0, blocks, step):
            part = slice(start, start + step)
            args = (q_b[:, :, part], k_b[:, :, part], v_b[:, :, part], ok_b[:, :, part], k_s, v_s, ok_s)
            if train and blocks > step:
                # the [C, l + S] weights of a chunk are recomputed in the backward, not kept for all N
                parts.append(checkpoint(chunk_attention, *args, use_reentrant=False))
            else:
                parts.append(chunk_attention(*args))
        out = torch.cat(parts, dim=2).view(b, h, blocks * size, d)[:, :, :n]  # [B, H, N, D]
        return zero_padded_rows(out, mask)
