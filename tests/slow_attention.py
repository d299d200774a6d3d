"""A backend for tests of time: full attention that sleeps ``sleep_s`` on every call, and ``first_s``
on the process's first call at each batch size (a kernel built for a shape, say). A step made long
this way costs no CPU, so a test of timings or signals holds on a busy machine.

    lra-run --attn-module tests/slow_attention.py --attn slow --set attn.sleep_s=0.5 ...
"""
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from attentions import Attention, AttnDims, Taxonomy, check_inputs, register

# the batch sizes called so far in this process (one-time costs are the process's, as a kernel cache is)
SEEN = set()


@dataclass
class SlowConfig:
    # seconds slept on every call
    sleep_s: float = 0.0
    # seconds slept besides on the process's first call at a batch size
    first_s: float = 0.0


@register("slow")
class SlowAttention(Attention):
    paper = "a test double: full attention that sleeps"
    cost = "O(N^2 D)"
    Config = SlowConfig
    taxonomy = Taxonomy(
        scaling="none", expert_count="1", expert_type="raw KV (all N keys)",
        construction="none: the whole context", routing="dense: every query to every key",
    )

    def __init__(self, dims: AttnDims, cfg: SlowConfig) -> None:
        super().__init__(dims, cfg)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        time.sleep(self.cfg.sleep_s + (0.0 if q.shape[0] in SEEN else self.cfg.first_s))
        SEEN.add(q.shape[0])
        keep = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, N]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [B, H, N, D]
        return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0.0)
