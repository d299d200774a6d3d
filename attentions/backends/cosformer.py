"""cosFormer (Qin et al. 2022, cosFormer: Rethinking Softmax in Attention), the non-causal form.

Scores are ReLU(q_i) . ReLU(k_j) re-weighted by cos(pi/2 * (i - j) / M), which favours nearby tokens;
the cosine splits as cos(a_i) cos(a_j) + sin(a_i) sin(a_j) with a_i = pi/2 * i / M, so each feature
map is doubled into [phi(x) sin(a), phi(x) cos(a)] and the keys and values fold into one 2D x D state,
as in linear attention: query i reads q'_i S / max(q'_i . z, eps). Cost O(N D^2) time and O(D^2)
state per head; every query reaches all N real keys through that state.

Positions follow the authors' code (OpenNLPLab/cosFormer ``cosformer.py``): i = 1..M and M the
sequence length. With padding, i counts a row's real tokens only and M is that row's real length,
so a padded sequence computes exactly what it computes alone. The authors' module takes no padding
mask (padded keys enter the state and the normaliser, and M counts the padding); the contract's
masking is followed here. Their ``elu`` feature option is broken (``1 + F.elu`` is not a function);
the paper's ReLU is the only feature map here. ``reference`` is the plain N x N form of the paper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register


@dataclass
class CosformerConfig:
    # the normaliser q' . z is clamped to at least eps (ReLU features can make it 0), as the authors do
    eps: float = 1e-6


def angles(q: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """a_i = pi/2 * i / M [B, 1, N, 1]: i = 1.. over each row's real tokens, M its real length."""
    b, _, n, _ = q.shape
    if mask is None:
        position = torch.arange(1, n + 1, device=q.device, dtype=q.dtype).expand(b, n)  # [B, N]
        length = torch.full((b, 1), float(n), device=q.device, dtype=q.dtype)
    else:
        position = mask.cumsum(dim=1).to(q.dtype)  # [B, N]
        length = mask.sum(dim=1, keepdim=True).clamp_min(1).to(q.dtype)  # [B, 1]
    return (math.pi / 2 * position / length)[:, None, :, None]


def reweighted(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """[ReLU(x) sin(a), ReLU(x) cos(a)]: [B, H, N, D] -> [B, H, N, 2D]."""
    phi = F.relu(x)
    return torch.cat([phi * torch.sin(angle), phi * torch.cos(angle)], dim=-1)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, eps: float = 1e-6
) -> torch.Tensor:
    """The paper's quadratic form: weights ReLU(q_i) . ReLU(k_j) cos(a_i - a_j) over real keys, each row
    divided by its sum (clamped to eps), times V. [B, H, N, D]."""
    angle = angles(q, mask)[:, :, :, 0]  # [B, 1, N]
    scores = F.relu(q) @ F.relu(k).transpose(-1, -2)  # [B, H, N, N]
    scores = scores * torch.cos(angle[..., :, None] - angle[..., None, :])
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], 0.0)
    return scores @ v / scores.sum(dim=-1, keepdim=True).clamp_min(eps)


@register("cosformer")
class CosformerAttention(Attention):
    order = 1.5
    paper = "Qin et al. 2022, cosFormer: Rethinking Softmax in Attention"
    published_as: Tuple[str, ...] = ("cosFormer",)
    Config = CosformerConfig
    cost = "O(N D^2)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="kernel feature state (2D x D), cos re-weighted",
        construction="sum of [ReLU(k) sin, ReLU(k) cos] v^T over the context",
        routing="dense",
    )

    def __init__(self, dims: AttnDims, cfg: CosformerConfig) -> None:
        super().__init__(dims, cfg)
        if not (math.isfinite(cfg.eps) and cfg.eps > 0):
            raise AttentionError(f"cosformer eps must be a finite number > 0 (the normaliser's floor); got {cfg.eps}")

    def budget(self) -> str:
        d = self.dims.head_dim
        return f"N (all keys, through a {2 * d} x {d} re-weighted kernel state)"

    @classmethod
    def flops(cls, cfg: CosformerConfig, n: int, d: int) -> Tuple[float, float]:
        """The state K'^T V 2 N (2D) D, the read Q' S 2 N (2D) D, the normaliser's sum and dot 2 N (2D) each:
        8 N D^2 + 8 N D forward; the backward is twice the forward."""
        forward = 8.0 * n * d * d + 8.0 * n * d
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        angle = angles(q, mask)  # [B, 1, N, 1]
        q_ = reweighted(q, angle)  # [B, H, N, 2D]
        k_ = reweighted(k, angle)  # [B, H, N, 2D]
        if mask is not None:
            # padded keys drop out of both the key-value state and the normaliser
            k_ = k_.masked_fill(~mask[:, None, :, None], 0.0)
        state = k_.transpose(-1, -2) @ v  # [B, H, 2D, D]
        norm = k_.sum(dim=-2)  # [B, H, 2D]
        denominator = (q_ @ norm.unsqueeze(-1)).clamp_min(self.cfg.eps)  # [B, H, N, 1]
        return (q_ @ state) / denominator
