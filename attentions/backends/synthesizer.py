"""Synthesizer (Tay et al. 2021, Synthesizer: Rethinking Self-Attention for Transformer Models), the
Random and Factorized Random modes that the LRA JAX code implements.

The attention weights are not computed from the tokens: each head learns its own logits R [N, N]
(``random``) or R = R1 R2 with R1 [N, k], R2 [k, N] (``factorized_random``), and the output is
softmax(R) V. ``dot_product`` adds the usual Q K^T / sqrt(D) to R (the paper's "+ Vanilla" mixtures).
R is a parameter of ``max_len``: the backend is built for a fixed length, and a sequence of N <= max_len
tokens uses R[:N, :N] (position i always reads row i). Cost O(N^2 D) time and O(N^2) memory per head
(the softmax of R needs the whole row, factorized or not); H max_len^2 (random) or 2 H max_len k
(factorized) parameters.

Where the LRA JAX code (google-research/long-range-arena ``models/synthesizer/``) and the paper differ:
- the JAX code drops the padding mask when the dot product is off (``ignore_dot_product``): padded keys
  take weight. Here padded keys never take weight, the softmax runs over a row's real keys, in every mode;
- the JAX text config asks for ``factorized_random``, k = 32 without the dot product, but sets those
  values outside ``config.model``, which is all the train script hands the model: the published text
  run is ``random`` with the dot product, as are the other tasks' runs (their configs leave
  ``ignore_dot_product`` at the model's False). lra/configs/attn/synthesizer.yaml gives each task what
  its config asks for; docs/backends.md says which computation each published number comes from.
- the JAX code initialises R, R1, R2 Xavier-uniform over the [H, L, L] / [H, L, k] / [H, k, L] arrays
  (fans include the head count); so does this backend. ``fixed`` keeps R as a buffer (saved with the
  weights), the paper's Fixed Random variant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import nn

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register

MODES = ("random", "factorized_random")


@dataclass
class SynthesizerConfig:
    # "random": a learned [max_len, max_len] logit matrix per head; "factorized_random": R1 R2 of rank k
    mode: str = "random"
    # rank of the factorized mode (the JAX code's k)
    k: int = 32
    # add Q K^T / sqrt(D) to the synthetic logits: the JAX model's default (ignore_dot_product = False);
    # False is the paper's plain Random / Factorized Random
    dot_product: bool = True
    # R is a fixed random buffer, not trained (the paper's Fixed Random); drawn from torch's global
    # generator like any initial weight, and saved in the state dict, so a checkpoint reloads it
    fixed: bool = False


def xavier_uniform(shape: Tuple[int, int, int]) -> torch.Tensor:
    """flax's xavier_uniform on an [H, rows, cols] array: fan_in = rows H, fan_out = cols H."""
    heads, rows, cols = shape
    bound = math.sqrt(6.0 / (heads * (rows + cols)))
    return torch.empty(shape).uniform_(-bound, bound)


def reference(
    logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
    dot_product: bool = False,
) -> torch.Tensor:
    """softmax(R (+ Q K^T / sqrt(D))) V over each row's real keys, one head at a time. logits R: [H, N, N]."""
    out = torch.zeros_like(v)
    for b in range(q.shape[0]):
        keys = torch.arange(q.shape[2]) if mask is None else mask[b].nonzero()[:, 0]
        for h in range(q.shape[1]):
            scores = logits[h][:, keys]  # [N, real keys]
            if dot_product:
                scores = scores + q[b, h] @ k[b, h, keys].T / math.sqrt(q.shape[-1])
            out[b, h] = scores.softmax(dim=-1) @ v[b, h, keys]
    return out


@register("synthesizer")
class SynthesizerAttention(Attention):
    order = 2.5
    paper = "Tay et al. 2021, Synthesizer: Rethinking Self-Attention for Transformer Models"
    published_as = ("Synthesizer",)
    Config = SynthesizerConfig
    cost = "O(N^2 D)"
    taxonomy = Taxonomy(
        scaling="none",
        expert_count="1",
        expert_type="raw KV (all N keys), weights learned per position",
        construction="none: the whole context",
        routing="dense: input-independent weights",
    )

    def __init__(self, dims: AttnDims, cfg: SynthesizerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.mode not in MODES:
            raise AttentionError(f"synthesizer mode {cfg.mode!r} is not one of {', '.join(MODES)}")
        if cfg.mode == "factorized_random" and cfg.k < 1:
            raise AttentionError(f"synthesizer k must be >= 1 (the rank of R1 R2); got {cfg.k}")
        if dims.max_len < 1:
            raise AttentionError(f"synthesizer needs max_len >= 1 to size its attention matrix; got {dims.max_len}")
        h, n = dims.num_heads, dims.max_len
        if cfg.mode == "random":
            shapes = {"R": (h, n, n)}
        else:
            shapes = {"R1": (h, n, cfg.k), "R2": (h, cfg.k, n)}
        for name, shape in shapes.items():
            value = xavier_uniform(shape)
            if cfg.fixed:
                self.register_buffer(name, value)
            else:
                self.register_parameter(name, nn.Parameter(value))

    def budget(self) -> str:
        return "N (all keys, weights learned per position)"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Tuple[float, float]:
        """P V 2 N^2 D; R1 R2 2 N^2 k (factorized); Q K^T 2 N^2 D (dot_product). Train = 3x forward."""
        forward = 2.0 * n * n * d
        if cfg.mode == "factorized_random":
            forward += 2.0 * n * n * cfg.k
        if cfg.dot_product:
            forward += 2.0 * n * n * d
        return forward, 3.0 * forward

    def logits(self, n: int) -> torch.Tensor:
        """The synthetic logits of the first n positions, [H, n, n]."""
        if self.cfg.mode == "random":
            return self.R[:, :n, :n]
        return self.R1[:, :n] @ self.R2[:, :, :n]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        n = q.shape[2]
        if n > self.dims.max_len:
            raise AttentionError(
                f"synthesizer was built for max_len={self.dims.max_len} (its attention matrix is that size) but got "
                f"a sequence of N={n}; build it with max_len >= {n}"
            )
        scores = self.logits(n).to(q.dtype).expand(q.shape[0], -1, -1, -1)  # [B, H, N, N]
        if self.cfg.dot_product:
            scores = scores + q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            # a finite floor, not -inf: a row of a sequence with no real token stays finite
            scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(q.dtype).min)
        return scores.softmax(dim=-1) @ v
