"""Longformer attention (Beltagy et al. 2020, Longformer: The Long-Document Transformer).

Sliding window plus global tokens: each query attends to the keys within its window (window keys,
itself included: window - window // 2 at or before it, window // 2 after it, the convention of the
LRA JAX code) and to every global token; a global token's query attends to every key. Which
positions are global is an option (the first token by default: the CLS token of classification,
as the paper's classification setup uses). Cost: O(N (window + G) D + G N D) time, O(N window)
memory: queries run in blocks of b, each against the keys of its own block and of the blocks its
window reaches (an unfold of the padded keys, no N x N matrix); global keys are extra columns of
the same softmax and global queries a dense [G, N] pass.

The authors' code differs from the paper in two ways that change published numbers. The LRA JAX code
(google-research/long-range-arena, models/longformer/longformer_attention.py) builds dense N x N
masks (its timings say nothing of the cost) and passes no global mask, so its "Longformer" rows are
a pure 512-key sliding window with no global token; the default here follows the paper (global
CLS), and global_tokens = [] reproduces the JAX pattern. The paper (and the JAX and HF code) give
global attention its own Q, K, V projections; backends here only mix values (the projections live in
the model), so global and window attention share them.
Padding: padded keys get no weight; every real query has a real key (itself) in its window; rows
at padded positions are zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_key_mask
from ..registry import register
from .local import masked_softmax, to_blocks, zero_padded_rows


@dataclass
class LongformerConfig:
    # keys in a query's sliding window, itself included (LRA JAX sliding_window_size = 512)
    window: int = 512
    # positions whose queries see every key and whose keys every query sees (0: the CLS token)
    global_tokens: Tuple[int, ...] = (0,)


def sides(window: int) -> Tuple[int, int]:
    """(keys at or before the query, itself included; keys after it): the left side takes the odd one."""
    return window - window // 2, window // 2


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    window: int = 512,
    global_tokens: Tuple[int, ...] = (0,),
) -> torch.Tensor:
    """Each query's window positions and the global positions gathered by index, one softmax over the
    real ones; the rows of global queries then replaced by attention over every real key."""
    b, h, n, d = q.shape
    left, right = sides(window)
    glob = torch.tensor(sorted({g for g in global_tokens if g < n}), dtype=torch.long)  # [G]
    is_global = torch.zeros(n, dtype=torch.bool)
    is_global[glob] = True
    # 1. the window positions of each query, a global position counted once (as a global column)
    index = torch.arange(n)[:, None] + torch.arange(-(left - 1), right + 1)  # [N, window]
    inside = (index >= 0) & (index < n)
    index = index.clamp(0, n - 1)
    inside = inside & ~is_global[index]
    # 2. then the global positions, for every query
    index = torch.cat([index, glob.expand(n, -1)], dim=1)  # [N, window + G]
    inside = torch.cat([inside, torch.ones(n, len(glob), dtype=torch.bool)], dim=1)
    real = real_key_mask(mask, q)  # [B, N]
    ok = inside[None] & real[:, index]  # [B, N, window + G]
    scores = torch.einsum("bhnd,bhnkd->bhnk", q, k[:, :, index]) / math.sqrt(d)
    out = torch.einsum("bhnk,bhnkd->bhnd", masked_softmax(scores, ok[:, None]), v[:, :, index])
    # 3. global queries attend to every real key
    if len(glob):
        scores = q[:, :, glob] @ k.transpose(-1, -2) / math.sqrt(d)  # [B, H, G, N]
        out = out.index_copy(2, glob, masked_softmax(scores, real[:, None, None, :]) @ v)
    return zero_padded_rows(out, mask)


@register("longformer")
class LongformerAttention(Attention):
    order = 3.3
    paper = "Beltagy et al. 2020, Longformer: The Long-Document Transformer"
    published_as = ("Longformer",)
    Config = LongformerConfig
    cost = "O(N (window + G) D + G N D)"
    whole_sequence = {"window": "every query's window holds the whole sequence: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N windows + G global tokens",
        expert_type="raw KV (sliding window) + global tokens",
        construction="fixed window around each query",
        routing="by position (own window + global tokens)",
    )

    def __init__(self, dims: AttnDims, cfg: LongformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.window < 1:
            raise AttentionError(f"longformer window must be a positive integer (keys per query), got {cfg.window}")
        tokens = tuple(cfg.global_tokens)
        if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in tokens):
            raise AttentionError(f"longformer global_tokens must be a list of positions >= 0, got {cfg.global_tokens!r}")
        self.global_tokens = tuple(sorted(set(tokens)))

    @classmethod
    def covers(cls, cfg: LongformerConfig, option: str, max_len: int) -> int:
        """A window of 2 max_len - 1 keys reaches every key from every query (the first and the last)."""
        return 2 * max_len - 1

    def budget(self) -> str:
        return f"window + global tokens = {self.cfg.window + len(self.global_tokens)}"

    @staticmethod
    def blocking(window: int, n: int) -> Tuple[int, int, int]:
        """(queries per block b, blocks of keys before the own block, blocks after it): b = 64 keeps
        the keys scored per query within 1.125x of the window at window 512."""
        left, right = sides(window)
        size = max(1, min(64, max(left - 1, right, 1), n))
        blocks = -(-n // size)
        return size, min(-(-(left - 1) // size), blocks - 1), min(-(-right // size), blocks - 1)

    @classmethod
    def flops(cls, cfg: LongformerConfig, n: int, d: int) -> Tuple[float, float]:
        """Scores and mixing over each block's key span and the G global columns, plus the G global rows
        over N keys: 4 N' (span + G) D + 4 G N D; train = 3x."""
        size, back, ahead = cls.blocking(cfg.window, n)
        padded = -(-n // size) * size
        g = len({t for t in cfg.global_tokens if t < n})
        forward = 4.0 * padded * ((1 + back + ahead) * size + g) * d + 4.0 * g * n * d
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        left, right = sides(self.cfg.window)
        size, back, ahead = self.blocking(self.cfg.window, n)
        span = (1 + back + ahead) * size
        glob = [g for g in self.global_tokens if g < n]
        real = real_key_mask(mask, q)  # [B, N]
        q_b = to_blocks(q * (1 / math.sqrt(d)), size)  # [B, H, M, b, D]
        blocks = q_b.shape[2]
        # 1. the keys each block of queries can reach: the own block, back blocks before, ahead after
        pad = (back * size, (blocks + ahead) * size - n)
        k_span = F.pad(k, (0, 0) + pad).unfold(2, span, size).transpose(-1, -2)  # [B, H, M, span, D]
        v_span = F.pad(v, (0, 0) + pad).unfold(2, span, size).transpose(-1, -2)  # [B, H, M, span, D]
        key_ok = real.clone()
        key_ok[:, glob] = False  # a global key is a global column, not a window key
        key_ok = F.pad(key_ok, pad).unfold(1, span, size)  # [B, M, span]
        # query r of a block and key c of its span are (c - back b - r) positions apart
        offset = torch.arange(span, device=q.device) - back * size - torch.arange(size, device=q.device)[:, None]
        band = (offset >= -(left - 1)) & (offset <= right)  # [b, span]
        ok = band & key_ok[:, None, :, None, :]  # [B, 1, M, b, span]
        index = torch.tensor(glob, dtype=torch.long, device=q.device)
        if glob:
            # 2. the global keys as G more keys of every block, under the same softmax
            g = len(glob)
            k_span = torch.cat([k_span, k[:, :, None, index].expand(b, h, blocks, g, d)], dim=3)  # [B, H, M, span + G, D]
            v_span = torch.cat([v_span, v[:, :, None, index].expand(b, h, blocks, g, d)], dim=3)
            ok = torch.cat([ok, real[:, None, None, None, index].expand(b, 1, blocks, size, g)], dim=-1)
        scores = q_b @ k_span.transpose(-1, -2)  # [B, H, M, b, span + G]
        out = (masked_softmax(scores, ok) @ v_span).view(b, h, blocks * size, d)[:, :, :n]  # [B, H, N, D]
        if not glob:
            return zero_padded_rows(out, mask)
        # 3. the global queries over every real key
        scores = (q[:, :, index] * (1 / math.sqrt(d))) @ k.transpose(-1, -2)  # [B, H, G, N]
        out = out.index_copy(2, index, masked_softmax(scores, real[:, None, None, :]) @ v)
        return zero_padded_rows(out, mask)
