"""Full softmax attention (Vaswani et al. 2017, Attention Is All You Need).

Every query attends to every real key: softmax(Q K^T / sqrt(D)) V. Cost O(N^2 D) time; memory
O(N) with a fused kernel. The fast path is torch's scaled_dot_product_attention; on CUDA with
flash-attn installed and a padding mask present, the batch is unpadded into one packed sequence,
run through flash-attn's varlen kernel and repadded, so padded batches keep a flash kernel.
``flash=True`` (CUDA only) insists on a flash kernel: flash-attn when installed, else SDPA
restricted to its flash backend; it is the FlashAttention baseline of the throughput benchmark.
``reference`` below is the plain softmax the tests compare every path with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..base import Attention, AttentionError, Taxonomy, check_inputs
from ..registry import register

try:  # optional: pip install lra-suite[gpu]
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = flash_attn_varlen_func = None


@dataclass
class FullConfig:
    # False: torch's scaled_dot_product_attention (any device; flash-attn varlen for padded CUDA
    # batches when installed); True: a flash kernel or an error (CUDA only)
    flash: bool = False


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain softmax attention, the readable definition. [B, H, N, D] -> [B, H, N, D]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, N, N]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return scores.softmax(dim=-1) @ v


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unpad -> flash-attn varlen -> repad. [B, H, N, D] + mask [B, N] -> [B, H, N, D]."""
    b, h, n, d = q.shape
    lengths = mask.sum(dim=-1, dtype=torch.int32)  # [B]
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # [B+1]
    index = mask.flatten().nonzero(as_tuple=True)[0]  # [T] positions of real tokens

    def unpad(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * n, h, d)[index]  # [T, H, D]

    packed = flash_attn_varlen_func(
        unpad(q), unpad(k), unpad(v), cu_seqlens, cu_seqlens, int(lengths.max()), int(lengths.max())
    )  # [T, H, D]
    out = packed.new_zeros(b * n, h, d).index_copy(0, index, packed)  # [B*N, H, D]
    return out.reshape(b, n, h, d).transpose(1, 2)


@register("full")
class FullAttention(Attention):
    order = 0
    paper = "Vaswani et al. 2017, Attention Is All You Need"
    published_as = ("Transformer", "Standard", "Self-attention", "Full attention (FlashAttention)")
    Config = FullConfig
    cost = "O(N^2 D)"
    independent_queries = True
    taxonomy = Taxonomy(
        scaling="none",
        expert_count="1",
        expert_type="raw KV (all N keys)",
        construction="none: the whole context",
        routing="dense: every query to every key",
    )

    def budget(self) -> str:
        return "N"

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Tuple[float, float]:
        """Q K^T and P V: 4 N^2 D forward; the backward is twice the forward, so train = 3x forward."""
        forward = 4.0 * n * n * d
        return forward, 3.0 * forward

    @classmethod
    def implementation(cls, cfg: FullConfig, device: torch.device) -> str:
        if device.type != "cuda":
            return "sdpa-cpu"
        if cfg.flash:
            return "flash-attn" if flash_attn_func is not None else "sdpa-flash"
        return "sdpa"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        use_varlen = (
            mask is not None
            and flash_attn_varlen_func is not None
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
        )
        if use_varlen:
            return flash_varlen(q, k, v, mask)
        if self.cfg.flash:
            if mask is not None:
                raise AttentionError("full attention flash=True takes a padding mask only with flash-attn "
                                     "installed (pip install lra-suite[gpu]) and bf16/fp16 inputs; use flash=False")
            return self.attend(q, k, v)
        attn_mask = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, N]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, D] over k, v [B, H, N, D] -> [B, H, S, D] (S may differ from N), no mask."""
        if not self.cfg.flash:
            return F.scaled_dot_product_attention(q, k, v)
        if not q.is_cuda:
            raise AttentionError("full attention flash=True runs on CUDA only; use flash=False on the CPU")
        if flash_attn_func is not None:
            # flash-attn takes [B, N, H, D]; the transposed views keep the last dim contiguous
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
