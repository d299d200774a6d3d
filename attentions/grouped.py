"""Attention of routed queries against small experts, grouped by expert (used by MoBA and MiTA).

A routed backend sends each query to a few experts, each a short list of keys and values. Giving
every query its own copy of its expert's keys costs (keys x D) memory per query; instead the
(query, expert) pairs are sorted by expert and cut into tiles of ``tile`` pairs that share one
expert, so each tile gathers its expert's keys once and runs one small matmul. Tiles are processed
a chunk at a time and recomputed in the backward pass (as flash attention does), so the memory
kept per pair is its output row and one log-sum-exp: linear in the number of pairs, with no
large temporaries. ``merge`` combines a query's partial results over several experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

# pairs per tile lie in [MIN_TILE, MAX_TILE], near the mean pairs per expert; a chunk of the loop
# holds CHUNK_SLOTS slots (speed only: results do not depend on these)
MIN_TILE, MAX_TILE = 16, 64
CHUNK_SLOTS = 32768


@dataclass
class Tiling:
    """Where each (query, expert) pair sits once the pairs are grouped into single-expert tiles."""

    # [P] the slot of each pair in the tiled layout; num_tiles * tile for a pair with no expert
    slot: torch.Tensor
    # [num_tiles * tile] the pair held by each slot; P marks an empty slot
    source: torch.Tensor
    # [num_tiles] the expert of each tile
    expert: torch.Tensor
    tile: int
    # [num_tiles * tile] True for an empty slot
    empty: torch.Tensor
    # [P] True for a pair with no expert; None when every pair has one
    unrouted: Optional[torch.Tensor]

    def chunks(self) -> Iterator[Tuple[slice, torch.Tensor]]:
        """(tiles, their experts [c]) for consecutive chunks of about CHUNK_SLOTS slots."""
        step = max(1, CHUNK_SLOTS // self.tile)
        for first in range(0, self.expert.numel(), step):
            tiles = slice(first, min(first + step, self.expert.numel()))
            yield tiles, self.expert[tiles]

    def to_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Pair rows into the tiled layout, zeros in empty slots. [P, ...] -> [num_tiles, tile, ...]."""
        rows = x.index_select(0, self.source.clamp(max=x.shape[0] - 1))
        rows.masked_fill_(self.empty.view(-1, *[1] * (x.dim() - 1)), 0.0)
        return rows.view(-1, self.tile, *x.shape[1:])

    def from_tiles(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Tiled rows back to pairs. [num_tiles, tile, ...] -> [P, ...]; a pair with no expert gets fill."""
        rows = x.reshape(-1, *x.shape[2:])
        rows = rows.index_select(0, self.slot.clamp(max=rows.shape[0] - 1))
        if self.unrouted is not None:
            rows.masked_fill_(self.unrouted.view(-1, *[1] * (rows.dim() - 1)), fill)
        return rows


def tile_by_expert(expert: torch.Tensor, num_experts: int) -> Tiling:
    """Group pairs by expert. expert: [P] long in [0, num_experts]; pairs of expert num_experts
    (no expert) are left out of every tile."""
    pairs = expert.numel()
    # a power of two near the mean pairs per expert keeps the padding of each last tile small
    mean = max(1, pairs // num_experts)
    tile = min(max(1 << (mean.bit_length() - 1), MIN_TILE), MAX_TILE)
    order = torch.argsort(expert, stable=True)  # [P] pairs sorted by expert
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]  # [E]
    order = order[: int(counts.sum())]
    tiles = (counts + tile - 1) // tile  # [E] tiles per expert
    first_tile = torch.cumsum(tiles, 0) - tiles  # [E]
    first_pair = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    sorted_expert = expert[order]
    # a pair's rank among the pairs of its expert decides its slot inside the expert's tiles
    rank = torch.arange(order.numel(), device=expert.device) - first_pair[sorted_expert]
    sorted_slot = first_tile[sorted_expert] * tile + rank  # [P'] slot of each sorted pair
    num_slots = int(tiles.sum()) * tile
    source = torch.full((num_slots,), pairs, dtype=torch.long, device=expert.device)
    source[sorted_slot] = order
    slot = torch.full((pairs,), num_slots, dtype=torch.long, device=expert.device)
    slot[order] = sorted_slot
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=expert.device), tiles)
    unrouted = None if order.numel() == pairs else slot == num_slots
    return Tiling(slot=slot, source=source, expert=tile_expert, tile=tile, empty=source == pairs, unrouted=unrouted)


@dataclass
class Experts:
    """How the experts' key and value tables are read, and which keys are masked.

    Expert x holds keys[x] [S, D]; with a shared table, every run of ``group`` consecutive experts
    also holds shared[x // group] [M, D], placed before its own keys (MiTA's landmarks, shared by
    the m experts of one head). key_ok [X, S] and shared_ok [X // group, M] mark real keys (None:
    all real); every expert must keep at least one real key.
    """

    key_ok: Optional[torch.Tensor]
    shared_ok: Optional[torch.Tensor]
    group: int

    def gather(self, keys: torch.Tensor, shared: Optional[torch.Tensor], experts: torch.Tensor) -> torch.Tensor:
        """The keys (or values) of a chunk's experts [c] -> [c, M + S, D]."""
        own = keys.index_select(0, experts)
        if shared is None:
            return own
        return torch.cat([shared.index_select(0, experts // self.group), own], dim=1)

    def scatter_add(
        self, grad: torch.Tensor, keys: torch.Tensor, shared: Optional[torch.Tensor], experts: torch.Tensor
    ) -> None:
        """Add a chunk's gradient [c, M + S, D] into the tables' gradients (the inverse of gather)."""
        if shared is not None:
            shared.index_put_((experts // self.group,), grad[:, : shared.shape[1]], accumulate=True)
            grad = grad[:, shared.shape[1] :]
        keys.index_put_((experts,), grad, accumulate=True)

    def logits(self, q: torch.Tensor, keys: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Logits of a chunk's queries q [c, tile, D] against its gathered keys [c, S', D] -> [c, tile, S']."""
        logits = q @ keys.transpose(-1, -2)
        if self.key_ok is not None:
            shared_ok = None if self.shared_ok is None else self.shared_ok[..., None]
            ok = self.gather(self.key_ok[..., None], shared_ok, experts)[..., 0]  # [c, S']
            logits.masked_fill_(~ok[:, None, :], float("-inf"))
        return logits


class GroupedAttention(torch.autograd.Function):
    """softmax(q K_e^T) V_e for each pair (keys come pre-scaled), with the log-sum-exp of its logits.

    Works in the tiled layout: q is gathered into tiles once, each chunk of tiles writes its slice
    of the tiled output, and the backward pass recomputes each chunk's softmax.
    """

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        shared_keys: Optional[torch.Tensor],
        shared_values: Optional[torch.Tensor],
        experts: Experts,
        tiling: Tiling,
        with_lse: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # the inputs share one dtype (grouped_attention casts them); autocast would turn the chunk
        # products to bf16 against float32 output buffers, so the Function runs in that dtype as given
        with torch.autocast(q.device.type, enabled=False):
            return GroupedAttention._forward(ctx, q, keys, values, shared_keys, shared_values, experts, tiling, with_lse)

    @staticmethod
    def _forward(ctx, q, keys, values, shared_keys, shared_values, experts, tiling, with_lse):
        q_tiles = tiling.to_tiles(q)  # [T, tile, D]
        out = torch.empty_like(q_tiles)
        lse = q.new_empty(q_tiles.shape[:2])  # [T, tile]
        for tiles, chunk in tiling.chunks():
            logits = experts.logits(q_tiles[tiles], experts.gather(keys, shared_keys, chunk), chunk)  # [c, tile, S']
            if with_lse:
                lse[tiles] = logits.logsumexp(dim=-1)
            torch.bmm(logits.softmax(dim=-1), experts.gather(values, shared_values, chunk), out=out[tiles])
        ctx.save_for_backward(q_tiles, keys, values, shared_keys, shared_values, out)
        ctx.experts, ctx.tiling, ctx.with_lse = experts, tiling, with_lse
        # a pair with no expert gets output 0 and log-sum-exp -inf (weight 0 in merge)
        return tiling.from_tiles(out), tiling.from_tiles(lse, float("-inf")) if with_lse else q.new_empty(0)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        with torch.autocast(d_out.device.type, enabled=False):
            return GroupedAttention._backward(ctx, d_out, d_lse)

    @staticmethod
    def _backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        q_tiles, keys, values, shared_keys, shared_values, out = ctx.saved_tensors
        experts, tiling = ctx.experts, ctx.tiling
        d_out = tiling.to_tiles(d_out.to(out.dtype))  # [T, tile, D]
        # softmax backward: d logits = p * (d_out . v - d_out . out + d_lse), as d lse / d logits = p
        offset = (d_out * out).sum(-1).neg_()  # [T, tile]
        if ctx.with_lse:
            offset += tiling.to_tiles(d_lse)
        d_q = torch.empty_like(q_tiles)
        d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
        d_shared_keys = None if shared_keys is None else torch.zeros_like(shared_keys)
        d_shared_values = None if shared_values is None else torch.zeros_like(shared_values)
        for tiles, chunk in tiling.chunks():
            q_t, d_out_t = q_tiles[tiles], d_out[tiles]  # [c, tile, D]
            keys_t = experts.gather(keys, shared_keys, chunk)  # [c, S', D]
            values_t = experts.gather(values, shared_values, chunk)
            weights = experts.logits(q_t, keys_t, chunk).softmax(dim=-1)  # [c, tile, S']
            experts.scatter_add(weights.transpose(-1, -2) @ d_out_t, d_values, d_shared_values, chunk)
            d_logits = (d_out_t @ values_t.transpose(-1, -2)).add_(offset[tiles][..., None]).mul_(weights)
            torch.bmm(d_logits, keys_t, out=d_q[tiles])
            experts.scatter_add(d_logits.transpose(-1, -2) @ q_t, d_keys, d_shared_keys, chunk)
        return tiling.from_tiles(d_q), d_keys, d_values, d_shared_keys, d_shared_values, None, None, None


def grouped_attention(
    q: torch.Tensor,
    expert: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_ok: Optional[torch.Tensor],
    scale: float,
    with_lse: bool = False,
    shared: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each pair's attention over its expert's keys: softmax(scale q K_e^T) V_e.

    q: [P, D] one query row per pair; expert: [P] long in [0, X], where X (one past the last
    expert) means no expert; keys, values: [X, S, D]; key_ok: [X, S] bool (False = masked key) or
    None. shared: (keys [G, M, D], values [G, M, D], ok [G, M] or None, group) added before the keys
    of each run of ``group`` experts (see Experts). Returns out [P, D] and, when with_lse, the
    log-sum-exp of each pair's logits [P] (-inf, with out 0, for a pair with no expert).
    """
    tiling = tile_by_expert(expert, keys.shape[0])
    shared_keys, shared_values, shared_ok, group = shared if shared is not None else (None, None, None, 1)
    if shared_keys is not None and (key_ok is not None or shared_ok is not None):
        # one mask covers both tables, so a missing one means all keys real
        if key_ok is None:
            key_ok = torch.ones(keys.shape[:2], dtype=torch.bool, device=q.device)
        if shared_ok is None:
            shared_ok = torch.ones(shared_keys.shape[:2], dtype=torch.bool, device=q.device)
    experts = Experts(key_ok=key_ok, shared_ok=shared_ok, group=group)
    # one dtype for the Function: q's (under autocast the projections give bf16 q, k, v, while tables
    # built from them by float32 ops, such as landmark pooling, may not be)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if shared_keys is not None:
        shared_keys, shared_values = shared_keys.to(q.dtype), shared_values.to(q.dtype)
    shared_keys = None if shared_keys is None else shared_keys * scale
    return GroupedAttention.apply(q, keys * scale, values, shared_keys, shared_values, experts, tiling, with_lse)


def merge(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """One softmax over a query's E partial results. out: [R, E, D], lse: [R, E] -> [R, D]."""
    weights = (lse - torch.logsumexp(lse, dim=-1, keepdim=True)).exp()  # [R, E]
    return (out * weights[..., None]).sum(dim=1)
