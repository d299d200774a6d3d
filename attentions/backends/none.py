"""No attention: the timing reference that gives every backend's ceiling.

Each token keeps its own value (out = v), so a model built with it costs what the rest of the step
costs (embeddings, projections, FFN, loss, optimizer). Full attention's step time over this one's
is the largest speed-up any backend can reach at that length. It mixes nothing and learns nothing
about the sequence, so it is a timing reference only (``timing_only``): ``list_attentions()``
leaves it out (the contract battery, tables, sweeps), ``lra-run`` and ``lra-sweep`` refuse it, and
``lra-bench`` and scripts/step_compare.py time it when named.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..base import Attention, Taxonomy, check_inputs
from ..registry import register


@register("none")
class NoAttention(Attention):
    # listed before full where timing references are listed (list_attentions(timing=True))
    order = -1
    paper = "none: the model without attention, the timing reference of every backend's ratio"
    cost = "O(1)"
    timing_only = True
    taxonomy = Taxonomy(
        scaling="none",
        expert_count="0",
        expert_type="none",
        construction="none",
        routing="none: each token keeps its own value",
    )

    def budget(self) -> str:
        return "0"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Optional[Tuple[float, float]]:
        """No attention FLOPs to count (its rate would say nothing)."""
        return None

    @classmethod
    def implementation(cls, cfg: Any, device: torch.device) -> str:
        return "none (out = v)"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        return v
