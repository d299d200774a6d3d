"""Grouped routed attention, the PyTorch form (kernel="torch"; the reference of the C and Triton forms).

A routed backend sends each query to a few experts, each a short list of keys and values. Giving
every query its own copy of its expert's keys costs (keys x D) memory per query; instead the
(query, expert) pairs are sorted by expert and cut into tiles of ``tile`` pairs that share one
expert, so each tile reads its expert's keys once and runs one small matmul. The tile size follows
the pairs each expert really holds (8 to 64), so short sequences with few queries per expert do not
pay for padded tiles. Tiles are ordered by expert, so the key gradients of a chunk's tiles are
added into the tables with sorted indices (multithreaded CPU index_add is faster sorted). When the
softmax weights of all tiles fit in ``tuning.SAVE_ELEMENTS`` they are kept for the backward pass;
otherwise tiles run a chunk at a time and are recomputed in the backward pass (as flash attention
does), so memory stays linear in the number of pairs with no large temporaries.
``merge`` combines a query's partial results over several experts by their log-sum-exp.

Under torch.compile this form breaks the graph: the tile size and the number of tiles come from
the pairs each expert holds (read on the host), so its shapes depend on the data. The C and Triton
forms have none of that: their operators take the pairs sorted by expert (``expert_runs``, static
shapes) and size their work inside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch

from .. import tuning

# tile sizes tried (pairs per tile); how many slots a chunk of the loop holds and how many softmax
# weights are kept for the backward pass are host tuning (tuning.CHUNK_SLOTS, SAVE_ELEMENTS)
TILES = (8, 16, 32, 64)
MIN_TILE = TILES[0]
# pairs per tile for a shared table, which holds every pair of its group: a few large matmuls
SHARED_TILE = 512


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

    def chunks(self, whole: bool = False) -> Iterator[slice]:
        """Consecutive runs of tiles of about tuning.CHUNK_SLOTS slots (all tiles at once when ``whole``)."""
        tiles = self.expert.numel()
        step = tiles if whole else max(1, tuning.CHUNK_SLOTS // self.tile)
        for first in range(0, tiles, max(step, 1)):
            yield slice(first, min(first + step, tiles))

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


def pick_tile(counts: torch.Tensor) -> int:
    """The tile size of TILES with the least padded slots plus per-tile overhead for these
    per-expert pair counts [E]."""
    # tiles needed at each size, read back in one transfer
    tiles = torch.stack([((counts + tile - 1) // tile).sum() for tile in TILES]).tolist()
    costs = [n * (tile + tuning.TILE_OVERHEAD_SLOTS) for n, tile in zip(tiles, TILES)]
    return TILES[costs.index(min(costs))]


def expert_runs(expert: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, those with no expert (number X) last, and each expert's run: expert x
    owns order[offsets[x]:offsets[x + 1]] (the grouping of the Triton and C kernels). [P] -> [P], [X + 1]."""
    order = torch.argsort(expert, stable=True)  # [P]
    if torch.compiler.is_compiling():
        # a scatter-add of ones: bincount's output size depends on the values, which breaks the graph
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=expert.device)
        counts = counts.scatter_add_(0, expert, torch.ones_like(expert))[:num_experts]  # [X]
    else:
        counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]  # [X]
    return order, torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))


def tile_by_expert(expert: torch.Tensor, num_experts: int, tile: Optional[int] = None) -> Tiling:
    """Group pairs by expert. expert: [P] long in [0, num_experts]; pairs of expert num_experts
    (no expert) are left out of every tile. ``tile``: pairs per tile (default: pick_tile)."""
    pairs = expert.numel()
    order = torch.argsort(expert, stable=True)  # [P] pairs sorted by expert
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]  # [E]
    tile = pick_tile(counts) if tile is None else tile
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


