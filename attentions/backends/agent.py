"""Agent attention (Han et al. 2024, Agent Attention: On the Integration of Softmax and Linear Attention).

n agent tokens A, the adaptive average pool of the queries over each sequence's real tokens, first
gather the values (V_a = softmax(A K^T / sqrt(D)) V), then every query reads the agents
(softmax(Q A^T / sqrt(D)) V_a). Cost O(N n D); one query attends to n agents (n = 128 by default).
No agent bias and no depthwise convolution by default, as the MiTA paper compares it; ``dwc`` adds
the paper's depthwise convolution on V, here 1-D over the sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import pool_real
from ..registry import register


@dataclass
class AgentConfig:
    # n: agent tokens pooled from the queries (a shorter sequence gets one per real token)
    agents: int = 128
    # add a depthwise 1-D convolution of V over the sequence to the output
    dwc: bool = False
    # kernel size of that convolution (odd, so it is centred)
    dwc_kernel: int = 3


@register("agent")
class AgentAttention(Attention):
    order = 5
    paper = "Han et al. 2024, Agent Attention: On the Integration of Softmax and Linear Attention"
    Config = AgentConfig
    cost = "O(N n D)"
    whole_sequence = {"agents": "one agent per token"}
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1 (n agent tokens)",
        expert_type="query-pooled compressed KV",
        construction="agent tokens attend to all keys",
        routing="dense over agents",
    )

    def __init__(self, dims: AttnDims, cfg: AgentConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.agents < 1:
            raise AttentionError(f"agent attention needs agents >= 1; got {cfg.agents}")
        if cfg.dwc_kernel < 1 or cfg.dwc_kernel % 2 == 0:
            raise AttentionError(f"agent dwc_kernel must be an odd size >= 1; got {cfg.dwc_kernel}")
        self.dwc: Optional[nn.Conv1d] = None
        if cfg.dwc:
            channels = dims.num_heads * dims.head_dim
            # one filter per head-channel (depthwise), zero-padded to keep the length
            self.dwc = nn.Conv1d(channels, channels, cfg.dwc_kernel, padding=cfg.dwc_kernel // 2, groups=channels)

    def budget(self) -> str:
        return f"n = {self.cfg.agents} agents"

    def depthwise_conv(self, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The convolution term on V [B, H, N, D]; padded values are zeroed so real rows never see them."""
        assert self.dwc is not None
        b, h, n, d = v.shape
        if mask is not None:
            # a zeroed pad reads like the conv's own zero padding past the end of a lone sequence
            v = v.masked_fill(~mask[:, None, :, None], 0.0)
        channels = v.permute(0, 1, 3, 2).reshape(b, h * d, n)  # [B, H*D, N]
        out = self.dwc(channels)  # [B, H*D, N]
        return out.reshape(b, h, d, n).permute(0, 1, 3, 2)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        # agents pooled over each sequence's real queries; short sequences mask the spare bins
        agents, agent_mask = pool_real(q, mask, self.cfg.agents)  # [B, H, n, D], [B, n]
        key_mask = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, N]
        agent_v = scaled_dot_product_attention(agents, k, v, attn_mask=key_mask)  # [B, H, n, D]
        real_agents = agent_mask[:, None, None, :]  # [B, 1, 1, n]
        out = scaled_dot_product_attention(q, agents, agent_v, attn_mask=real_agents)  # [B, H, N, D]
        if self.dwc is not None:
            out = out + self.depthwise_conv(v, mask)
        return out
