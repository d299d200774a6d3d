"""Skyformer (Chen et al. 2021, Skyformer: Remodel Self-Attention with Gaussian Kernel and Nystrom Method).

Approximates Kernelized Attention C V, C = kappa(Q / D^1/4, K / D^1/4) with the Gaussian kernel
kappa(x, y) = exp(-|x - y|^2 / 2), by the Nystrom method applied to the PSD completion
Cbar = kappa([Q; K], [Q; K]) (2N x 2N): m landmark rows S of [Q; K], sampled uniformly with
replacement among the real tokens, give C ~ kappa(Q, S) (kappa(S, S) + gamma I)^-1 kappa(S, K); the
inverse is Newton-Schulz iterations on D^-1/2 (M + gamma I) D^-1/2, D = diag((M + gamma I) 1) (the
paper's Sec. 4.4). No row normalisation. Cost O(N m D + iterations m^3) time, O(N m) memory.

Sampling as in the authors' LRA code (pkuzengqi/Skyformer src/models/attention_skyformer.py):
``sampling="split"`` takes the first m // 2 landmarks among the queries' rows and the rest among the
keys'; ``"uniform"`` draws each from all 2n real rows (the paper's Definition 1). The draws are an
int64 buffer (``draws``, uniform in [0, 2^31)); landmark j of a sequence with n real tokens is real
token floor(draws[j] n / 2^31), so padding never moves a landmark. As in the authors' code a fresh
draw is taken at every training forward (``resample="train"``, from torch's RNG, so a checkpoint's
RNG state resumes it); evaluation uses the stored draw, so outputs are reproducible (the authors'
code also redraws at evaluation: ``resample="always"``).
Where the authors' code differs from the paper: the kernel scale is hard-coded to 32^-1/4 (their LRA
head_dim is 32; here D^-1/4, the paper's); the iteration's initial scale is one maximum over the whole
batch and all heads (so one sequence's output depends on the others); here it is per sequence and
head, which keeps outputs exact under padding. ``reference`` below is the plain form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register

SAMPLINGS = ("split", "uniform")
RESAMPLES = ("train", "always", "never")
# landmark j is real row floor(draws[j] * count / 2^31): exact integer arithmetic in every dtype
DRAW_BITS = 31


@dataclass
class SkyformerConfig:
    # landmark rows of [Q; K] (the authors' nb_features)
    features: int = 128
    # "split": half among the queries' rows, half among the keys' (the authors' code); "uniform": all 2N rows
    sampling: str = "split"
    # ridge gamma added to the landmark kernel before inverting (the authors' 1e-1)
    ridge: float = 0.1
    # Newton-Schulz iterations for the inverse (the authors' 6)
    iterations: int = 6
    # a fresh draw at every "train"ing forward, at "always" every forward, or "never" (the stored draw)
    resample: str = "train"


def gaussian_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """exp(-|x_i - y_j|^2 / 2) for x [..., N, D], y [..., M, D] -> [..., N, M]."""
    half_x = 0.5 * (x * x).sum(-1, keepdim=True)  # [..., N, 1]
    half_y = 0.5 * (y * y).sum(-1).unsqueeze(-2)  # [..., 1, M]
    return torch.exp(x @ y.transpose(-1, -2) - half_x - half_y)


def newton_inverse(m: torch.Tensor, iterations: int) -> torch.Tensor:
    """Approximate inverse of each [..., m, m] matrix by the cubic Newton-Schulz iteration of
    Nystromformer (Razavi et al.), started at M^T / max column sum of that matrix."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    scale = m.sum(dim=-2).amax(dim=-1)[..., None, None]  # [..., 1, 1]
    inv = m.transpose(-1, -2) / scale
    for _ in range(iterations):
        mv = m @ inv
        inv = 0.25 * inv @ (13 * eye - mv @ (15 * eye - mv @ (7 * eye - mv)))
    return inv


