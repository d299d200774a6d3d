"""TTT's dual form (Sun et al. 2024, Sec. 2.5): the primal form's outputs (reference.py) without
materialising a weight per token.

Within a mini-batch every gradient is taken at the starting weights W, so the weights token t reads
are W - sum_{s <= t} eta_ts x_s^T d_s (x_s the layer's input at key s, d_s the loss gradient w.r.t.
its output), and query t's output of that layer is

    q_t W - sum_{s <= t} eta_ts (q_t . x_s) d_s + b - sum_{s <= t} eta_ts d_s
      = q_t W + b - (eta * (Q X^T + 1)) D          (eta lower-triangular, [K, K])

three matmuls per layer and mini-batch. The gradients d come from the layer norm's and GELU's
backward written out (``ln_l2_grad``, ``gelu_grad``), so the outer autograd differentiates through
them. Cost per token: O(D^2 + K D) for the linear model, O(4 D^2 + 4 K D) per layer of the MLP.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

from .common import layer_norm, mini_batches, step_sizes

State = Tuple[torch.Tensor, ...]


def ln_l2_grad(z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """d/dz of 1/2 ||LN(z) - target||^2, per row: with x = (z - mean) / std and e = (LN(z) - target) * weight,
    the layer norm's backward is (e - mean(e) - x * mean(e * x)) / std."""
    centred = z - z.mean(dim=-1, keepdim=True)
    std = torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps)
    x = centred / std
    e = (x * weight + bias - target) * weight
    return (e - e.mean(dim=-1, keepdim=True) - x * (e * x).mean(dim=-1, keepdim=True)) / std


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (the authors' inner MLP)."""
    return F.gelu(x, approximate="tanh")


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx for gelu(x) = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)


def linear_step(state: State, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
                read: torch.Tensor, ln: Tuple[torch.Tensor, torch.Tensor], eps: float) -> Tuple[State, torch.Tensor]:
    """One mini-batch of TTT-Linear: q, k, v [B, H, K, D], eta [B, H, K, K], read = eta * (Q K^T + 1)."""
    w, b = state  # [B, H, D, D], [B, H, 1, D]
    # the loss gradient at each key w.r.t. the layer's output
    d = ln_l2_grad(k @ w + b, v - k, *ln, eps)  # [B, H, K, D]
    # each query reads the weights after the steps of the keys up to its own
    z = q @ w + b - read @ d  # [B, H, K, D]
    # the weights after the whole mini-batch: the last token's steps
    last = eta[..., -1, :, None]  # [B, H, K, 1]
    return (w - (last * k).transpose(-1, -2) @ d, b - (last * d).sum(dim=-2, keepdim=True)), z


def mlp_step(state: State, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
             read: torch.Tensor, ln: Tuple[torch.Tensor, torch.Tensor], eps: float) -> Tuple[State, torch.Tensor]:
    """One mini-batch of TTT-MLP (hidden width 4D): as linear_step, layer by layer."""
    w1, b1, w2, b2 = state  # [B, H, D, 4D], [B, H, 1, 4D], [B, H, 4D, D], [B, H, 1, D]
    z1 = k @ w1 + b1  # [B, H, K, 4D]
    x2 = gelu(z1)
    d2 = ln_l2_grad(x2 @ w2 + b2, v - k, *ln, eps)  # [B, H, K, D]
    d1 = (d2 @ w2.transpose(-1, -2)) * gelu_grad(z1)  # [B, H, K, 4D]
    xq2 = gelu(q @ w1 + b1 - read @ d1)  # [B, H, K, 4D]
    z = xq2 @ w2 + b2 - (eta * (xq2 @ x2.transpose(-1, -2) + 1.0)) @ d2  # [B, H, K, D]
    last = eta[..., -1, :, None]  # [B, H, K, 1]
    state = (
        w1 - (last * k).transpose(-1, -2) @ d1,
        b1 - (last * d1).sum(dim=-2, keepdim=True),
        w2 - (last * x2).transpose(-1, -2) @ d2,
        b2 - (last * d2).sum(dim=-2, keepdim=True),
    )
    return state, z


def dual_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Sequence[torch.Tensor],
              ln_weight: torch.Tensor, ln_bias: torch.Tensor, lr: torch.Tensor, token_scale: torch.Tensor,
              eps: float) -> torch.Tensor:
    """Same arguments and outputs as reference.primal_form: (W1, b1) is TTT-Linear, (W1, b1, W2, b2) TTT-MLP."""
    b, _, n, _ = q.shape
    size = token_scale.shape[0]
    step = linear_step if len(state) == 2 else mlp_step
    qm, km, vm = (mini_batches(x, size) for x in (q, k, v))  # [B, H, M, K, D]
    eta = step_sizes(lr, token_scale)  # [B, H, M, K, K]
    # what the first layer's queries read does not depend on the weights: every mini-batch at once
    read = eta * (qm @ km.transpose(-1, -2) + 1.0)  # [B, H, M, K, K]
    weights: State = tuple(w.expand(b, *w.shape) for w in state)  # [B, H, ...]
    ln = (ln_weight, ln_bias)
    outputs: List[torch.Tensor] = []
    # unbind, not indexing: the backward of one unbind is one stack, that of M indexings M full-size sums
    for qb, kb, vb, eb, rb in zip(*(x.unbind(dim=2) for x in (qm, km, vm, eta, read))):
        weights, z = step(weights, qb, kb, vb, eb, rb, ln, eps)
        outputs.append(z)
    z = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :n]  # [B, H, N, D]
    return q + layer_norm(z, ln_weight, ln_bias, eps)
