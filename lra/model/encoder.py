"""The LRA encoder: token + position embeddings (learned or sinusoidal), pre-LayerNorm blocks, pooling,
a classifier head (or, for a token-level task, no pooling and the head applied at every position).

The attention in each block is built from the ``attentions`` registry; the Q/K/V and output
projections live here, once, so every backend gets the same parameters around it. Retrieval uses
the dual head: both documents are encoded by the same encoder and combined as [u, v, u*v, u-v]
(``model.head=lra``: as [u, v], through the LRA JAX code's two-hidden-layer classifier_head_dual).
The padding mask comes from each row's length, never from token ids (pixel 0 is real data).
Dropout, layer norm and the FFN's GELU with its dropout run on compiled kernels on the CPU
(lra/model/dropout.py, layer_norm.py, gelu_dropout.py): torch's dropout took a fifth of a step, its
layer norm 4-5 times one pass over the rows.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import math

import torch
import torch.nn.functional as F
from torch import nn

from attentions import build_attention

from ..config import ModelConfig
from .dropout import Dropout
from .gelu_dropout import gelu_dropout
from .layer_norm import LayerNorm
from .heads import split_heads


class Block(nn.Module):
    """x + Attn(LN(x)), then x + FFN(LN(x)). With ``cfg.gate`` the input projection also makes g
    and the block adds proj(Attn(...) * SiLU(g)), as the MiTA authors' gated attention
    (QishuaiWen/MiTA, MiTA-DeiT/mita/mita_attention_conv_gate.py: one Linear(dim, 4 dim) for q, k, v, g)."""

    def __init__(self, cfg: ModelConfig, attn: str, attn_options: Dict[str, Any], max_len: int) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.gate = cfg.gate
        # the attention width W (model.qkv_dim; 0 = the model's width)
        self.width = cfg.qkv_dim or cfg.dim
        self.norm1 = LayerNorm(cfg.dim)
        # [q | k | v] or, gated, [q | k | v | g], each W wide
        self.qkv = nn.Linear(cfg.dim, (4 if cfg.gate else 3) * self.width)
        self.attn = build_attention(
            attn, num_heads=cfg.num_heads, head_dim=self.width // cfg.num_heads, max_len=max_len, **attn_options
        )
        self.proj = nn.Linear(self.width, cfg.dim)
        self.drop = Dropout(cfg.dropout)
        self.norm2 = LayerNorm(cfg.dim)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim),
            nn.GELU(),
            Dropout(cfg.dropout),
            nn.Linear(cfg.ffn_dim, cfg.dim),
            Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, n, _ = x.shape
        w = self.width
        views = self.qkv(self.norm1(x))  # [B, N, 3W], or [B, N, 4W] gated
        qkv = views[..., : 3 * w] if self.gate else views
        q, k, v = split_heads(qkv, self.heads)  # 3 x [B, H, N, D], contiguous
        mixed = self.attn(q, k, v, mask=mask).transpose(1, 2).reshape(b, n, w)  # [B, N, W]
        if self.gate:
            # position-wise: a padded position's g reaches no other position
            mixed = mixed * F.silu(views[..., 3 * w:])
        x = x + self.drop(self.proj(mixed))
        # self.ffn's steps, its GELU and the dropout after it in one pass (gelu_dropout: one kernel on
        # the CPU, the same draws and mask as the two modules)
        first, _, drop, second, last_drop = self.ffn
        return x + last_drop(second(gelu_dropout(first(self.norm2(x)), drop.p, drop.training)))


class Encoder(nn.Module):
    """Tokens [B, L] (or [B, L, S], S tokens summed at each position) and lengths [B] -> pooled features
    [B, C], or every position's [B, L, C] when ``per_position``."""

    def __init__(
        self, cfg: ModelConfig, attn: str, attn_options: Dict[str, Any], vocab_size: int, max_len: int, padded: bool,
        per_position: bool = False,
    ) -> None:
        super().__init__()
        self.pooling = cfg.pooling
        self.per_position = per_position
        self.padded = padded
        seq_len = max_len + (1 if cfg.pooling == "cls" else 0)
        self.tokens = nn.Embedding(vocab_size, cfg.dim)
        if cfg.positions == "sinusoidal":
            self.positions = None
            self.register_buffer("sinusoid", sinusoid(seq_len, cfg.dim), persistent=False)
        else:
            self.positions = nn.Embedding(seq_len, cfg.dim)
        nn.init.normal_(self.tokens.weight, std=0.02)
        if self.positions is not None:
            nn.init.normal_(self.positions.weight, std=0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.pooling == "cls" else None
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, attn, attn_options, seq_len) for _ in range(cfg.num_layers))
        self.norm = LayerNorm(cfg.dim)

    def forward(self, tokens: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.tokens(tokens.long())  # [B, L, C]
        if tokens.dim() == 3:
            # several tokens at each position (tokens [B, L, S]): their embeddings summed
            x = x.sum(dim=2)  # [B, L, C]
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)  # [B, 1+L, C]
            lengths = None if lengths is None else lengths + 1
        b, n, _ = x.shape
        table = self.sinusoid if self.positions is None else self.positions.weight  # [max_len, C]
        x = self.drop(x + table[:n])
        mask = None
        if self.padded and lengths is not None:
            mask = torch.arange(n, device=x.device)[None, :] < lengths[:, None]  # [B, N]
            # a batch of full rows needs no mask: the backends take their unmasked fast paths (under
            # torch.compile the mask stays, same results: reading it on the host would split the graph)
            if not torch.compiler.is_compiling() and bool(mask.all()):
                mask = None
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.per_position:
            # the sequence's own positions; a cls token, when there is one, is dropped
            return x[:, n - tokens.shape[1]:]  # [B, L, C]
        if self.cls is not None:
            return x[:, 0]
        if mask is None:
            return x.mean(dim=1)
        weights = mask.to(x.dtype)[..., None]  # [B, N, 1]
        return (x * weights).sum(dim=1) / weights.sum(dim=1)


