"""Performer (Choromanski et al. 2021, Rethinking Attention with Performers), FAVOR+ non-causal.

The softmax kernel exp(q . k / sqrt(D)) is estimated with m positive orthogonal random features
phi(x) = m^-1/2 exp(W x' - |x'|^2 / 2), x' = x D^-1/4, W [m, D] Gaussian rows orthogonalised in
blocks of D (each row rescaled to a chi(D) length); keys and values fold into an m x D state
S = sum_j phi(k_j) v_j^T and a normaliser z = sum_j phi(k_j), and query i reads
phi(q_i) S / (phi(q_i) . z). Cost O(N m D) time, O(m D) state per head; every query reaches all N
real keys through the m features. ``feature_map="relu"`` is the paper's generalised kernel
phi(x) = relu(W x') + 0.001. The features are drawn once from torch's generator (the run's seed) into
a buffer, so a checkpoint reloads them; ``redraw_interval`` > 0 redraws them every that many training
calls (off for the LRA protocol, as in Skyformer's LRA code).

Where the authors' LRA code (google-research/performer ``fast_attention.py``; the PyTorch LRA runs
vendor lucidrains/performer-pytorch ``performer_pytorch.py``) differs from the paper, this follows
the paper:
- padding: their key features of a padded (zeroed) key are phi(0) = m^-1/2 (exp(-max) + eps) > 0,
  which stays in the normaliser z, so padding changes real outputs. Here padded keys add nothing to S
  or z.
- the key stabiliser exp(-max) and the eps = 1e-4 added to every feature are theirs; their max is
  over the whole batch of keys, which couples the sequences of a batch through eps. Here it is the
  max over each sequence's real keys, per head.
- their blocks are plain QR factors, which are not Haar-distributed, so the kernel estimate keeps a
  bias that more features do not remove; here R's diagonal signs are moved into Q (unbiased, as the
  paper's estimator needs).
- mlpen/Nystromformer and pkuzengqi/Skyformer pass kernel "relu" / "exp" without
  ``generalized_attention``: their published Performer rows are FAVOR+ softmax whatever the config
  names. Skyformer's wrapper also scales q and k by D^-1/4 before the kernel scales them again, so its
  runs estimate exp(q . k / D); here the scale is the paper's 1 / sqrt(D).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register

KERNELS = ("softmax", "relu")


def orthogonal_features(features: int, dim: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[features, dim]: rows orthonormal within each block of ``dim`` rows (QR of a Gaussian block),
    each row then scaled to the length of a Gaussian vector, so every row is marginally N(0, I).

    The signs of R's diagonal are moved into Q, which makes Q Haar-distributed (Mezzadri 2007); the
    plain QR factor is not, and its features estimate the kernel with a bias that more features do
    not remove."""
    blocks = -(-features // dim)
    q, r = torch.linalg.qr(torch.randn(blocks, dim, dim, generator=generator))  # [blocks, D, D]
    q = q * torch.diagonal(r, dim1=-2, dim2=-1).sign()[:, None, :]
    rows = q.transpose(-1, -2).reshape(blocks * dim, dim)[:features]  # [m, D]
    lengths = torch.randn(features, dim, generator=generator).norm(dim=1)  # [m]
    return lengths[:, None] * rows


def softmax_features(
    x: torch.Tensor, w: torch.Tensor, eps: float, keys: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Positive random features of x [B, H, N, D] -> [B, H, N, m].

    Queries (``keys`` None) are stabilised by their own row max, keys by the max over the real keys
    ``keys`` [B, 1, N, 1] of each sequence and head; both cancel in the ratio but for ``eps``, and, as
    a numerical shift, pass no gradient (as performer-pytorch detaches it): otherwise a query's
    gradient jumps when rounding changes which feature is its largest."""
    x = x * x.shape[-1] ** -0.25
    projected = x @ w.T  # [B, H, N, m]
    half_norm = (x * x).sum(dim=-1, keepdim=True) / 2  # [B, H, N, 1]
    if keys is None:
        stabiliser = projected.detach().amax(dim=-1, keepdim=True)  # [B, H, N, 1]
    else:
        stabiliser = projected.detach().masked_fill(~keys, float("-inf")).amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
    return (torch.exp(projected - half_norm - stabiliser) + eps) * w.shape[0] ** -0.5


def relu_features(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The generalised kernel's features relu(W x D^-1/4) + eps: [B, H, N, D] -> [B, H, N, m]."""
    return F.relu((x * x.shape[-1] ** -0.25) @ w.T) + eps


def linear_readout(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1), without the N x N matrix."""
    state = phi_k.transpose(-1, -2) @ v  # [B, H, m, D]
    norm = phi_k.sum(dim=-2)  # [B, H, m]
    return (phi_q @ state) / (phi_q @ norm.unsqueeze(-1))


def stabilised_features(x: torch.Tensor, wt: torch.Tensor, eps: float, is_query: bool,
                        keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """exp(x wt - |x|^2 / (2 sqrt(D)) - max) + eps in one [B, H, N, m] buffer (no autograd; wt [D, m]
    holds the D^-1/4 scale): the softmax features without their m^-1/2, which cancels in the read-out.
    Queries take their row max; keys the max over the real keys (``keys`` [B, 1, N, 1], None: all) of
    each sequence and head, and padded key rows are zero."""
    u = x @ wt  # [B, H, N, m]
    half_norm = (x * x).sum(dim=-1, keepdim=True) * (x.shape[-1] ** -0.5 / 2)  # [B, H, N, 1]
    row_max = u.amax(dim=-1, keepdim=True)  # [B, H, N, 1]
    if is_query:
        stabiliser = row_max
    elif keys is None:
        stabiliser = row_max.amax(dim=-2, keepdim=True)  # [B, H, 1, 1]
    else:
        stabiliser = row_max.masked_fill_(~keys, float("-inf")).amax(dim=-2, keepdim=True)
    u.sub_(half_norm + stabiliser).exp_().add_(eps)
    return u if keys is None else u.masked_fill_(~keys, 0.0)


def features_backward(x: torch.Tensor, wt: torch.Tensor, phi: torch.Tensor, d_phi: torch.Tensor, eps: float,
                      keys: Optional[torch.Tensor]) -> torch.Tensor:
    """dL/dx from dL/dphi: with u = x wt and phi - eps = exp(u - |x|^2 / (2 sqrt(D)) - max), du =
    (phi - eps) dphi and dx = du wt^T - (sum_m du) x / sqrt(D) (the max passes no gradient)."""
    du = phi.sub(eps).mul_(d_phi)  # [B, H, N, m]
    if keys is not None:
        du.masked_fill_(~keys, 0.0)
    return du @ wt.T - du.sum(dim=-1, keepdim=True) * x * x.shape[-1] ** -0.5


class FavorSoftmax(torch.autograd.Function):
    """FAVOR+ with softmax features, forward and backward by hand: the values of
    ``PerformerAttention.favor`` (up to rounding), where each side's features are made in one buffer
    and the state, normaliser, read-out and their gradients are one product each with [v | 1], so a
    step keeps the two feature tensors where autograd keeps a dozen of their size."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, keys: Optional[torch.Tensor],
                eps: float) -> torch.Tensor:
        d = q.shape[-1]
        wt = w.T * d**-0.25  # [D, m]
        phi_q = stabilised_features(q, wt, eps, is_query=True)  # [B, H, S, m]
        phi_k = stabilised_features(k, wt, eps, is_query=False, keys=keys)  # [B, H, N, m]
        v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)  # [B, H, N, D + 1]
        state = phi_k.transpose(-1, -2) @ v1  # [B, H, m, D + 1]: phi(K)^T V and the normaliser z
        read = phi_q @ state  # [B, H, S, D + 1]
        out = read[..., :d] / read[..., d:]
        ctx.save_for_backward(q, k, v1, wt, phi_q, phi_k, state, out, read[..., d:], keys)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        q, k, v1, wt, phi_q, phi_k, state, out, den, keys = ctx.saved_tensors
        d = q.shape[-1]
        # out = num / den: d num = g / den, d den = -(g . out) / den
        d_read = torch.cat([g, -(g * out).sum(dim=-1, keepdim=True)], dim=-1).div_(den)  # [B, H, S, D + 1]
        d_state = phi_q.transpose(-1, -2) @ d_read  # [B, H, m, D + 1]
        dq = features_backward(q, wt, phi_q, d_read @ state.transpose(-1, -2), ctx.eps, None)
        dk = features_backward(k, wt, phi_k, v1 @ d_state.transpose(-1, -2), ctx.eps, keys)
        dv = phi_k @ d_state[..., :d]
        return dq, dk, dv, None, None, None


