"""Linformer (Wang et al. 2020, Linformer: Self-Attention with Linear Complexity).

Keys and values are projected along the length by learned [k, max_len] matrices E and F, then each
query takes softmax attention over the k projected rows: softmax(Q (E K)^T / sqrt(D)) (F V). Cost
O(N k D) time and memory; one query attends to k rows (k = 256 by default, as in the paper; the LRA
config uses 128 to match the other backends' budget). A sequence of N < max_len tokens uses E[:, :N].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register


def init_projection(k: int, max_len: int) -> nn.Parameter:
    """A [k, max_len] length projection, Xavier-uniform with gain 1/sqrt(2) as in the authors' fairseq code."""
    weight = torch.empty(k, max_len)
    nn.init.xavier_uniform_(weight, gain=1 / math.sqrt(2))
    return nn.Parameter(weight)


@dataclass
class LinformerConfig:
    # rows the keys and values are projected to along the length
    k: int = 256
    # project the values with E too (no separate F)
    share_kv: bool = False


@register("linformer")
class LinformerAttention(Attention):
    order = 2
    paper = "Wang et al. 2020, Linformer: Self-Attention with Linear Complexity"
    published_as = ("Linformer", "Linformer-seq/4")
    Config = LinformerConfig
    cost = "O(N k D)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="k projected KV rows",
        construction="learned projection along the length",
        routing="dense",
    )

    def __init__(self, dims: AttnDims, cfg: LinformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.k < 1:
            raise AttentionError(f"linformer k must be >= 1 (projected rows); got {cfg.k}")
        if dims.max_len < 1:
            raise AttentionError(f"linformer needs max_len >= 1 to size its projections; got {dims.max_len}")
        # one pair per module instance, so every layer learns its own projections
        self.E = init_projection(cfg.k, dims.max_len)  # [k, max_len]
        self.F = None if cfg.share_kv else init_projection(cfg.k, dims.max_len)  # [k, max_len]

    def budget(self) -> str:
        return f"k = {self.cfg.k}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        n = q.shape[2]
        if n > self.dims.max_len:
            raise AttentionError(
                f"linformer was built for max_len={self.dims.max_len} but got a sequence of N={n}; "
                f"build it with max_len >= {n}"
            )
        if mask is not None:
            # zeroed padded keys and values add nothing to E K and F V
            padded = ~mask[:, None, :, None]  # [B, 1, N, 1]
            k = k.masked_fill(padded, 0.0)
            v = v.masked_fill(padded, 0.0)
        e = self.E[:, :n]  # [k, N]
        f = e if self.F is None else self.F[:, :n]  # [k, N]
        k_proj = e @ k  # [B, H, k, D]
        v_proj = f @ v  # [B, H, k, D]
        return scaled_dot_product_attention(q, k_proj, v_proj)
