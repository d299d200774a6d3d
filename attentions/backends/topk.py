"""Top-k attention (Gupta et al. 2021, Memory-efficient Transformers via Top-k Attention).

Each query keeps its own k highest-scoring real keys and takes a softmax over those k only. Scores
are built for a chunk of queries at a time, so memory is O(chunk N) instead of O(N^2); training
keeps only each query's k chosen indices and weights, O(N k), and the backward rebuilds the sparse
rows from them (no second top-k). On the CPU in float32 the forward is one C kernel from scores to
output for a block of queries at a time (ops/topk_attention), so the [C, N] scores stay in the cache,
and the backward's products with the k chosen rows run on C kernels (ops/row_products): no [C, N]
rows are rebuilt. Time stays O(N^2 D): every query still scores every key. One query attends to k keys: 64 at the Config default, 128 in configs/attn/topk.yaml (all real keys,
i.e. full attention, when N <= k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..ops import row_products
from ..ops.row_products import cpu as row_kernels
from ..ops.topk_attention import topk_attention as fused_forward
from ..ops.topk_selection import topk_unsorted
from ..registry import register


@dataclass
class TopKConfig:
    # k: keys each query keeps (clamped to the number of real keys)
    topk: int = 64
    # queries scored at once; memory is O(chunk_size x N)
    chunk_size: int = 1024


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, topk: int = 64
) -> torch.Tensor:
    """Plain top-k attention on the full [N, N] score matrix. [B, H, N, D] -> [B, H, N, D]."""
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2)  # [B, H, N, N]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    index = scores.topk(min(topk, k.shape[2]), dim=-1).indices  # [B, H, N, k]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, True)
    # a kept padded key still scores -inf, so a short sequence's extra slots get zero weight
    return scores.masked_fill(~keep, float("-inf")).softmax(dim=-1) @ v


def _select(q: torch.Tensor, k_t: torch.Tensor, key_bias: Optional[torch.Tensor], keys: int):
    """Scores of a chunk q [B, H, C, D] against k_t [B, H, D, N], each query's ``keys`` best:
    indices [B, H, C, k] and softmax weights (float32 at least, then the scores' dtype)."""
    scores = (q * (1 / math.sqrt(q.shape[-1]))) @ k_t  # [B, H, C, N]
    if key_bias is not None:
        scores += key_bias
    top, index = topk_unsorted(scores, keys)  # [B, H, C, k]
    weights = top.softmax(dim=-1, dtype=torch.promote_types(top.dtype, torch.float32)).to(top.dtype)
    return index, weights


class TopKChunk(torch.autograd.Function):
    """Top-k attention of a chunk of queries q [B, H, C, D] over all keys -> [B, H, C, D].

    The forward keeps only each query's chosen key indices and softmax weights [B, H, C, k], so the
    backward rebuilds the sparse weight rows by a scatter instead of recomputing the scores and the
    top-k (the selection costs more than the matmuls on the CPU). Softmax backward over the k
    chosen logits: d s = p * (d p - sum(p * d p)); unchosen keys get no gradient.
    """

    @staticmethod
    def forward(ctx, q, k_t, v, key_bias, keys: int):
        with torch.autocast(q.device.type, enabled=False):
            index, weights = _select(q, k_t, key_bias, keys)
            # the k weights laid into [C, N] rows: in torch one dense matmul beats gathering k values
            rows = torch.zeros(*index.shape[:-1], k_t.shape[-1], dtype=q.dtype, device=q.device)  # [B, H, C, N]
            out = rows.scatter_(-1, index, weights) @ v
        ctx.save_for_backward(q, k_t, v, index, weights)
        ctx.scale = 1 / math.sqrt(q.shape[-1])
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k_t, v, index, weights = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(q.dtype)
            rows = torch.zeros(*index.shape[:-1], k_t.shape[-1], dtype=q.dtype, device=q.device)  # [B, H, C, N]
            rows.scatter_(-1, index, weights)
            # A^T B as (B^T A)^T with B^T contiguous: a transposed first operand is slow on the CPU
            d_v = (d_out.transpose(-1, -2).contiguous() @ rows).transpose(-1, -2)  # [B, H, N, D]
            d_rows = d_out @ v.transpose(-1, -2)  # [B, H, C, N]
            d_p = d_rows.gather(-1, index)  # [B, H, C, k]
            d_s = weights * (d_p - (weights * d_p).sum(dim=-1, keepdim=True)) * ctx.scale
            d_scores = d_rows.zero_().scatter_(-1, index, d_s)  # [B, H, C, N]
            d_q = d_scores @ k_t.transpose(-1, -2)  # [B, H, C, D]
            d_k_t = q.transpose(-1, -2).contiguous() @ d_scores  # [B, H, D, N]
        return d_q, d_k_t, d_v, None, None


class TopKChunkSparse(torch.autograd.Function):
    """TopKChunk on the CPU kernels (float32): the forward fused from scores to output
    (ops/topk_attention: no [C, N] scores leave the cache), out = sum_j p_j v_{idx_j}; the backward
    reads the k chosen rows by index (ops/row_products): d p_j = d_out . v_{idx_j}, dq = sum_j d s_j k_{idx_j} scale,
    and dk, dv added into the chosen rows. No [C, N] rows are built after the selection."""

    @staticmethod
    def forward(ctx, q, k_t, k_rows, v, key_bias, keys: int):
        b, h, c, d = q.shape
        n = k_t.shape[-1]
        with torch.autocast(q.device.type, enabled=False):
            # scores, selection, softmax and the mix of the chosen values, a block of queries at a time
            out, index, weights = fused_forward(q, k_t, v, key_bias, keys)  # [B, H, C, D], 2 x [B, H, C, k]
        index, weights = index.view(b * h * c, keys), weights.view(b * h * c, keys)
        ctx.save_for_backward(q, k_rows, v, index, weights)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k_rows, v, index, weights = ctx.saved_tensors
        b, h, c, d = q.shape
        n = v.shape[2]
        d_out = d_out.to(q.dtype).reshape(b * h * c, d)
        d_p = row_kernels.dot_rows(d_out, index, v.view(b * h * n, d), c, n)  # [B*H*C, k]
        d_s = weights * (d_p - (weights * d_p).sum(dim=-1, keepdim=True)) * (1 / math.sqrt(d))
        d_q = row_kernels.mix_rows(d_s, index, k_rows.view(b * h * n, d), c, n).view(b, h, c, d)
        d_k = row_kernels.scatter_outer(d_s, index, q.reshape(b * h * c, d), torch.zeros_like(k_rows).view(-1, d), c, n)
        d_v = row_kernels.scatter_outer(weights, index, d_out, torch.zeros_like(v).view(-1, d), c, n)
        return d_q, None, d_k.view_as(k_rows), d_v.view_as(v), None, None


@register("topk")
class TopKAttention(Attention):
    order = 4
    paper = "Gupta et al. 2021, Memory-efficient Transformers via Top-k Attention"
    Config = TopKConfig
    cost = "O(N^2 D) time, O(chunk N) memory"
    whole_sequence = {"topk": "every key: full attention"}
    independent_queries = True
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N (one per query)",
        expert_type="raw KV",
        construction="per-query top-k of scores",
        routing="per-query top-k",
    )

    def __init__(self, dims: AttnDims, cfg: TopKConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.topk < 1:
            raise AttentionError(f"topk attention needs topk >= 1 (keys per query), got {cfg.topk}")
        if cfg.chunk_size < 1:
            raise AttentionError(f"topk attention needs chunk_size >= 1 (queries scored at once), got {cfg.chunk_size}")

    @classmethod
    def implementation(cls, cfg: TopKConfig, device: torch.device) -> str:
        # (a CPU probe tensor: nothing is allocated on the device asked about)
        kernels = "C" if device.type == "cpu" and row_products.takes(torch.empty(0)) else "torch"
        return f"attentions.topk ({kernels} kernels: fused scores-to-output forward, k-row products)"

    def budget(self) -> str:
        return f"k = {self.cfg.topk}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        key_bias = None
        if mask is not None:
            # 0 on real keys, -inf on padding: padded keys lose every top-k comparison
            key_bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            key_bias = key_bias[:, None, None, :]  # [B, 1, 1, N]
        return self.attend(q, k, v, key_bias)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Queries q [B, H, S, D] (any S: the benchmark times a slice) over keys k, v [B, H, N, D]."""
        keys = min(self.cfg.topk, k.shape[2])
        # one dtype for the chunks (under autocast q, k, v may differ); k transposed once, contiguous
        k_t = k.to(q.dtype).transpose(-1, -2).contiguous()  # [B, H, D, N]
        v = v.to(q.dtype)
        chunks = range(0, q.shape[2], self.cfg.chunk_size)
        if row_products.takes(q):
            k_rows, v = k.to(q.dtype).contiguous(), v.contiguous()  # [B, H, N, D]
            outs = [TopKChunkSparse.apply(q[:, :, s : s + self.cfg.chunk_size], k_t, k_rows, v, key_bias, keys)
                    for s in chunks]
        else:
            outs = [TopKChunk.apply(q[:, :, s : s + self.cfg.chunk_size], k_t, v, key_bias, keys) for s in chunks]
        return torch.cat(outs, dim=2)
