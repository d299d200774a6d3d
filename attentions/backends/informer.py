"""Informer's ProbSparse self-attention (Zhou et al. 2021, Informer: Beyond Efficient Transformer for
Long Sequence Time-Series Forecasting), non-causal form.

Each query's sparsity measure M(q, K) = max_j s_j - (1/L_K) sum_j s_j is estimated on U = c ceil(ln n)
sampled keys (the paper's sampled dot products, the other pairs counted as zero in the sum); the
u = c ceil(ln n) queries of largest M attend to every real key, the other queries ("lazy") take the
mean of the real values. Cost: O(n U D) for the measure plus O(u n D) for the active queries, so
O(n log n D) in time and memory; no n x n matrix is built.

Sources: zhouhaoyi/Informer2020 ``models/attn.py`` (ProbAttention) and pkuzengqi/Skyformer
``src/models/attention_informer.py`` (the PyTorch LRA copy, factor = ceil(in_nb_features / ln
max_seq_len), in_nb_features = 128 in its ``src/config.py``). Differences from the authors' code:
- padding is honoured: n is each sequence's real length, keys are sampled among its real keys, M
  divides by the real length, the active queries' softmax skips padded keys and the lazy queries take
  the mean of the real values only (the authors' code ignores the mask and averages padded values);
- the sampled key indices come from a seeded [max_len, U] buffer of uniforms saved with the model
  (index = floor(uniform * n)), so a checkpoint reloads the same samples; the authors draw fresh
  indices with torch.randint at every call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_key_mask, real_lengths
from ..registry import register


@dataclass
class InformerConfig:
    # c in u = c ceil(ln n) active queries and U = c ceil(ln n) sampled keys per query (the paper's 5)
    factor: int = 5
    # Skyformer's in_nb_features: when set, factor = ceil(features / ln(max_len)) (factor is ignored)
    features: Optional[int] = None
    # seed of the sampled key positions (a buffer, saved with the model)
    seed: int = 0
    # queries whose sampled scores are computed at once (memory chunk x U x D)
    chunk_size: int = 4096


def sample_count(factor: int, n: int) -> int:
    """u (and U): factor * ceil(ln n), at most n, as the authors compute it (0 when n = 1)."""
    return min(factor * math.ceil(math.log(n)), n) if n > 0 else 0


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], factor: int,
              uniform: torch.Tensor) -> torch.Tensor:
    """Plain ProbSparse attention, one sequence at a time on its real tokens, with [n, n] scores.
    uniform: [>= N, >= U] in [0, 1), the sampled key of query i, slot s is floor(uniform[i, s] n)."""
    out = torch.zeros_like(q)
    lengths = real_lengths(mask, q.shape[0], q.shape[2], q.device).tolist()
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b, :, :n], k[b, :, :n], v[b, :, :n]  # [H, n, D]
        u = sample_count(factor, n)
        # 1. the sparsity measure on each query's u sampled keys
        index = (uniform[:n, :u] * n).long().clamp_max(n - 1)  # [n, u]
        scores = qb @ kb.transpose(-1, -2)  # [H, n, n]
        sampled = scores.gather(-1, index.expand(qb.shape[0], n, u))  # [H, n, u]
        # (a sequence of one token samples none: u = 0 and it is lazy)
        measure = (sampled.max(-1).values if u else sampled.sum(-1)) - sampled.sum(-1) / n  # [H, n]
        # 2. the u queries of largest measure
        top = measure.topk(u, dim=-1).indices  # [H, u]
        # 3. lazy queries: the mean of the values; active ones: softmax over every key
        context = vb.mean(dim=1, keepdim=True).expand(-1, n, -1).clone()  # [H, n, D]
        for h in range(qb.shape[0]):
            context[h, top[h]] = (scores[h, top[h]] / math.sqrt(q.shape[-1])).softmax(-1) @ vb[h]
        out[b, :, :n] = context
    return out


@register("informer")
class InformerAttention(Attention):
    order = 4.3
    paper = "Zhou et al. 2021, Informer: Beyond Efficient Transformer for Long Sequence Time-Series Forecasting"
    published_as = ("Informer",)
    Config = InformerConfig
    cost = "O(N log N D)"
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="u = c ln N active queries + 1 shared",
        expert_type="raw KV (active queries), mean of V (lazy queries)",
        construction="query sparsity measure on sampled keys",
        routing="per-query top-u by max-mean score",
    )

    def __init__(self, dims: AttnDims, cfg: InformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.factor < 1 or (cfg.features is not None and cfg.features < 1):
            raise AttentionError(f"informer needs factor >= 1 and features >= 1 (or None); got {cfg.factor}, {cfg.features}")
        if cfg.chunk_size < 1 or dims.max_len < 1:
            raise AttentionError(f"informer needs chunk_size >= 1 and max_len >= 1; got {cfg.chunk_size}, {dims.max_len}")
        self.factor = cfg.factor if cfg.features is None else max(1, math.ceil(cfg.features / math.log(max(dims.max_len, 2))))
        gen = torch.Generator().manual_seed(cfg.seed)
        # [max_len, U(max_len)]: query i's sampled key in slot s of a sequence of n real tokens is floor(u n)
        self.register_buffer("uniform", torch.rand(dims.max_len, max(sample_count(self.factor, dims.max_len), 1), generator=gen))

    def budget(self) -> str:
        u = sample_count(self.factor, self.dims.max_len)
        return f"u = factor ceil(ln N) = {u} active queries attend to all N keys, the rest to the mean of V; per query u N / N = {u}"

    @classmethod
    def flops(cls, cfg: InformerConfig, n: int, d: int) -> Optional[Tuple[float, float]]:
        factor = cfg.factor if cfg.features is None else max(1, math.ceil(cfg.features / math.log(max(n, 2))))
        u = sample_count(factor, n)
        measure, active = 2.0 * n * u * d, 4.0 * u * n * d
        return measure + active, measure + 3 * active

    def counts(self, lengths: torch.Tensor) -> torch.Tensor:
        """u_b = U_b = factor ceil(ln n_b), at most n_b, for real lengths [B] (sample_count on the device)."""
        return (self.factor * torch.log(lengths.double()).ceil().long()).minimum(lengths)

    def measure(self, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, samples: int) -> torch.Tensor:
        """The sparsity measure M [B, H, N] on each query's sampled real keys (-inf at padded queries)."""
        b, h, n, d = q.shape
        n_real = lengths[:, None, None]  # [B, 1, 1]
        # query i, slot s samples key floor(uniform[i, s] n_b) of its own sequence
        index = (self.uniform[None, :n, :samples] * n_real).long().minimum(n_real - 1)  # [B, N, U]
        # slots past the sequence's own count c ceil(ln n_b) are not sampled
        used = torch.arange(samples, device=q.device)[None, :] < self.counts(lengths)[:, None]  # [B, U]
        used = used[:, None, None, :]  # [B, 1, 1, U]
        parts = []
        with torch.no_grad():
            # rows of k [B*H*N, D]: a sampled key is one row, read by index_select (faster than gather)
            rows = k.reshape(b * h * n, d)
            first = (torch.arange(b * h, device=q.device) * n).view(b, h, 1, 1)  # [B, H, 1, 1]
            for s in range(0, n, self.cfg.chunk_size):
                qc = q[:, :, s : s + self.cfg.chunk_size]  # [B, H, C, D]
                c = qc.shape[2]
                picked = (index[:, None, s : s + c] + first).reshape(-1)  # [B*H*C*U]
                ks = rows.index_select(0, picked).view(b, h, c, samples, d)  # [B, H, C, U, D]
                dots = (qc[..., None, :] @ ks.transpose(-1, -2)).squeeze(-2)  # [B, H, C, U]
                top = dots.masked_fill(~used, float("-inf")).amax(-1)
                parts.append(top - dots.masked_fill(~used, 0.0).sum(-1) / n_real)
        m = torch.cat(parts, dim=2)  # [B, H, N]
        real_query = torch.arange(n, device=q.device)[None, None, :] < n_real
        return m.masked_fill(~real_query, float("-inf"))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        if n > self.dims.max_len:
            raise AttentionError(f"informer was built for max_len={self.dims.max_len} but got N={n}; build it with max_len >= {n}")
        k, v = k.to(q.dtype), v.to(q.dtype)
        lengths = real_lengths(mask, b, n, q.device)  # [B]
        real = real_key_mask(mask, q)[:, None, :]  # [B, 1, N]
        samples = sample_count(self.factor, n)
        # 1-2. the u = c ceil(ln N) queries of largest measure; a sequence of n_b real tokens uses its first u_b
        top = self.measure(q, k, lengths, samples).topk(samples, dim=-1).indices  # [B, H, u]
        counts = self.counts(lengths)[:, None, None, None]  # [B, 1, 1, 1]
        active = torch.arange(samples, device=q.device)[None, None, :, None] < counts  # [B, 1, u, 1]
        rows = top[..., None].expand(b, h, samples, d)
        # 3. active queries: softmax over every real key; lazy ones: the mean of the real values
        scores = (q.gather(2, rows) * (1 / math.sqrt(d))) @ k.transpose(-1, -2)  # [B, H, u, N]
        scores = scores.masked_fill(~real[:, :, None, :], float("-inf"))
        attended = scores.softmax(dim=-1) @ v  # [B, H, u, D]
        mean = (v.masked_fill(~real[..., None], 0.0).sum(2, keepdim=True)
                / lengths[:, None, None, None].to(v.dtype))  # [B, H, 1, D]
        return mean.expand(b, h, n, d).scatter(2, rows, torch.where(active, attended, mean))
