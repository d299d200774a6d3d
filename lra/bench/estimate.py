"""Estimates for benchmark points too slow to run whole (full or top-k attention at long N).

Where every query's output depends on that query and all N keys only (a backend's
``independent_queries``: full and top-k attention), the cost of N queries is N / S times the cost
of a slice of S queries against all N keys: time the slice, scale it linearly. At the model level the attention is timed that way and the rest of the
model (embeddings, projections, FFN, optimizer) is timed for real with the attention replaced by the
``none`` backend (out = v), then the two are added: rest + layers x attention. Every such point is ``estimated``.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import nn

# queries attend to all N keys independently: a slice of queries costs S / N of the whole
SliceFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def scale_stats(stats: Dict[str, object], factor: float) -> Dict[str, object]:
    """Timing statistics of a slice, scaled to the whole: every time multiplied by ``factor``."""
    scaled = dict(stats)
    for key in ("median_s", "min_s", "max_s"):
        scaled[key] = float(stats[key]) * factor
    scaled["times_s"] = [round(float(t) * factor, 6) for t in stats["times_s"]]
    return scaled


def add_stats(rest: Dict[str, object], part: Dict[str, object], times: int) -> Dict[str, object]:
    """``rest + times x part`` for timing statistics (medians add; the spread is the larger one)."""
    total = dict(rest)
    for key in ("median_s", "min_s", "max_s"):
        total[key] = float(rest[key]) + times * float(part[key])
    total["spread"] = max(float(rest["spread"]), float(part["spread"]))
    total["times_s"] = []
    return total


def slice_fn(attn: nn.Module) -> Optional[SliceFn]:
    """How to run a slice of queries over all keys: the backend's ``attend`` when its queries are
    independent (``Attention.independent_queries``, e.g. full and top-k attention), else None."""
    return attn.attend if getattr(attn, "independent_queries", False) else None