@dataclass
class PerformerConfig:
    # m: random features (google-research/performer's default)
    features: int = 256
    # "softmax" (FAVOR+) or "relu" (the generalised kernel)
    feature_map: str = "softmax"
    # added to every softmax feature after the stabiliser (the authors' numerical_stabilizer)
    eps: float = 1e-4
    # added to every relu feature (the authors' kernel_epsilon)
    relu_eps: float = 1e-3
    # redraw the features every this many training calls; 0 keeps them fixed
    redraw_interval: int = 0


@register("performer")
class PerformerAttention(Attention):
    order = 1.1
    paper = "Choromanski et al. 2021, Rethinking Attention with Performers"
    published_as = ("Performer", "Favor-256")
    Config = PerformerConfig
    cost = "O(N m D)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="random-feature kernel state (m x D)",
        construction="sum of phi(k) v^T over the context, m positive orthogonal random features",
        routing="dense",
    )

    def __init__(self, dims: AttnDims, cfg: PerformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.features < 1:
            raise AttentionError(f"performer features must be >= 1; got {cfg.features}")
        if cfg.feature_map not in KERNELS:
            raise AttentionError(f"performer feature_map {cfg.feature_map!r} is not one of {', '.join(KERNELS)}")
        if not (cfg.eps >= 0 and cfg.relu_eps >= 0 and math.isfinite(cfg.eps + cfg.relu_eps)):
            raise AttentionError(f"performer eps and relu_eps must be finite and >= 0; got {cfg.eps}, {cfg.relu_eps}")
        if cfg.feature_map == "relu" and cfg.relu_eps == 0:
            raise AttentionError("performer feature_map='relu' needs relu_eps > 0, or a row of zero features divides by zero")
        if cfg.redraw_interval < 0:
            raise AttentionError(f"performer redraw_interval must be >= 0 (0 = never); got {cfg.redraw_interval}")
        self.register_buffer("features", orthogonal_features(cfg.features, dims.head_dim))  # [m, D]
        # training calls since the last draw (a buffer, so a resumed run keeps its schedule)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def budget(self) -> str:
        return f"m = {self.cfg.features} random features"

    @classmethod
    def flops(cls, cfg: PerformerConfig, n: int, d: int) -> Tuple[float, float]:
        """Features of q and k 4 N m D, the state phi(K)^T V 2 N m D, the read-out phi(Q) S 2 N m D and
        the normaliser 4 N m: 8 N m D + 4 N m forward; the backward is twice the forward."""
        m = cfg.features
        forward = 8.0 * n * m * d + 4.0 * n * m
        return forward, 3.0 * forward

    def redraw(self) -> None:
        """Draw new features from torch's generator into the buffer."""
        self.features.copy_(orthogonal_features(self.cfg.features, self.dims.head_dim))
        self.calls.zero_()

    def feature_map(self, x: torch.Tensor, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.features.to(x.dtype)
        if self.cfg.feature_map == "relu":
            return relu_features(x, w, self.cfg.relu_eps)
        return softmax_features(x, w, self.cfg.eps, keys)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        if self.training and self.cfg.redraw_interval > 0:
            if int(self.calls) >= self.cfg.redraw_interval:
                self.redraw()
            self.calls += 1
        # float32 at least, under autocast too: with exp features in bf16, 7% of the query gradient rows
        # are 5-14% off (scripts/device_check.py)
        dtype, wide = q.dtype, torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(wide), k.to(wide), v.to(wide)
            if self.cfg.feature_map == "relu":
                return self.favor(q, k, v, mask).to(dtype)
            keys = None if mask is None else mask[:, None, :, None]
            return FavorSoftmax.apply(q, k, v, self.features.to(wide), keys, self.cfg.eps).to(dtype)

    def favor(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q [B, H, S, D] over k, v [B, H, N, D] (mask [B, N] over the keys) -> [B, H, S, D], in plain
        autograd: the relu kernel's path, and the readable form of FavorSoftmax (the softmax path).
        The key state costs O(N m D) whatever S is, so a slice of queries is no cheaper: no ``attend``."""
        b, _, n, _ = k.shape
        real = torch.ones(b, 1, n, 1, dtype=torch.bool, device=k.device) if mask is None else mask[:, None, :, None]
        # zeroed padded keys keep exp() finite there; their features are then dropped
        k = k.masked_fill(~real, 0.0)
        phi_k = self.feature_map(k, keys=real).masked_fill(~real, 0.0)  # [B, H, N, m]
        return linear_readout(self.feature_map(q), phi_k, v)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], w: torch.Tensor, eps: float
) -> torch.Tensor:
    """FAVOR+ written out with the N x N estimate A = phi(Q) phi(K)^T, padded key columns zeroed.

    1. x' = x D^-1/4 and u = W x' for q and k.
    2. phi(q) = m^-1/2 (exp(u - |q'|^2/2 - max_features u) + eps) per query row.
    3. phi(k) = m^-1/2 (exp(u - |k'|^2/2 - max over real keys and features u) + eps).
    4. A = phi(Q) phi(K)^T with the columns of padded keys set to zero.
    5. out = A V / A 1."""
    real = torch.ones_like(q[..., 0], dtype=torch.bool)[:, 0] if mask is None else mask  # [B, N]
    m, d = w.shape
    qs, ks = q * d**-0.25, k * d**-0.25
    uq, uk = qs @ w.T, ks @ w.T
    phi_q = m**-0.5 * (torch.exp(uq - (qs**2).sum(-1, keepdim=True) / 2 - uq.detach().amax(-1, keepdim=True)) + eps)
    key_max = torch.where(real[:, None, :, None], uk.detach(), -torch.inf).amax(dim=(-2, -1), keepdim=True)
    phi_k = m**-0.5 * (torch.exp(uk - (ks**2).sum(-1, keepdim=True) / 2 - key_max) + eps)
    scores = phi_q @ phi_k.transpose(-1, -2) * real[:, None, None, :]  # [B, H, N, N]
    return scores @ v / scores.sum(dim=-1, keepdim=True)
