"""Top-k attention's forward, the PyTorch form."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def topk_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor], keys: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, C, D], k_t [B, H, D, N], v [B, H, N, D], key_bias [B, 1, 1, N] (0 or -inf) or None ->
    out [B, H, C, D], the chosen key indices [B, H, C, keys] (in no order) and their softmax weights
    [B, H, C, keys] (float32 at least, then q's dtype)."""
    scores = (q * (1 / math.sqrt(q.shape[-1]))) @ k_t  # [B, H, C, N]
    if key_bias is not None:
        scores = scores + key_bias
    top, index = scores.topk(keys, dim=-1, sorted=False)  # [B, H, C, k]
    weights = top.softmax(dim=-1, dtype=torch.promote_types(top.dtype, torch.float32)).to(top.dtype)
    b, h, c, _ = index.shape
    picked = v.gather(2, index.reshape(b, h, c * keys, 1).expand(-1, -1, -1, v.shape[-1]))  # [B, H, C k, D]
    out = (weights[..., None] * picked.view(b, h, c, keys, -1)).sum(3)  # [B, H, C, D]
    return out, index, weights
