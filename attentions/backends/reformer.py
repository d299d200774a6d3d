"""Reformer's LSH attention (Kitaev et al. 2020, Reformer: The Efficient Transformer), non-causal.

Shared query-key: the keys are the queries scaled to unit length. In each of n_hashes rounds every
token is hashed by a random rotation R (bucket = argmax [xR; -xR]), the tokens are sorted by
(bucket, position) and cut into chunks of chunk_size; a query attends to the keys of its own bucket
in its own chunk and the chunk before, never to itself unless it has no other key there (its score
lowered by 1e5). The rounds are combined by the weights softmax over rounds of each round's
logsumexp, and a key shared with a query in several rounds' buckets has its score lowered by log of
that count (the paper's m_ij), so it is counted once. Cost: O(n_hashes N D sum(bucket factors)) for
the hashing, O(n_hashes N log N) for the sort, O(n_hashes N chunk_size D) for the attention; memory
O(n_hashes N chunk_size), no N x N matrix.

Sources: the paper (Sec. 2-3); google/trax ``trax/layers/research/efficient_attention.py``;
huggingface transformers ``LSHSelfAttention``, which the PyTorch LRA code wraps (mlpen/Nystromformer
``LRA/code/attention_reformer.py``, reused by Skyformer, sets query_key = W_q, 2 hashes in
Skyformer's ``src/config.py``). Defaults are HF's: chunk 64, one chunk before and none after, and
n_buckets = 2 max_len / chunk rounded down to a power of two, hashed as two factors (two rotations)
above 2 max(sqrt(max_len / chunk), chunk) buckets. Where this file and that code differ:
- the paper's attention within the bucket only (HF lets a query attend every key of the two chunks,
  whatever its bucket) and its duplicate count log N_ij (HF counts a key once per round);
- the queries q are the shared query-keys (HF's query_key is tied to W_q); the keys k are not used
  (their gradient is zero);
- padding: padded tokens take an extra last bucket (as HF) and each round is chunked on its own from
  its first sorted token, so the chunks of the real tokens do not depend on the padded length (HF
  chunks the rounds laid end to end, and the chunk before a round's first chunk is the previous
  round's last);
- the rotations are a seeded buffer saved with the model (HF and trax draw new ones at every call).
One bucket with a chunk covering the sequence is full softmax attention over q_i . q_j / |q_j|,
j != i (the token itself only when alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register

# the paper's m_ii: a token's score with itself is lowered by this much
SELF_PENALTY = 1e5


@dataclass
class ReformerConfig:
    # hashing rounds (Skyformer's LRA config: num_hash 2)
    n_hashes: int = 2
    # tokens per chunk of each round's sorted order (HF lsh_attn_chunk_length)
    chunk_size: int = 64
    # buckets per round, 1 or even; None: 2 max_len / chunk_size rounded down to a power of two (HF)
    n_buckets: Optional[int] = None
    # seed of the random rotations (a buffer, saved with the model)
    seed: int = 0


def default_buckets(max_len: int, chunk_size: int) -> Tuple[int, ...]:
    """HF's bucket count: 2 (max_len // chunk_size) rounded down to a power of two (1 when one chunk
    holds the sequence: HF then runs plain attention with the self mask),
    as two factors (two rotations, bucket = b1 + f1 b2) above 2 max(sqrt(max_len // chunk_size),
    chunk_size) buckets, so that hashing stays O(N sqrt(N / chunk_size) D) and not O(N^2 D / chunk_size)."""
    pairs = 2 * (max_len // chunk_size)
    if max_len <= chunk_size:
        return (1,)
    power = pairs.bit_length() - 1
    if 2**power > 2 * max(int((max_len // chunk_size) ** 0.5), chunk_size):
        return (2 ** (power // 2), 2 ** (power - power // 2))
    return (2**power,)


def shared_keys(qk: torch.Tensor) -> torch.Tensor:
    """The keys of shared-QK attention: qk length-normalised, then / sqrt(D) (HF's _len_and_dim_norm)."""
    return qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 / math.sqrt(qk.shape[-1]))


def hash_buckets(qk: torch.Tensor, rotations: torch.Tensor, factors: Tuple[int, ...],
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Bucket of every token in every round [B, H, R, N] from rotations [H, D, R, sum(factors) / 2]:
    per factor f, argmax over [xR_f; -xR_f]; padded tokens take bucket prod(factors)."""
    b, h, n, _ = qk.shape
    with torch.no_grad():
        buckets = torch.zeros(b, h, rotations.shape[2], n, dtype=torch.long, device=qk.device)
        if factors != (1,):
            rotated = torch.einsum("bhnd,hdrk->bhrnk", qk, rotations.to(qk.dtype))  # [B, H, R, N, sum f/2]
            start, scale = 0, 1
            for f in factors:
                part = rotated[..., start : start + f // 2]
                # argmax over [x; -x] without building it: the largest entry or, past it, the smallest
                top, top_at = part.max(dim=-1)
                low, low_at = part.min(dim=-1)
                buckets += scale * torch.where(top >= -low, top_at, low_at + f // 2)
                start, scale = start + f // 2, scale * f
        if mask is not None:
            buckets = buckets.masked_fill(~mask[:, None, None, :], math.prod(factors))
    return buckets


def sort_order(buckets: torch.Tensor) -> torch.Tensor:
    """Each round's token order [B, H, R, N]: by bucket, then by position."""
    n = buckets.shape[-1]
    return (buckets * n + torch.arange(n, device=buckets.device)).argsort(dim=-1)


class UnusedKeys(torch.autograd.Function):
    """The output, with the unused keys k in the graph: their gradient is exactly zero (not None),
    so a caller that reads k.grad finds the true derivative."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        ctx.k_shape, ctx.k_dtype = k.shape, k.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        return d_out, d_out.new_zeros(ctx.k_shape, dtype=ctx.k_dtype)


def reference(q: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Plain LSH attention with [N, N] scores and masks, from the buckets [B, H, R, N] of hash_buckets."""
    n, acc = q.shape[2], torch.promote_types(q.dtype, torch.float32)
    scores = q.to(acc) @ shared_keys(q).to(acc).transpose(-1, -2)  # [B, H, N, N]
    # 1. the rounds in which i and j share a bucket (the paper's N_ij)
    shared = (buckets[..., :, None] == buckets[..., None, :]).sum(2)  # [B, H, N, N]
    rank = sort_order(buckets).argsort(dim=-1)  # [B, H, R, N] place of each token in its round's order
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    outs, lses = [], []
    for r in range(buckets.shape[2]):
        # 2. round r: same bucket, key in the query's chunk or the one before
        chunk = rank[:, :, r] // chunk_size  # [B, H, N]
        gap = chunk[..., :, None] - chunk[..., None, :]  # [B, H, N, N]
        allowed = (buckets[:, :, r, :, None] == buckets[:, :, r, None, :]) & ((gap == 0) | (gap == 1))
        logits = scores - shared.clamp_min(1).to(acc).log() - SELF_PENALTY * eye
        logits = logits.masked_fill(~allowed, float("-inf"))
        lses.append(logits.logsumexp(-1))
        outs.append(logits.softmax(-1) @ v.to(acc))
    # 3. rounds weighted by softmax of their logsumexp
    weights = torch.stack(lses).softmax(dim=0)  # [R, B, H, N]
    return (weights[..., None] * torch.stack(outs)).sum(0).to(q.dtype)


@register("reformer")
class ReformerAttention(Attention):
    order = 4.1
    paper = "Kitaev et al. 2020, Reformer: The Efficient Transformer"
    published_as = ("Reformer",)
    Config = ReformerConfig
    cost = "O(n_hashes N (log N + chunk D))"
    whole_sequence = {"chunk_size": "one chunk and one bucket: full attention (a token's own key penalised, as in LSH)"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="n_buckets per round x n_hashes rounds",
        expert_type="raw KV",
        construction="random-rotation LSH buckets of shared query-keys, sorted and chunked",
        routing="hash (argmax of a random rotation), union over rounds",
    )

    def __init__(self, dims: AttnDims, cfg: ReformerConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.n_hashes < 1 or cfg.chunk_size < 1:
            raise AttentionError(f"reformer needs n_hashes >= 1 and chunk_size >= 1; got {cfg.n_hashes}, {cfg.chunk_size}")
        nb = cfg.n_buckets
        if nb is not None and (nb < 1 or (nb > 1 and nb % 2)):
            raise AttentionError(f"reformer n_buckets must be 1 or even (argmax over [xR; -xR]); got {nb}")
        self.factors = default_buckets(dims.max_len, cfg.chunk_size) if nb is None else (nb,)
        self.n_buckets = math.prod(self.factors)
        gen = torch.Generator().manual_seed(cfg.seed)
        # [H, D, R, sum(factors) / 2]: one rotation per head and round, as HF's random_rotations
        self.register_buffer("rotations", torch.randn(dims.num_heads, dims.head_dim, cfg.n_hashes,
                                                      sum(self.factors) // 2, generator=gen))

    def budget(self) -> str:
        c = min(self.cfg.chunk_size, self.dims.max_len)
        return f"n_hashes x 2 chunk_size = {self.cfg.n_hashes} x {2 * c} = {self.cfg.n_hashes * 2 * c} (own bucket only)"

    @classmethod
    def flops(cls, cfg: ReformerConfig, n: int, d: int) -> Optional[Tuple[float, float]]:
        factors = default_buckets(n, cfg.chunk_size) if cfg.n_buckets is None else (cfg.n_buckets,)
        hashing = 1.0 * cfg.n_hashes * n * d * sum(factors)
        attend = 8.0 * cfg.n_hashes * n * min(cfg.chunk_size, n) * d
        return hashing + attend, hashing + 3 * attend

    def buckets(self, q: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The bucket of every token in every round [B, H, n_hashes, N] (padding: bucket n_buckets)."""
        return hash_buckets(q, self.rotations, self.factors, mask)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, h, n, d = q.shape
        r, c, acc = self.cfg.n_hashes, self.cfg.chunk_size, torch.promote_types(q.dtype, torch.float32)
        buckets = self.buckets(q, mask)  # [B, H, R, N]
        # the sequence filled to whole chunks with padding tokens (bucket n_buckets, sorted last)
        pad = -n % c
        m, chunks = n + pad, (n + pad) // c
        qk, v = (F.pad(q, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))) if pad else (q, v)
        buckets = F.pad(buckets, (0, pad), value=self.n_buckets) if pad else buckets
        # 1. each round's order: by bucket, then position
        order = sort_order(buckets)  # [B, H, R, M]

        def sort(x: torch.Tensor) -> torch.Tensor:  # [B, H, M, E] -> [B, H, R, chunks, c, E]
            index = order.reshape(b, h, r * m, 1).expand(b, h, r * m, x.shape[-1])
            return x.gather(2, index).view(b, h, r, chunks, c, x.shape[-1])

        def window(x: torch.Tensor) -> torch.Tensor:  # [B, H, R, chunks, c, ...] -> own chunk, then the one before
            return torch.cat([x, x.roll(1, dims=3)], dim=4)

        # 2. per chunk: its queries, and the keys of the chunk and the one before
        sq, sk, sv = sort(qk.to(acc)), sort(shared_keys(qk).to(acc)), sort(v.to(acc))  # [B, H, R, chunks, c, D]
        scores = sq @ window(sk).transpose(-1, -2)  # [B, H, R, chunks, c, 2c]
        with torch.no_grad():
            own = buckets.gather(3, order).view(b, h, r, chunks, c)  # [B, H, R, chunks, c]
            before = own.roll(1, dims=3)
            # the first chunk has none before it: bucket -1 matches no query
            before[:, :, :, 0] = -1
            apart = own[..., :, None] != torch.cat([own, before], dim=4)[..., None, :]  # [B, H, R, chunks, c, 2c]
            bias = torch.zeros(apart.shape, dtype=acc, device=q.device)
            if r > 1:
                # the rounds in which query and key share a bucket (N_ij), then -log N_ij
                rounds = sort(buckets.transpose(2, 3))  # [B, H, R, chunks, c, R]
                key_rounds = window(rounds)
                shared = torch.zeros(apart.shape, dtype=torch.uint8, device=q.device)
                for t in range(r):
                    shared += rounds[..., :, None, t] == key_rounds[..., None, :, t]
                # (a value at a time: a log over the whole tensor costs more than these few passes)
                for count in range(2, r + 1):
                    bias.masked_fill_(shared == count, -math.log(count))
            bias.masked_fill_(apart, float("-inf"))
            # a token meets itself on the diagonal of its own chunk
            bias.diagonal(dim1=-2, dim2=-1).sub_(SELF_PENALTY)
        scores = scores + bias
        probs = scores.softmax(-1)
        # logsumexp from the largest score and its weight, exp(top - lse): no second pass of exp
        lse = scores.amax(-1) - probs.amax(-1).log()  # [B, H, R, chunks, c]
        out = probs @ window(sv)  # [B, H, R, chunks, c, D]
        # 3. back to positions; rounds weighted by softmax of their logsumexp
        undo = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=q.device).expand_as(order))
        out = out.view(b, h, r, m, d).gather(3, undo[..., None].expand(b, h, r, m, d))
        weights = lse.view(b, h, r, m).gather(3, undo).softmax(dim=2)  # [B, H, R, M]
        return UnusedKeys.apply((weights[..., None] * out).sum(2)[:, :, :n].to(q.dtype), k)
