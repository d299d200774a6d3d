"""Cosine attention (Henry et al. 2020, Query-Key Normalization for Transformers): the example
of "Add a backend" in the README and docs/backends.md. Softmax over the cosine similarity of queries and keys, sharpened by a
learned temperature; O(N^2 D) like full attention.

    lra-check-attn examples/my_attention.py
    lra-run --attn-module examples/my_attention.py --attn myattn --task listops --preset smoke
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attentions import Attention, AttnDims, Taxonomy, check_inputs, register


@dataclass
class CosineConfig:
    # starting value of the learned inverse temperature
    init_scale: float = 10.0


@register("myattn")
class CosineAttention(Attention):
    paper = "Henry et al. 2020, Query-Key Normalization for Transformers"
    cost = "O(N^2 D)"
    Config = CosineConfig
    taxonomy = Taxonomy(
        scaling="none", expert_count="1", expert_type="raw KV (all N keys)",
        construction="none: the whole context", routing="dense: every query to every key",
    )

    def __init__(self, dims: AttnDims, cfg: CosineConfig) -> None:
        super().__init__(dims, cfg)
        self.log_scale = nn.Parameter(torch.tensor(math.log(cfg.init_scale)))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2) * self.log_scale.exp()  # [B, H, N, N]
        if mask is not None:
            # padded keys get no weight; every row keeps at least one real key, so no row is all -inf
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        return scores.softmax(dim=-1) @ v
