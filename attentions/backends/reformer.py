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

``form="chunked"`` is the form of the code behind the published rows (HF ``LSHSelfAttention``, trax):
one sort lays the rounds end to end, each by (bucket, position), and a query attends to every key of
its chunk and the chunk before, whatever the key's bucket, the chunk before the first being the last
(so a chunk may hold two rounds' tokens, and a key met in two rounds counts twice); the token itself
only when it has no other key. Padding tokens are sorted after every round's real tokens, so the
real tokens' chunks do not depend on the padded length; without padding, and N a multiple of the
chunk, it is HF's computation exactly (a sequence within one chunk: HF's plain attention).

Sources: the paper (Sec. 2-3); google/trax ``trax/layers/research/efficient_attention.py``;
huggingface transformers ``LSHSelfAttention``, which the PyTorch LRA code wraps (mlpen/Nystromformer
``LRA/code/attention_reformer.py``, reused by Skyformer, sets query_key = W_q, 2 hashes in
Skyformer's ``src/config.py``). Defaults are HF's: chunk 64, one chunk before and none after, and
n_buckets = 2 max_len / chunk rounded down to a power of two, hashed as two factors (two rotations)
above 2 max(sqrt(max_len / chunk), chunk) buckets. Where this file and that code differ:
- the default form is the paper's attention within the bucket only and its duplicate count log N_ij
  (HF lets a query attend every key of the two chunks, whatever its bucket, and counts a key once
  per round it appears in: ``form="chunked"``);
- the queries q are the shared query-keys (HF's query_key is tied to W_q); the keys k are not used
  (their gradient is zero);
- padding: padded tokens take an extra last bucket (as HF); the bucket form chunks each round on its
  own from its first sorted token (HF chunks the rounds laid end to end, and the chunk before a round's
  first chunk is the previous round's last), the chunked form sorts the padding after every round's
  real tokens (HF sorts it last within each round), so in both the chunks of the real tokens do not
  depend on the padded length;
- the rotations are a seeded buffer saved with the model (HF and trax draw new ones at every call).
One bucket with a chunk covering the sequence is full softmax attention over q_i . q_j / |q_j|,
j != i (the token itself only when alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..registry import register

# the paper's m_ii: a token's score with itself is lowered by this much
SELF_PENALTY = 1e5
# which keys a query reaches in a round (ReformerConfig.form)
FORMS = ("bucket", "chunked")


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
    # "bucket": the keys of the query's own bucket in its chunk and the one before (the paper);
    # "chunked": every key of those two chunks, the rounds sorted end to end (HF, trax)
    form: str = "bucket"


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


class ChunkSoftmax(torch.autograd.Function):
    """Softmax and logsumexp over the last axis of a chunk's scores with their bias, in one new buffer:
    scores + ``bias`` (the bucket form's), or scores with -SELF_PENALTY where ``itself`` and -inf where
    ``blocked`` (the chunked form's). The backward needs the probabilities only:
    d scores = p (d probs - sum(d probs p) + d lse) (the logsumexp's gradient is p)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, bias: Optional[torch.Tensor], itself: Optional[torch.Tensor],
                blocked: Optional[torch.Tensor]):
        x = scores + bias if bias is not None else scores.masked_fill(itself, -SELF_PENALTY)
        if blocked is not None:
            x.masked_fill_(blocked, float("-inf"))
        top = x.amax(dim=-1, keepdim=True)
        total = x.sub_(top).exp_().sum(dim=-1, keepdim=True)
        probs = x.div_(total)
        ctx.save_for_backward(probs)
        return probs, (top + total.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, d_probs: torch.Tensor, d_lse: torch.Tensor):
        (probs,) = ctx.saved_tensors
        inner = (d_probs[..., None, :] @ probs[..., :, None])[..., 0]  # [..., 1]: sum(d probs p) of each row
        return (d_probs - (inner - d_lse[..., None])).mul_(probs), None, None, None


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


def chunked_slots(buckets: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """The chunked form's one sort [B, H, R*N]: slot s holds token r*N + position of round r. Every
    round's real tokens by (bucket, position), round after round (HF's and trax's sort of the buckets
    offset by round), then the padding tokens (bucket n_buckets) of every round."""
    r, n = buckets.shape[2], buckets.shape[3]
    rounds = torch.arange(r, device=buckets.device)[:, None]  # [R, 1]
    position = torch.arange(n, device=buckets.device)
    real = (rounds * n_buckets + buckets) * n + position  # [B, H, R, N], below r n_buckets n
    padding = (r * n_buckets + rounds) * n + position
    return torch.where(buckets == n_buckets, padding, real).flatten(2).argsort(dim=-1)


def chunked_reference(q: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, chunk_size: int,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain chunked form with [N, N] scores, from the buckets [B, H, R, N] of hash_buckets: in each round
    a key weighs as many times as its copies (one a round) lie in the query's chunk or the one before
    (N <= chunk_size: one chunk that is the chunk before itself, so every key twice)."""
    if q.shape[2] <= chunk_size:
        # one chunk: plain attention (HF's), the rounds all the same
        buckets = buckets[:, :, :1]
    b, h, r, n = buckets.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    real = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
    length = real.sum(-1)[:, None, None, None]  # [B, 1, 1, 1]
    scores = q.to(acc) @ shared_keys(q).to(acc).transpose(-1, -2)  # [B, H, N, N]
    # 1. each real token's slot in each round: after the earlier rounds' real tokens, by (bucket, position)
    rank = sort_order(buckets).argsort(dim=-1)  # [B, H, R, N]
    chunk = (torch.arange(r, device=q.device)[:, None] * length + rank) // chunk_size  # [B, H, R, N]
    # the chunk before the first is the last that holds a real token
    last = (r * length + chunk_size - 1) // chunk_size - 1
    before = torch.where(chunk == 0, last, chunk - 1)
    # 2. round i: the copies of key j (its slots in every round) in query's chunk and the chunk before
    key_chunks = chunk.transpose(2, 3)[:, :, None]  # [B, H, 1, N, R]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    outs, lses = [], []
    for i in range(r):
        copies = ((key_chunks == chunk[:, :, i, :, None, None]).sum(-1)
                  + (key_chunks == before[:, :, i, :, None, None]).sum(-1))  # [B, H, N, N]
        copies = copies.masked_fill(~real[:, None, None, :], 0)
        # a padding query (its output is not used) attends to itself
        copies = copies.masked_fill(~real[:, None, :, None] & eye, 1)
        logits = scores + copies.to(acc).log() - SELF_PENALTY * eye
        lses.append(logits.logsumexp(-1))
        outs.append(logits.softmax(-1) @ v.to(acc))
    # 3. rounds weighted by softmax of their logsumexp
    weights = torch.stack(lses).softmax(dim=0)  # [R, B, H, N]
    return (weights[..., None] * torch.stack(outs)).sum(0).to(q.dtype)


def chunked(qk: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, n_buckets: int, chunk_size: int,
            length: torch.Tensor, padded: bool) -> torch.Tensor:
    """The chunked form for qk, v [B, H, M, D] (M a multiple of chunk_size, padding at bucket n_buckets)
    and the real tokens of each sequence, length [B] (``padded``: some may be fewer than M); out
    [B, H, M, D] (padding rows finite)."""
    b, h, m, d = qk.shape
    if m == chunk_size:
        # the sequence fits in one chunk: plain attention, as HF runs it (every round would be the same)
        buckets = buckets[:, :, :1]
    r, c = buckets.shape[2], chunk_size
    slots, chunks = r * m, r * m // c
    acc = torch.promote_types(qk.dtype, torch.float32)
    # 1. one sort of every round's tokens; the slots below r * length hold real tokens
    order = chunked_slots(buckets, n_buckets)  # [B, H, R*M]
    position = order % m
    last = (r * length + c - 1) // c - 1  # [B] the last chunk holding a real token
    batch = torch.arange(b, device=qk.device)

    def sort(x: torch.Tensor) -> torch.Tensor:  # [B, H, M, E] -> [B, H, chunks, c, E]
        return x.gather(2, position[..., None].expand(b, h, slots, x.shape[-1])).view(b, h, chunks, c, x.shape[-1])

    def window(x: torch.Tensor) -> torch.Tensor:  # [B, H', chunks, c, E] -> own chunk, then the one before
        before = torch.cat([x[batch, :, last][:, :, None], x[:, :, :-1]], dim=2)
        return torch.cat([x, before], dim=3)

    # 2. per chunk: its queries, and every key of the chunk and the one before
    sq, sk, sv = sort(qk.to(acc)), sort(shared_keys(qk).to(acc)), sort(v.to(acc))  # [B, H, chunks, c, D]
    scores = sq @ window(sk).transpose(-1, -2)  # [B, H, chunks, c, 2c]
    with torch.no_grad():
        # the token itself, in whichever round's copy it meets (positions as int32: a cheaper compare)
        query_at = position.to(torch.int32).view(b, h, chunks, c, 1)
        itself = query_at == window(query_at)[..., 0][..., None, :]  # [B, H, chunks, c, 2c]
        blocked = None
        if padded:
            # real queries reach real keys, padding queries padding keys (their rows stay finite)
            padding = (torch.arange(slots, device=qk.device) >= r * length[:, None]).view(b, 1, chunks, c, 1)
            blocked = padding != window(padding)[..., 0][..., None, :]  # [B, 1, chunks, c, 2c]
    probs, lse = ChunkSoftmax.apply(scores, None, itself, blocked)  # [B, H, chunks, c, 2c], [B, H, chunks, c]
    out = probs @ window(sv)  # [B, H, chunks, c, D]
    # 3. back to (round, position); rounds weighted by softmax of their logsumexp
    undo = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=qk.device).expand_as(order))
    out = out.view(b, h, slots, d).gather(2, undo[..., None].expand(b, h, slots, d)).view(b, h, r, m, d)
    weights = lse.view(b, h, slots).gather(2, undo).view(b, h, r, m).softmax(dim=2)  # [B, H, R, M]
    return (weights[..., None] * out).sum(2)


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
        if cfg.form not in FORMS:
            raise AttentionError(f"reformer form {cfg.form!r} is not one of {', '.join(FORMS)}")
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
        reach = "own bucket only" if self.cfg.form == "bucket" else "every key of both chunks"
        return f"n_hashes x 2 chunk_size = {self.cfg.n_hashes} x {2 * c} = {self.cfg.n_hashes * 2 * c} ({reach})"

    @classmethod
    def variant(cls, options: Dict[str, Any]) -> str:
        form = options.get("form", ReformerConfig.form)
        return "" if form == ReformerConfig.form else str(form)

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
        if self.cfg.form == "chunked":
            length = torch.full((b,), n, device=q.device) if mask is None else mask.sum(-1)
            out = chunked(qk, v, buckets, self.n_buckets, c, length, padded=mask is not None or pad > 0)
            return UnusedKeys.apply(out[:, :, :n].to(q.dtype), k)
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
        probs, lse = ChunkSoftmax.apply(scores, bias, None, None)  # [B, H, R, chunks, c, 2c], [B, H, R, chunks, c]
        out = probs @ window(sv)  # [B, H, R, chunks, c, D]
        # 3. back to positions; rounds weighted by softmax of their logsumexp
        undo = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=q.device).expand_as(order))
        out = out.view(b, h, r, m, d).gather(3, undo[..., None].expand(b, h, r, m, d))
        weights = lse.view(b, h, r, m).gather(3, undo).softmax(dim=2)  # [B, H, R, M]
        return UnusedKeys.apply((weights[..., None] * out).sum(2)[:, :, :n].to(q.dtype), k)
