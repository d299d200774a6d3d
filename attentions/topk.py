"""Top-k attention (Gupta et al. 2021, Memory-efficient Transformers via Top-k Attention).

Each query keeps its own k highest-scoring real keys and takes a softmax over those k only. Scores
are built for a chunk of queries at a time, so memory is O(chunk N) instead of O(N^2); in training
each chunk is recomputed in the backward pass (activation checkpointing), which keeps the bound.
Time stays O(N^2 D): every query still scores every key. One query attends to k keys: 64 at the
Config default, 128 in configs/attn/topk.yaml (all real keys, i.e. full attention, when N <= k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from .registry import register


@dataclass
class TopKConfig:
    # k: keys each query keeps (clamped to the number of real keys)
    topk: int = 64
    # queries scored at once; memory is O(chunk_size x N)
    chunk_size: int = 1024


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, topk: int = 64
) -> torch.Tensor:
    """Plain top-k attention on the full [N, N] score matrix. [B, H, N, D] -> [B, H, N, D]."""
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)  # [B, H, N, N]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    index = scores.topk(min(topk, k.shape[2]), dim=-1).indices  # [B, H, N, k]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, True)
    # a kept padded key still scores -inf, so a short sequence's extra slots get zero weight
    return scores.masked_fill(~keep, float("-inf")).softmax(dim=-1) @ v


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor], keys: int
) -> torch.Tensor:
    """Top-k attention of a chunk of queries q [B, H, C, D] over all keys -> [B, H, C, D]."""
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)  # [B, H, C, N]
    if key_bias is not None:
        scores = scores + key_bias
    top, index = scores.topk(keys, dim=-1, sorted=False)  # [B, H, C, keys]
    # the k weights laid back into a [C, N] row: one dense matmul beats gathering k values per query
    # (CUDA autocast gives the softmax in float32 and the scores in bf16: scatter wants one dtype)
    weights = torch.zeros_like(scores).scatter(-1, index, top.softmax(dim=-1).to(scores.dtype))  # [B, H, C, N]
    return weights @ v


@register("topk")
class TopKAttention(Attention):
    paper = "Gupta et al. 2021, Memory-efficient Transformers via Top-k Attention"
    Config = TopKConfig
    cost = "O(N^2 D) time, O(chunk N) memory"
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N (one per query)",
        expert_type="raw KV",
        construction="per-query top-k of scores",
        routing="per-query top-k",
    )

    def __init__(self, dims: AttnDims, cfg: TopKConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.topk < 1:
            raise AttentionError(f"topk attention needs topk >= 1 (keys per query), got {cfg.topk}")
        if cfg.chunk_size < 1:
            raise AttentionError(f"topk attention needs chunk_size >= 1 (queries scored at once), got {cfg.chunk_size}")

    def budget(self) -> str:
        return f"k = {self.cfg.topk}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        n = q.shape[2]
        keys = min(self.cfg.topk, n)
        key_bias = None
        if mask is not None:
            # 0 on real keys, -inf on padding: padded keys lose every top-k comparison
            key_bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            key_bias = key_bias[:, None, None, :]  # [B, 1, 1, N]
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        outs = []
        for start in range(0, n, self.cfg.chunk_size):
            q_chunk = q[:, :, start : start + self.cfg.chunk_size]
            if training:
                outs.append(checkpoint(chunk_attention, q_chunk, k, v, key_bias, keys, use_reentrant=False))
            else:
                outs.append(chunk_attention(q_chunk, k, v, key_bias, keys))
        return torch.cat(outs, dim=2)
