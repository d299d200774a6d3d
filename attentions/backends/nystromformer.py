"""Nystromformer (Xiong et al. 2021, Nystromformer: A Nystrom-Based Algorithm for Approximating
Self-Attention).

m landmarks, the segment means of the queries and of the keys (Q~, K~), give a Nystrom
approximation of softmax attention: softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V, with
q and k scaled by D^-1/4 each (so every product is over sqrt(D)). The pseudo-inverse is the
Moore-Penrose iteration Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4, six times, from
Z0 = A^T / max column sum of A. ``conv_kernel`` > 0 adds the paper's depth-wise convolution of V
along the sequence (one filter per head, no bias). Cost O(N m D + m^3) time, O(N m) memory; a query
reaches the m landmarks.

The segments are laid over each sequence's real tokens (torch's adaptive-pool bins, so N need not be
a multiple of m; a sequence shorter than m gets one landmark per token and masks the rest), so real
outputs do not depend on padding. The authors' LRA code (mlpen/Nystromformer
``LRA/code/attention_nystrom.py``) differs, and this follows the paper:
- it zeroes padded q and k and averages them into segments of the padded length (which must be a
  multiple of m), so the landmarks and the normalisers of softmax(Q K~^T) and softmax(Q~ K~^T) depend
  on how much padding there is;
- its pseudo-inverse starts from A^T / the largest column sum over the whole batch and all heads
  (its per-head option is out of reach: the code checks one config key and reads another), coupling
  the sequences of a batch; the paper's Z0 = A^T / (||A||_1 ||A||_inf) is per matrix, as here;
- with m = N it switches to exact softmax attention; here the Nystrom path runs, and reduces to full
  attention as the pseudo-inverse converges.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import pool_real
from ..registry import register


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of a [..., m, m] row-stochastic matrix by the paper's iteration."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    # ||A||_inf = 1 for a row-stochastic A, so Z0 = A^T / ||A||_1 (the largest column sum)
    z = a.transpose(-1, -2) / a.sum(dim=-2).amax(dim=-1)[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


@dataclass
class NystromformerConfig:
    # m: landmarks (segment means; the paper's BERT setting); a shorter sequence gets one per real token
    landmarks: int = 64
    # Moore-Penrose iterations of the pseudo-inverse (the authors' 6)
    pinv_iterations: int = 6
    # length of the depth-wise convolution of V along the sequence (odd); 0 = none
    conv_kernel: int = 0


@register("nystromformer")
class NystromformerAttention(Attention):
    order = 1.2
    paper = "Xiong et al. 2021, Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention"
    published_as = ("Nystromformer", "Nystrom", "Nystrom-128")
    Config = NystromformerConfig
    cost = "O(N m D + m^3)"
    whole_sequence = {"landmarks": "one landmark per token"}
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1 (m landmarks)",
        expert_type="landmark-compressed KV",
        construction="segment means of queries and keys, Nystrom pseudo-inverse",
        routing="dense over landmarks",
    )

    def __init__(self, dims: AttnDims, cfg: NystromformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.landmarks < 1:
            raise AttentionError(f"nystromformer landmarks must be >= 1; got {cfg.landmarks}")
        if cfg.pinv_iterations < 0:
            raise AttentionError(f"nystromformer pinv_iterations must be >= 0; got {cfg.pinv_iterations}")
        if cfg.conv_kernel < 0 or (cfg.conv_kernel > 0 and cfg.conv_kernel % 2 == 0):
            raise AttentionError(f"nystromformer conv_kernel must be 0 (none) or an odd length; got {cfg.conv_kernel}")
        self.conv: Optional[nn.Conv2d] = None
        if cfg.conv_kernel:
            h, size = dims.num_heads, cfg.conv_kernel
            # over [B, H, N, D]: one (size x 1) filter per head, shared by the head's D channels
            self.conv = nn.Conv2d(h, h, (size, 1), padding=(size // 2, 0), bias=False, groups=h)

    def budget(self) -> str:
        return f"m = {self.cfg.landmarks} landmarks"

    @classmethod
    def flops(cls, cfg: NystromformerConfig, n: int, d: int) -> Tuple[float, float]:
        """Q K~^T, Q~ K^T, softmax(Q~ K^T) V and kernel_1 times (Z context) 8 N m D; Z context and Q~ K~^T
        4 m^2 D; 8 m^3 per iteration; the convolution 2 N D c. The backward is twice the forward."""
        m = min(cfg.landmarks, n)
        forward = 8.0 * n * m * d + 4.0 * m * m * d + 8.0 * cfg.pinv_iterations * m**3
        forward += 2.0 * n * d * cfg.conv_kernel
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        # float32 at least, under autocast too: in bf16 the three softmax products and the pseudo-inverse
        # iteration put 2% of the query gradient rows 5-10% off (scripts/device_check.py)
        wide = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            return self.approximate(q.to(wide), k.to(wide), v.to(wide), mask).to(q.dtype)

    def approximate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        m = self.cfg.landmarks
        scale = q.shape[-1] ** -0.25
        q, k = q * scale, k * scale
        # landmarks over each sequence's real tokens; spare landmarks of short sequences are masked
        q_land, real_land = pool_real(q, mask, m)  # [B, H, m, D], [B, m]
        k_land, _ = pool_real(k, mask, m)  # [B, H, m, D]
        scores_1 = q @ k_land.transpose(-1, -2)  # [B, H, N, m]
        scores_2 = q_land @ k_land.transpose(-1, -2)  # [B, H, m, m]
        scores_3 = q_land @ k.transpose(-1, -2)  # [B, H, m, N]
        spare = mask is not None or q.shape[2] < m
        if spare:
            # spare landmarks (a sequence shorter than m) take no weight
            land_cols = real_land[:, None, None, :]  # [B, 1, 1, m]
            scores_1 = scores_1.masked_fill(~land_cols, float("-inf"))
            scores_2 = scores_2.masked_fill(~land_cols, float("-inf"))
        if mask is not None:
            scores_3 = scores_3.masked_fill(~mask[:, None, None, :], float("-inf"))
        kernel_1, kernel_2 = scores_1.softmax(dim=-1), scores_2.softmax(dim=-1)
        if spare:
            # a spare landmark's row is the identity's: kernel_2 stays block diagonal and its real block's
            # pseudo-inverse (and the largest column sum, >= 1) is that of the sequence alone
            eye = torch.eye(m, dtype=q.dtype, device=q.device)
            kernel_2 = torch.where(real_land[:, None, :, None], kernel_2, eye)  # [B, H, m, m]
        context = scores_3.softmax(dim=-1) @ v  # [B, H, m, D]
        # kernel_1 (Z context): the m x m pseudo-inverse meets the m x D context, not the N x m kernel
        out = kernel_1 @ (iterative_pinv(kernel_2, self.cfg.pinv_iterations) @ context)  # [B, H, N, D]
        if self.conv is not None:
            # a zeroed pad reads like the convolution's own zero padding past the end of a lone sequence
            v_real = v if mask is None else v.masked_fill(~mask[:, None, :, None], 0.0)
            out = out + self.conv(v_real)
        return out


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, landmarks: int, iterations: int = 6
) -> torch.Tensor:
    """The Nystrom approximation of one batch without padding, N a multiple of ``landmarks``.

    1. q' = q D^-1/4, k' = k D^-1/4.
    2. Q~, K~: means of m equal consecutive segments of q', k'.
    3. F = softmax(q' K~^T), A = softmax(Q~ K~^T), B = softmax(Q~ k'^T).
    4. Z = A^T / max column sum; six times Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4.
    5. out = F Z (B V)."""
    b, h, n, d = q.shape
    qs, ks = q * d**-0.25, k * d**-0.25
    q_land = qs.reshape(b, h, landmarks, n // landmarks, d).mean(dim=-2)
    k_land = ks.reshape(b, h, landmarks, n // landmarks, d).mean(dim=-2)
    f = (qs @ k_land.transpose(-1, -2)).softmax(-1)
    a = (q_land @ k_land.transpose(-1, -2)).softmax(-1)
    bv = (q_land @ ks.transpose(-1, -2)).softmax(-1) @ v
    eye = torch.eye(landmarks, dtype=q.dtype)
    z = a.transpose(-1, -2) / a.sum(-2).amax(-1)[..., None, None]
    for _ in range(iterations):
        z = 0.25 * z @ (13 * eye - a @ z @ (15 * eye - a @ z @ (7 * eye - a @ z)))
    return f @ z @ bv
