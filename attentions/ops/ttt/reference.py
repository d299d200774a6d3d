"""TTT's primal form, written as the paper's equations (Sun et al. 2024, Sec. 2.1-2.4).

The hidden state is the weights W of the inner model f(x; W) = x + LN(g(x; W)), g linear (x W1 + b1)
or a 2-layer MLP (gelu(x W1 + b1) W2 + b2); the self-supervised loss of key t is the reconstruction
of its value, l(W; t) = 1/2 ||f(k_t; W) - v_t||^2. Mini-batch gradient descent over mini-batches of K
tokens, for token t of the mini-batch that starts from weights W:

    1. G_s = grad_W l(W; s)                                  every key s of the mini-batch, at W
    2. W_t = W - token_scale[t] * sum_{s <= t} lr_s G_s       the weights token t has learned
    3. z_t = f(q_t; W_t)                                       the output: query t reads them
    4. the next mini-batch starts from W_K, the last token's weights

Each token holds its own copy of the weights, so memory is K times the state: this form is the
reference the tests hold the dual form (dual.py) to, not a path for long sequences.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F

from .common import layer_norm, mini_batches


def inner_model(weights: Sequence[torch.Tensor], x: torch.Tensor, ln_weight: torch.Tensor,
                ln_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """f(x; W) = x + LN(g(x; W)) for x [B, H, K, D] and one set of weights per token: (W1 [B, H, K, D, D],
    b1 [B, H, K, 1, D]) for the linear model, (W1, b1, W2, b2) with a 4D-wide hidden layer for the MLP."""
    h = x.unsqueeze(-2)  # [B, H, K, 1, D]
    for layer in range(0, len(weights), 2):
        if layer > 0:
            h = F.gelu(h, approximate="tanh")
        h = h @ weights[layer] + weights[layer + 1]  # [B, H, K, 1, D or 4D]
    return x + layer_norm(h.squeeze(-2), ln_weight, ln_bias, eps)


def per_token(w: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, ...] -> [B, H, size, ...]: one copy of the weights per token, whose gradient is that token's."""
    copies = w.unsqueeze(2).expand(w.shape[0], w.shape[1], size, *w.shape[2:]).clone()
    return copies if copies.requires_grad else copies.requires_grad_()


def primal_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: Sequence[torch.Tensor],
                ln_weight: torch.Tensor, ln_bias: torch.Tensor, lr: torch.Tensor, token_scale: torch.Tensor,
                eps: float) -> torch.Tensor:
    """Outputs [B, H, N, D] of TTT over q, k, v [B, H, N, D] from the initial weights ``state`` ([H, ...]
    each), with the inner layer norm's ``ln_weight``, ``ln_bias`` [H, 1, D], each key's learning rate
    ``lr`` [B, H, N] and the factor per place in a mini-batch ``token_scale`` [K]."""
    b, _, n, _ = q.shape
    size = token_scale.shape[0]
    qm, km, vm = (mini_batches(x, size) for x in (q, k, v))  # [B, H, M, K, D]
    lrm = mini_batches(lr.unsqueeze(-1), size)  # [B, H, M, K, 1]
    scale = token_scale.reshape(size, *[1] * (state[0].dim() - 1))  # [K, 1, ...] against [B, H, K, ...]
    weights: List[torch.Tensor] = [w.expand(b, *w.shape) for w in state]  # [B, H, ...]
    outputs = []
    with torch.enable_grad():
        for qb, kb, vb, lb in zip(*(x.unbind(dim=2) for x in (qm, km, vm, lrm))):
            # 1. every key's gradient at the mini-batch's starting weights
            copies = [per_token(w, size) for w in weights]
            loss = 0.5 * (inner_model(copies, kb, ln_weight, ln_bias, eps) - vb).pow(2).sum()
            grads = torch.autograd.grad(loss, copies, create_graph=True)
            # 2. token t's weights: the steps of keys s <= t
            lb = lb.unsqueeze(-1)  # [B, H, K, 1, 1]
            learned = [w.unsqueeze(2) - scale * torch.cumsum(lb * g, dim=2) for w, g in zip(weights, grads)]
            # 3. query t reads its token's weights
            outputs.append(inner_model(learned, qb, ln_weight, ln_bias, eps))
            # 4. the last token's weights start the next mini-batch
            weights = [w[:, :, -1] for w in learned]
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :n]
