"""Which form of Top-k attention's forward runs: the fused C kernel (cpu.py) for inputs it takes,
the torch form (reference.py) for the rest; ``refusals`` says why the kernel is not taken."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import cpu, reference


def refusals(q: torch.Tensor, key_bias: Optional[torch.Tensor], keys: int, n: int) -> List[str]:
    """Why the kernel does not run this forward; [] when it does."""
    reasons = cpu.refusals(q)
    if not 1 <= keys <= n:
        reasons.append(f"the kernel keeps 1 <= k <= N of N keys, not k = {keys} of {n}")
    if key_bias is not None and key_bias.shape != (q.shape[0], 1, 1, n):
        reasons.append(f"the kernel takes a key bias of shape [B, 1, 1, N], not {list(key_bias.shape)}")
    return reasons


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes tensors like ``x`` (float32 on the CPU, built here), for some shapes."""
    return not cpu.refusals(x)


def topk_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor], keys: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Out [B, H, C, D], chosen key indices and their softmax weights [B, H, C, keys] (reference.py's
    contract). Not differentiable: the caller's autograd Function saves the indices and weights."""
    if refusals(q, key_bias, keys, k_t.shape[-1]):
        return reference.topk_attention(q, k_t, v, key_bias, keys)
    return cpu.topk_attention(q, k_t, v, key_bias, keys)
