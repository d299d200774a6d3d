"""What TTT's primal and dual forms share: the inner model's layer norm, the split of a sequence into
mini-batches, and the step size each key's gradient takes at each query of its mini-batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm over the last dim with per-head affine weights (``weight``, ``bias`` broadcast
    against ``z``, e.g. [H, 1, D] against [B, H, N, D])."""
    centred = z - z.mean(dim=-1, keepdim=True)
    var = (centred * centred).mean(dim=-1, keepdim=True)
    return centred / torch.sqrt(var + eps) * weight + bias


def mini_batches(x: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, N, D] -> [B, H, M, size, D], M = ceil(N / size), zeros appended to the last one. The
    forms are causal, so the appended zeros never reach a real position."""
    b, h, n, d = x.shape
    m = -(-n // size)
    return F.pad(x, (0, 0, 0, m * size - n)).reshape(b, h, m, size, d)


def step_sizes(lr: torch.Tensor, token_scale: torch.Tensor) -> torch.Tensor:
    """eta[..., i, j]: the step the gradient of key j takes in the weights query i reads, for keys
    j <= i of the same mini-batch (0 otherwise): token_scale[i] * lr[j].

    lr [B, H, N] is each key's learning rate; token_scale [K] a factor per place in a mini-batch of K.
    Returns [B, H, M, K, K]."""
    size = token_scale.shape[0]
    lr = mini_batches(lr.unsqueeze(-1), size).squeeze(-1)  # [B, H, M, K]
    eta = token_scale[:, None] * lr[..., None, :]  # [B, H, M, K, K]
    return torch.tril(eta)