def sinusoid(length: int, dim: int) -> torch.Tensor:
    """The fixed position table [length, dim] of the LRA JAX code (common_layers.sinusoidal_init):
    even columns sin(p / 10000^(2i/dim)), odd columns cos of the same angle."""
    position = torch.arange(length, dtype=torch.float64)[:, None]  # [L, 1]
    rate = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * -(math.log(10000.0) / dim))  # [ceil(dim/2)]
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate[: dim // 2])
    return table.float()


class LRAModel(nn.Module):
    """Single-sequence classifier, the dual (Retrieval) classifier when ``dual``, or a per-position
    classifier when ``token_level``.

    Single: tokens [B, L], lengths [B] -> logits [B, classes].
    Dual:   tokens [B, 2, L], lengths [B, 2] -> logits [B, classes].
    Token:  tokens [B, L] or [B, L, S], lengths [B] -> logits [B, L, classes].
    """

    def __init__(
        self,
        cfg: ModelConfig,
        attn: str,
        attn_options: Dict[str, Any],
        vocab_size: int,
        num_classes: int,
        max_len: int,
        dual: bool = False,
        padded: bool = True,
        token_level: bool = False,
    ) -> None:
        super().__init__()
        self.dual = dual
        # the LRA JAX dual head (common_layers.classifier_head_dual, interaction None): [u, v], two hidden layers
        self.concat = dual and cfg.head == "lra"
        self.encoder = Encoder(cfg, attn, attn_options, vocab_size, max_len, padded, per_position=token_level)
        if self.concat:
            half = max(1, cfg.ffn_dim // 2)
            self.head = nn.Sequential(nn.Linear(2 * cfg.dim, cfg.ffn_dim), nn.ReLU(), nn.Linear(cfg.ffn_dim, half),
                                      nn.ReLU(), nn.Linear(half, num_classes))
        else:
            features = 4 * cfg.dim if dual else cfg.dim
            self.head = nn.Sequential(nn.Linear(features, cfg.ffn_dim), nn.ReLU(), nn.Linear(cfg.ffn_dim, num_classes))

    def forward(self, tokens: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.dual:
            return self.head(self.encoder(tokens, lengths))
        b = tokens.shape[0]
        # encode both documents in one pass: [2B, L]
        both = self.encoder(tokens.flatten(0, 1), None if lengths is None else lengths.flatten())
        u, v = both.view(b, 2, -1).unbind(dim=1)  # [B, C] each
        if self.concat:
            return self.head(torch.cat([u, v], dim=-1))
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))