def _softmax_lse(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of logits [..., S] in place; returns the log-sum-exp [...]."""
    top = logits.amax(dim=-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
    logits.div_(total)
    return (top + total.log()).squeeze(-1)


class GroupedAttention(torch.autograd.Function):
    """softmax(q K_e^T) V_e for each pair, with the log-sum-exp of its logits.

    Works in the tiled layout: q is gathered into tiles once (scaled), each chunk of tiles reads its
    experts' key rows, writes its slice of the tiled output and (when they fit) keeps its weights.
    Backward of one softmax row p: d logits = p * (d_out . v - d_out . out + d_lse).
    """

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_ok: Optional[torch.Tensor],
        tiling: Tiling,
        scale: float,
        with_lse: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        # the inputs share one dtype (grouped_attention casts them); autocast would turn the chunk
        # products to bf16 against float32 output buffers, so the Function runs in that dtype as given
        with torch.autocast(q.device.type, enabled=False):
            return GroupedAttention._forward(ctx, q, keys, values, key_ok, tiling, scale, with_lse)

    @staticmethod
    def _forward(ctx, q, keys, values, key_ok, tiling, scale, with_lse):
        q_tiles = tiling.to_tiles(q).mul_(scale)  # [T, tile, D]
        num_tiles, tile = q_tiles.shape[:2]
        width = keys.shape[1]
        # weights [T, tile, S] and the tiles' keys and values [T, S, D] x 2, kept when they fit
        keep = num_tiles * width * (tile + 2 * q.shape[-1]) <= tuning.SAVE_ELEMENTS
        out = torch.empty_like(q_tiles)
        lse = q.new_empty(num_tiles, tile)  # [T, tile]
        kept: List[torch.Tensor] = []
        for tiles in tiling.chunks(whole=keep):
            experts = tiling.expert[tiles]  # [c]
            keys_t, values_t = _rows(keys, experts), _rows(values, experts)  # [c, S, D]
            logits = q_tiles[tiles] @ keys_t.transpose(-1, -2)  # [c, tile, S]
            if key_ok is not None:
                logits.masked_fill_(~key_ok.index_select(0, experts)[:, None, :], float("-inf"))
            lse[tiles] = _softmax_lse(logits)
            torch.bmm(logits, values_t, out=out[tiles])
            if keep:
                kept = [logits, keys_t, values_t]
        ctx.save_for_backward(q_tiles, keys, values, key_ok, out, *kept)
        ctx.tiling, ctx.scale, ctx.with_lse, ctx.keep = tiling, scale, with_lse, keep
        # a pair with no expert gets output 0 and log-sum-exp -inf (weight 0 in merge)
        return tiling.from_tiles(out), tiling.from_tiles(lse, float("-inf")) if with_lse else q.new_empty(0)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        with torch.autocast(d_out.device.type, enabled=False):
            return GroupedAttention._backward(ctx, d_out, d_lse)

    @staticmethod
    def _backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor):
        q_tiles, keys, values, key_ok, out, *kept = ctx.saved_tensors
        tiling = ctx.tiling
        d_out = tiling.to_tiles(d_out.to(out.dtype))  # [T, tile, D]
        offset = (d_out * out).sum(-1).neg_()  # [T, tile]
        if ctx.with_lse:
            offset += tiling.to_tiles(d_lse)
        d_q = torch.empty_like(q_tiles)
        # key and value gradients of each expert, transposed [X, D, S]: the products below come out so
        d_keys = keys.new_zeros(keys.shape[0], keys.shape[2] * keys.shape[1])
        d_values = torch.zeros_like(d_keys)
        for tiles in tiling.chunks(whole=ctx.keep):
            experts = tiling.expert[tiles]  # [c], ascending: tiles are ordered by expert
            q_t, d_out_t = q_tiles[tiles], d_out[tiles]  # [c, tile, D]
            if ctx.keep:
                weights, keys_t, values_t = kept
            else:
                keys_t, values_t = _rows(keys, experts), _rows(values, experts)  # [c, S, D]
                weights = q_t @ keys_t.transpose(-1, -2)  # [c, tile, S]
                if key_ok is not None:
                    weights.masked_fill_(~key_ok.index_select(0, experts)[:, None, :], float("-inf"))
                _softmax_lse(weights)
            # (A^T B)^T = B^T A, with B^T made contiguous first: a bmm whose first operand is a
            # transposed view is ~3x slower on the CPU, and index_add wants a contiguous source
            d_values.index_add_(0, experts, (d_out_t.transpose(-1, -2).contiguous() @ weights).flatten(1))
            d_logits = (d_out_t @ values_t.transpose(-1, -2)).add_(offset[tiles][..., None]).mul_(weights)
            torch.bmm(d_logits, keys_t, out=d_q[tiles])
            d_keys.index_add_(0, experts, (q_t.transpose(-1, -2).contiguous() @ d_logits).flatten(1))
        d_q.mul_(ctx.scale)
        shape = (keys.shape[0], keys.shape[2], keys.shape[1])
        d_keys, d_values = (g.view(shape).transpose(-1, -2) for g in (d_keys, d_values))  # [X, S, D]
        return tiling.from_tiles(d_q), d_keys, d_values, None, None, None, None


def _rows(table: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """table[experts] for a [X, S, D] table: [c] -> [c, S, D] (through a 2-D view, ~4x faster on the CPU)."""
    return table.reshape(table.shape[0], -1).index_select(0, experts).view(-1, *table.shape[1:])


def grouped_attention(
    q: torch.Tensor,
    expert: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_ok: Optional[torch.Tensor],
    scale: float,
    with_lse: bool = False,
    shared: Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]] = None,
    tile: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each pair's attention over its expert's keys: softmax(scale q K_e^T) V_e.

    q: [P, D] one query row per pair; expert: [P] long in [0, X], where X (one past the last
    expert) means no expert; keys, values: [X, S, D] each expert's keys and values; key_ok:
    [X, S] bool (False = masked key) or None. Every expert keeps at least one real key.
    shared: (keys [G, M, D], values [G, M, D], ok [G, M] or None, group): every run of ``group``
    consecutive experts also holds shared[x // group] under the same softmax (MiTA's landmarks,
    shared by the m experts of one head; their logits are scaled by ``scale`` too). Returns out
    [P, D] and, when with_lse, the log-sum-exp of each pair's logits [P] (-inf, with out 0, for a
    pair with no expert). ``tile``: pairs per tile (default: chosen from the pairs per expert).
    """
    # one dtype for the Function: q's (under autocast the projections give bf16 q, k, v, while
    # tables built from them by float32 ops, such as landmark pooling, may not be)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if shared is None:
        tiling = tile_by_expert(expert, keys.shape[0], tile)
        return GroupedAttention.apply(q, keys, values, key_ok, tiling, scale, with_lse)
    # the shared table as an expert of its own: the pairs of group g (in order when the pairs come
    # sorted by expert, as MiTA's queries do) in large tiles, then one softmax over both parts by
    # their log-sum-exp (the Triton kernel instead runs both in one online softmax)
    shared_keys, shared_values, shared_ok, group = shared
    groups = shared_keys.shape[0]
    out, lse = grouped_attention(q, expert, keys, values, key_ok, scale, True, tile=tile)
    per_group = max(1, expert.numel() // groups)
    shared_tile = min(SHARED_TILE, max(MIN_TILE, 1 << (per_group - 1).bit_length()))
    shared_out, shared_lse = grouped_attention(
        q, torch.where(expert < keys.shape[0], expert // group, groups), shared_keys, shared_values, shared_ok,
        scale, True, tile=shared_tile,
    )
    # two parts: softmax weight of the shared part sigmoid(lse_s - lse), one fused lerp (a pair
    # with no expert in either part has both -inf: weight 0.5 of two zero outputs)
    weight = torch.sigmoid(torch.nan_to_num(shared_lse - lse, nan=0.0))[:, None]  # [P, 1]
    out = torch.lerp(out, shared_out, weight)
    return out, torch.logaddexp(shared_lse, lse) if with_lse else q.new_empty(0)


class GatherRows(torch.autograd.Function):
    """table[rows]: a [R, D] table and rows [X, S] -> [X, S, D]. The backward adds each gradient row
    back to its table row; on the CPU in sorted row order (64K rows of 32 into 16K: 1.9 ms sorted,
    sort included, against 5.9 ms unsorted with 2 threads; 3.8 against 2.3 ms with one)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.table_rows = table.shape[0]
        return table.index_select(0, rows.flatten()).view(*rows.shape, table.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        rows, grad = rows.flatten(), grad.reshape(-1, grad.shape[-1])  # [X*S], [X*S, D]
        if not grad.is_cuda:
            rows, order = torch.sort(rows, stable=True)
            grad = grad.index_select(0, order)
        return grad.new_zeros(ctx.table_rows, grad.shape[-1]).index_add_(0, rows, grad), None


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [X, S] of a [R, D] table -> [X, S, D], differentiable in the table."""
    return GatherRows.apply(table, rows)


def merge(out: torch.Tensor, lse: torch.Tensor, slot_major: bool = False) -> torch.Tensor:
    """One softmax over a query's E partial results. out: [R, E, D], lse: [R, E] -> [R, D]
    (slot_major: out [E, R, D], lse [E, R])."""
    if slot_major:
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)
    total = torch.logsumexp(lse, dim=-1, keepdim=True)  # [R, 1]
    # a row whose parts all have no expert (lse -inf) gets weight 0 everywhere, not nan
    weights = (lse - torch.where(torch.isfinite(total), total, 0.0)).exp()  # [R, E]
    return (out * weights[..., None]).sum(dim=1)