def landmark_rows(draws: torch.Tensor, lengths: torch.Tensor, sampling: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Which rows of [Q; K] the landmarks are: (rank among the real tokens [B, m], from keys [B, m] bool)."""
    m = draws.shape[0]
    if sampling == "split":
        index = (draws[None, :] * lengths[:, None]) >> DRAW_BITS  # [B, m]
        from_keys = (torch.arange(m, device=draws.device) >= m // 2).expand_as(index)
        return index, from_keys
    index = (draws[None, :] * (2 * lengths[:, None])) >> DRAW_BITS  # [B, m] in [0, 2n)
    from_keys = index >= lengths[:, None]
    return index - from_keys * lengths[:, None], from_keys


def sketch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, landmarks: torch.Tensor, real: Optional[torch.Tensor],
    ridge: float, iterations: int,
) -> torch.Tensor:
    """Nystrom-sketched Gaussian-kernel attention of scaled q, k [B, H, N, D] over landmark rows
    [B, H, m, D]; keys outside ``real`` [B, N] drop out."""
    kq = gaussian_kernel(q, landmarks)  # [B, H, N, m]
    kk = gaussian_kernel(k, landmarks)  # [B, H, N, m]
    if real is not None:
        kk = kk.masked_fill(~real[:, None, :, None], 0.0)
    eye = torch.eye(landmarks.shape[-2], dtype=q.dtype, device=q.device)
    m = gaussian_kernel(landmarks, landmarks) + ridge * eye  # [B, H, m, m]
    d = m.sum(dim=-1).rsqrt()  # [B, H, m]
    inv = newton_inverse(d[..., :, None] * m * d[..., None, :], iterations)  # [B, H, m, m]
    # kq D^-1/2 inv D^-1/2 kk^T v, grouped so that no N x m times m x m product is formed
    context = d[..., None] * (kk.transpose(-1, -2) @ v)  # [B, H, m, D]
    return kq @ (d[..., None] * (inv @ context))


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, from_keys: torch.Tensor,
    mask: Optional[torch.Tensor] = None, ridge: float = 0.1, iterations: int = 6,
) -> torch.Tensor:
    """The plain form: real tokens gathered per sequence, [Q; K] stacked, landmarks picked by index,
    the sketch written out with an explicit inverse matrix. rows, from_keys: [B, m]."""
    b, _, n, d = q.shape
    out = torch.zeros_like(q)
    for i in range(b):
        keep = torch.arange(n) if mask is None else mask[i].nonzero().squeeze(-1)
        qi, ki, vi = q[i][:, keep] * d**-0.25, k[i][:, keep] * d**-0.25, v[i][:, keep]  # [H, n, D]
        stacked = torch.cat([qi, ki], dim=1)  # [H, 2n, D]
        s = stacked[:, rows[i] + from_keys[i] * len(keep)]  # [H, m, D]
        m = gaussian_kernel(s, s) + ridge * torch.eye(s.shape[1], dtype=q.dtype)
        dm = torch.diag_embed(m.sum(-1).rsqrt())  # [H, m, m]
        inv = dm @ newton_inverse(dm @ m @ dm, iterations) @ dm
        out[i][:, keep] = gaussian_kernel(qi, s) @ inv @ gaussian_kernel(s, ki) @ vi
    return out


@register("skyformer")
class SkyformerAttention(Attention):
    order = 1.3
    paper = "Chen et al. 2021, Skyformer: Remodel Self-Attention with Gaussian Kernel and Nystrom Method"
    published_as = ("Skyformer",)
    Config = SkyformerConfig
    cost = "O(N m D + m^3)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1 (m sampled landmarks)",
        expert_type="Nystrom-compressed Gaussian-kernel KV",
        construction="uniform sample of [Q; K] rows, Nystrom inverse",
        routing="dense over landmarks",
    )

    def __init__(self, dims: AttnDims, cfg: SkyformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.features < 1:
            raise AttentionError(f"skyformer features must be >= 1 (landmark rows); got {cfg.features}")
        if cfg.sampling not in SAMPLINGS:
            raise AttentionError(f"skyformer sampling {cfg.sampling!r} is not one of {', '.join(SAMPLINGS)}")
        if cfg.resample not in RESAMPLES:
            raise AttentionError(f"skyformer resample {cfg.resample!r} is not one of {', '.join(RESAMPLES)}")
        if cfg.iterations < 0 or not cfg.ridge >= 0:
            raise AttentionError(f"skyformer needs iterations >= 0 and ridge >= 0; got {cfg.iterations}, {cfg.ridge}")
        self.register_buffer("draws", self.new_draws(torch.device("cpu")))  # [m] int64

    def new_draws(self, device: torch.device) -> torch.Tensor:
        return torch.randint(0, 2**DRAW_BITS, (self.cfg.features,), device=device)

    def budget(self) -> str:
        m = self.cfg.features
        return f"m = {m} landmarks of [Q; K]"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Tuple[float, float]:
        """Kernels of N queries and N keys against m landmarks (4 N m D), kk^T v and kq context
        (4 N m D), four m^3 products per iteration; train = 3x forward."""
        m = cfg.features
        forward = 8.0 * n * m * d + 8.0 * cfg.iterations * m**3 + 2.0 * m * m * d
        return forward, 3.0 * forward

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        if self.cfg.resample == "always" or (self.cfg.resample == "train" and self.training):
            self.draws.copy_(self.new_draws(self.draws.device))
        if mask is None:
            lengths = torch.full((b,), n, dtype=torch.long, device=q.device)
            order = torch.arange(n, device=q.device).expand(b, n)
        else:
            lengths = mask.sum(dim=-1)  # [B]
            # positions of the real tokens first, in order: rank r of a sequence's real tokens -> position
            order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # [B, N]
        rank, from_keys = landmark_rows(self.draws, lengths, self.cfg.sampling)  # [B, m]
        position = order.gather(1, rank)  # [B, m]
        q, k = q * d**-0.25, k * d**-0.25
        index = position[:, None, :, None].expand(b, h, -1, d)
        landmarks = torch.where(from_keys[:, None, :, None], k.gather(2, index), q.gather(2, index))  # [B, H, m, D]
        # float32 at least, under autocast too, as the authors run it: the Newton-Schulz inverse of the
        # landmark kernel amplifies bf16 rounding
        wide = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            out = sketch(q.to(wide), k.to(wide), v.to(wide), landmarks.to(wide), mask, self.cfg.ridge, self.cfg.iterations)
        return out.to(v.dtype)
