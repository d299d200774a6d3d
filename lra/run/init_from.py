"""lra-run --init-from RUN_DIR: a run that starts from another run's best weights.

Any backend to any backend, as long as the model has the same shape (model.num_layers, dim,
num_heads, ffn_dim, qkv_dim, pooling, positions, head): a tensor the two models share under the same name and shape is
loaded; the new model's other tensors keep their fresh initialisation (a backend's own parameters,
such as Linformer's projections, or a tensor of another shape), and the source's tensors the new
model lacks are left out. Full attention -> MiTA loads every tensor: neither has parameters of its
own. The weights are applied only when a run starts fresh; a resumed run continues its checkpoint.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
from torch import nn

from ..config import RunConfig
from ..errors import UserError
from .finished import FinishedRun, read_finished

# the ModelConfig fields that set the shapes of the shared tensors
MODEL_SHAPE = ("num_layers", "dim", "num_heads", "ffn_dim", "qkv_dim", "pooling", "positions", "head")


@dataclass
class InitFrom:
    source: FinishedRun
    weights: Dict[str, torch.Tensor]
    # the new model's tensors taken from the source, and those that stay new (absent, or another shape)
    loaded: List[str]
    new: List[str]
    # the new model's tensors the source has in another shape (a subset of ``new``)
    reshaped: List[str]
    # the source's tensors the new model lacks
    unused: List[str]

    def apply(self, model: nn.Module) -> None:
        model.load_state_dict({name: self.weights[name] for name in self.loaded}, strict=False)

    def summary(self) -> str:
        """One line: where from, how many tensors loaded, the new and unused ones by name (shortened)."""
        record = self.source.record
        acc = "" if record["test_acc"] is None else f", test acc {record['test_acc']:.4f}"
        total = len(self.loaded) + len(self.new)
        line = f"started from {self.source.folder} ({record['attn']}{acc}): {len(self.loaded)} of {total} tensors loaded"
        if self.new:
            named = [f"{n} (another shape)" if n in self.reshaped else n for n in self.new]
            line += f"; {len(self.new)} new: {shorten(named)}"
        else:
            line += "; none new"
        if self.unused:
            line += f"; {len(self.unused)} of the source's unused: {shorten(self.unused)}"
        return line

    def record(self) -> Dict[str, Any]:
        """The record's ``init_from``: the source run and what was carried over."""
        source = self.source.record
        return {
            "run": self.source.name, "attn": source["attn"], "attn_budget": source["attn_budget"],
            "attn_options": self.source.cfg.attn_options, "test_acc": source["test_acc"],
            "loaded": len(self.loaded), "new": self.new,
        }


def read_source(path: str, cfg: RunConfig) -> FinishedRun:
    """The source run in ``path``, checked to have a model of this run's shape (before any data is read)."""
    label = f"--init-from {path}"
    source = read_finished(path, label)
    differ = [f"model.{k} {getattr(source.cfg.model, k)!r} there, {getattr(cfg.model, k)!r} here"
              for k in MODEL_SHAPE if getattr(source.cfg.model, k) != getattr(cfg.model, k)]
    if differ:
        raise UserError(f"{label}: that run's model has another shape ({'; '.join(differ)}); its weights fit only "
                        "a model of the same shape: use the same model.* settings")
    return source


def match(source: FinishedRun, model: nn.Module) -> InitFrom:
    """The source's best weights matched to ``model``'s tensors by name and shape."""
    weights = source.weights()
    own = model.state_dict()
    loaded = [n for n in own if n in weights and weights[n].shape == own[n].shape]
    reshaped = [n for n in own if n in weights and weights[n].shape != own[n].shape]
    if not loaded:
        raise UserError(f"--init-from {source.folder}: its weights share no tensor (same name and shape) with this "
                        "run's model")
    return InitFrom(source, weights, loaded, [n for n in own if n not in loaded], reshaped,
                    [n for n in weights if n not in own])


def shorten(names: List[str], limit: int = 4) -> str:
    """Names with the block number folded ("encoder.blocks.*.attn.E (x2)"), at most ``limit`` of them."""
    folded = Counter(re.sub(r"\.blocks\.\d+\.", ".blocks.*.", n) for n in names)
    shown = [name if count == 1 else f"{name} (x{count})" for name, count in folded.items()]
    more = f", and {len(shown) - limit} more" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more
