"""Linear attention (Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention).

The softmax kernel is replaced by phi(q) . phi(k) with phi(x) = elu(x) + 1, so the keys and values
fold into one D x D state S = sum_j phi(k_j) v_j^T and a normaliser z = sum_j phi(k_j); query i reads
phi(q_i) S / (phi(q_i) . z + eps). Cost O(N D^2) time, O(D^2) state per head. Every query reaches all
N real keys, but only through the rank-D kernel state. Bidirectional (non-causal).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1: positive everywhere, so the normaliser never vanishes."""
    return F.elu(x) + 1.0


@dataclass
class LinearConfig:
    # added to the normaliser phi(q) . z before dividing
    eps: float = 1e-6


@register("linear")
class LinearAttention(Attention):
    order = 1
    paper = "Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention"
    published_as = ("Linear Transformer",)
    Config = LinearConfig
    cost = "O(N D^2)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="kernel feature state (D x D)",
        construction="sum of phi(k) v^T over the context",
        routing="dense",
    )

    def __init__(self, dims: AttnDims, cfg: LinearConfig) -> None:
        super().__init__(dims, cfg)
        if not (math.isfinite(cfg.eps) and cfg.eps >= 0):
            raise AttentionError(f"linear attention eps must be a finite number >= 0; got {cfg.eps}")
        self.eps = cfg.eps

    def budget(self) -> str:
        d = self.dims.head_dim
        return f"N (all keys, through a {d} x {d} kernel state)"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        phi_q = feature_map(q)  # [B, H, N, D]
        phi_k = feature_map(k)  # [B, H, N, D]
        if mask is not None:
            # padded keys drop out of both the key-value sum and the normaliser
            phi_k = phi_k.masked_fill(~mask[:, None, :, None], 0.0)
        state = phi_k.transpose(-1, -2) @ v  # [B, H, D, D]
        norm = phi_k.sum(dim=-2)  # [B, H, D]
        numerator = phi_q @ state  # [B, H, N, D]
        denominator = phi_q @ norm.unsqueeze(-1)  # [B, H, N, 1]
        return numerator / (denominator + self.eps)
