"""Kernelized Attention (Chen et al. 2021, Skyformer: Remodel Self-Attention with Gaussian Kernel and
Nystrom Method, Sec. 4.1).

Softmax is replaced by the Gaussian kernel with bandwidth D^1/4 and no row normalisation:
out_i = sum_j exp(-|q_i - k_j|^2 / (2 sqrt(D))) v_j over the real keys j, i.e. C V with
C = kappa(Q / D^1/4, K / D^1/4). It is as quadratic as full attention: O(N^2 D) time.

The fast path never forms the N x N kernel: with q' = q / D^1/4, k' = k / D^1/4 each weight is
exp(q'.k' - |k'|^2/2) / exp(|q'|^2/2), so softmax attention over the real keys plus one null key of
logit |q'|^2/2 and value e_(D+1) gives weights kappa_ij / (1 + s_i), s_i = sum_j kappa_ij, and the
null column 1 / (1 + s_i); dividing by it gives C V exactly. The logits ride on two extra
coordinates (q'' = [q', |q'|^2/2, 1], k'' = [k', 0, -|k'|^2/2], null = [0, 1, 0]), so torch's
fused SDPA runs it in O(N) memory, and the null key always holds the largest logit (kappa <= 1).
``reference`` below is the plain N x N form, as the authors' ``SoftmaxAttention_RBF``
(pkuzengqi/Skyformer src/models/attention.py), which also drops out attention weights; here, as in
every backend of the suite, there is no attention dropout.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, NoConfig, Taxonomy, check_inputs
from ..registry import register


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """exp(-|q_i - k_j|^2 / (2 sqrt(D))) over real keys times V, unnormalised. [B, H, N, D] -> same."""
    distance = torch.cdist(q, k) ** 2  # [B, H, N, N]
    kernel = torch.exp(-distance / (2 * q.shape[-1] ** 0.5))
    if mask is not None:
        kernel = kernel * mask[:, None, None, :]
    return kernel @ v


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The Gaussian-kernel sum through fused softmax attention and one null key (the docstring above)."""
    b, h, _, d = q.shape
    n = k.shape[2]
    q, k = q * d**-0.25, k * d**-0.25
    half_q = 0.5 * (q * q).sum(-1, keepdim=True)  # [B, H, S, 1]
    half_k = 0.5 * (k * k).sum(-1, keepdim=True)  # [B, H, N, 1]
    # zero columns up to a multiple of 8 (fused kernels' alignment) change no dot product
    extra = -(d + 2) % 8
    q2 = F.pad(torch.cat([q, half_q, torch.ones_like(half_q)], dim=-1), (0, extra))  # [B, H, S, D']
    k2 = F.pad(torch.cat([k, torch.zeros_like(half_k), -half_k], dim=-1), (0, extra))  # [B, H, N, D']
    null_k = torch.zeros(b, h, 1, k2.shape[-1], dtype=q.dtype, device=q.device)
    null_k[..., d] = 1.0
    k2 = torch.cat([k2, null_k], dim=2)  # [B, H, N+1, D']
    v2 = F.pad(v, (0, k2.shape[-1] - d, 0, 1))  # [B, H, N+1, D']
    v2[..., n, d] = 1.0
    attn_mask = None
    if mask is not None:
        attn_mask = F.pad(mask, (0, 1), value=True)[:, None, None, :]  # [B, 1, 1, N+1]
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=attn_mask, scale=1.0)  # [B, H, S, D']
    return out[..., :d] / out[..., d : d + 1]


@register("kernelized")
class KernelizedAttention(Attention):
    order = 1.4
    paper = "Chen et al. 2021, Skyformer: Remodel Self-Attention with Gaussian Kernel and Nystrom Method"
    published_as = ("Kernelized",)
    Config = NoConfig
    cost = "O(N^2 D)"
    independent_queries = True
    taxonomy = Taxonomy(
        scaling="none",
        expert_count="1",
        expert_type="raw KV (all N keys)",
        construction="none: the whole context",
        routing="dense: Gaussian-kernel weights, unnormalised",
    )

    def budget(self) -> str:
        return "N (every real key, unnormalised Gaussian-kernel weights)"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Tuple[float, float]:
        """Q K^T and C V as in full attention: 4 N^2 D forward; train = 3x forward."""
        forward = 4.0 * n * n * d
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        return kernel_attention(q, k, v, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, D] over k, v [B, H, N, D] -> [B, H, S, D] (S may differ from N), no mask."""
        return kernel_attention(q, k, v, None)
