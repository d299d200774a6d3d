"""MoBA (Lu et al. 2025, MoBA: Mixture of Block Attention for Long-Context LLMs), bidirectional form.

The sequence is cut into blocks of block_size tokens from token 0. Each query scores every block
by the dot product with the block's mean real key and attends, under one softmax, to the keys of
its topk best blocks. As in MoonshotAI/MoBA, a query's own block is forced in (its gate is +inf)
and takes one of the topk slots, so the defaults (block_size = 64, topk = 2) give each query its
own block plus one chosen block: 2 x 64 = 128 keys. Cost: O(N^2 D / block_size) for the gate plus
O(N topk block_size D) for the attention; memory linear in N (queries are gated in chunks, and
no N x N matrix is built).
The fast path groups (query, block) pairs by block (ops/grouped: on the CPU its C kernel, and the gate
on ops/block_gate's kernel too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import real_key_mask
from ..ops import block_gate, tuning
from ..ops.grouped import check_kernel, kernel_name, merge, pick_grouped
from ..ops.grouped.cpu import grouped_attention_cpu, merge_cpu, takes
from ..ops.grouped.merged_cpu import merged_attention_cpu
from ..registry import register


@dataclass
class MoBAConfig:
    # tokens per block, blocks fixed in position from token 0 (the last one may be shorter)
    block_size: int = 64
    # blocks per query, the own block included when include_own_block
    topk: int = 2
    # always attend to the query's own block (it takes one of the topk slots)
    include_own_block: bool = True
    # grouped attention kernels: "torch", "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "cpu"
    # (the C kernel, float32 on the CPU), or "auto" (Triton on CUDA when installed, as validated and
    # timed on an H200; the C kernel on the CPU where it builds; PyTorch otherwise)
    kernel: str = "auto"


def pad_tokens(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [B, H, N, D] with ``pad`` zero rows after the last token (x itself when pad is 0: F.pad
    copies even then)."""
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def choose_blocks(
    q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], block_size: int, topk: int, include_own: bool,
    native: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each query's chosen blocks [B, H, N, topk'] and whether each slot holds a real block.

    topk' = min(topk, blocks); a slot is empty when the sequence has fewer non-empty blocks.
    native: the gate and choice on the C kernel (ops/block_gate) where it takes the inputs.
    """
    b, h, n, d = q.shape
    blocks = math.ceil(n / block_size)
    pad = blocks * block_size - n
    per_query = min(topk, blocks)
    real = F.pad(real_key_mask(mask, q), (0, pad)).to(k.dtype).view(b, 1, blocks, block_size)
    with torch.no_grad():
        sums = (pad_tokens(k, pad).reshape(b, h, blocks, block_size, d) * real[..., None]).sum(-2)
        counts = real.sum(-1)  # [B, 1, blocks]
        means = sums / counts.clamp(min=1)[..., None]  # [B, H, blocks, D]: mean over real keys
    return block_gate.choose_blocks(q, means, counts[:, 0] == 0, block_size, per_query, include_own, native)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    block_size: int = 64,
    topk: int = 2,
    include_own_block: bool = True,
) -> torch.Tensor:
    """MoBA on the full [N, N] score matrix, keys outside the chosen blocks masked out."""
    b, h, n, d = q.shape
    real_keys = real_key_mask(mask, q)  # [B, N]
    blocks = math.ceil(n / block_size)
    gate = q.new_empty(b, h, n, blocks)  # [B, H, N, blocks]
    for j in range(blocks):
        span = slice(j * block_size, (j + 1) * block_size)
        real = real_keys[:, None, span, None].to(k.dtype)  # [B, 1, size, 1]
        mean = (k[:, :, span] * real).sum(-2) / real.sum(-2).clamp(min=1)  # [B, H, D]
        gate[..., j] = (q * mean[:, :, None, :]).sum(-1).detach()
        if include_own_block:
            gate[:, :, span, j] = float("inf")
        gate[~real_keys[:, span].any(-1), :, :, j] = float("-inf")
    top, chosen = gate.topk(min(topk, blocks), dim=-1)  # [B, H, N, topk']
    picked = torch.zeros_like(gate, dtype=torch.bool).scatter(-1, chosen, top > float("-inf"))
    block_of_key = torch.arange(n, device=q.device) // block_size
    allowed = picked[..., block_of_key] & real_keys[:, None, None, :]  # [B, H, N, N]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v


@register("moba")
class MoBAAttention(Attention):
    order = 3
    paper = "Lu et al. 2025, MoBA: Mixture of Block Attention for Long-Context LLMs"
    Config = MoBAConfig
    cost = "O(N^2 D / block_size + N topk block_size D)"
    whole_sequence = {"block_size": "one block of the whole sequence: full attention",
                      "topk": "every block: full attention"}
    taxonomy = Taxonomy(
        scaling="routing",
        expert_count="N/B blocks",
        expert_type="raw KV (contiguous block)",
        construction="fixed blocks",
        routing="per-query top-k over block mean keys",
    )

    def __init__(self, dims: AttnDims, cfg: MoBAConfig) -> None:
        super().__init__(dims, cfg)
        for name in ("block_size", "topk"):
            if getattr(cfg, name) < 1:
                raise AttentionError(f"moba {name} must be a positive integer, got {getattr(cfg, name)}")
        check_kernel(cfg.kernel, "moba")

    @classmethod
    def implementation(cls, cfg: MoBAConfig, device: torch.device) -> str:
        return f"attentions.moba ({kernel_name(cfg.kernel, device)} kernel)"

    @classmethod
    def covers(cls, cfg: MoBAConfig, option: str, max_len: int) -> int:
        """A block covers the sequence at max_len tokens; topk counts blocks: all of them."""
        return -(-max_len // cfg.block_size) if option == "topk" else max_len

    def budget(self) -> str:
        return f"topk x block_size = {self.cfg.topk * self.cfg.block_size}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        split = tuning.in_batch_chunks(self.forward, q, k, v, mask)
        if split is not None:
            return split
        cfg = self.cfg
        b, h, n, d = q.shape
        size = cfg.block_size
        blocks = math.ceil(n / size)
        pad = blocks * size - n
        grouped_attention = pick_grouped(cfg.kernel, q.device)
        native = grouped_attention is grouped_attention_cpu
        chosen, chosen_ok = choose_blocks(q, k, mask, size, cfg.topk, cfg.include_own_block, native)
        per_query = chosen.shape[-1]
        # blocks numbered over (batch, head, block); an empty slot goes to no block (number B*H*blocks).
        # Pairs slot-major (pair = slot * B*H*N + query): the own block is slot 0 on the C kernel, so
        # an own-block expert's pairs are consecutive rows of q and of the results
        heads = torch.arange(b * h, device=q.device)[:, None, None]
        expert = heads * blocks + chosen.view(b * h, n, per_query)  # [B*H, N, topk']
        expert = torch.where(chosen_ok.view(b * h, n, per_query), expert, b * h * blocks)
        expert = expert.permute(2, 0, 1)  # [topk', B*H, N]
        block_k = pad_tokens(k, pad).reshape(b * h * blocks, size, d)
        block_v = pad_tokens(v, pad).reshape(b * h * blocks, size, d)
        block_ok = None
        if mask is not None or pad:
            real = F.pad(real_key_mask(mask, q), (0, pad)).view(b, 1, blocks, size).expand(b, h, blocks, size)
            block_ok = real.reshape(b * h * blocks, size)
        q_rows = q.reshape(b * h * n, d)
        if native and per_query > 1 and takes(q):
            # the C kernel reads each part's query row in place and folds the merge's backward into
            # its own (ops/grouped/merged_cpu.py). A padded query takes no block: its output is 0 (the
            # contract's padded rows) and its pairs cost nothing
            if mask is not None:
                query_ok = mask.repeat_interleave(h, dim=0)  # [B*H, N]
                expert = torch.where(query_ok, expert, b * h * blocks)
            out = merged_attention_cpu(q_rows, expert.flatten(), block_k, block_v, block_ok, 1 / math.sqrt(d))
            return out.view(b, h, n, d)
        out, lse = grouped_attention(
            q_rows.repeat(per_query, 1) if per_query > 1 else q_rows,  # [topk' B*H*N, D]
            expert.flatten(),
            block_k,
            block_v,
            block_ok,
            1 / math.sqrt(d),
            per_query > 1,
        )
        if per_query > 1:
            # kernel "torch" keeps the PyTorch merge too
            out = (merge_cpu if native else merge)(out.view(per_query, -1, d), lse.view(per_query, -1), slot_major=True)
        return out.view(b, h, n, d)
