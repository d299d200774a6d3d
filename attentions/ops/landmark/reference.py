"""MiTA's landmark pass and routing, the PyTorch forms (the reference of cpu.py's kernels).

Step 1 pools the queries into landmarks (masking.pool_real); steps 2-3 score every key against each
landmark and summarise the values under those scores (the shared expert); step 4 sends each query
to its best real landmark.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ...masking import pool_real


def landmark_scores(
    q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], landmarks: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 and the scores of step 2: landmarks [B, H, m, D], real landmarks [B, m] and each
    landmark's scaled key scores [B, H, m, N] (padded keys -inf)."""
    marks, real_marks = pool_real(q, mask, landmarks)
    # on the CPU k transposed into a contiguous [B, H, D, N] copy: a matmul against a transposed view
    # is ~5x slower there, and the backward's d k comes back through the copy; a GPU's matmul reads
    # the view as it is
    k_t = k.transpose(-1, -2) if k.is_cuda else k.transpose(-1, -2).contiguous()  # [B, H, D, N]
    scores = (marks / math.sqrt(q.shape[-1])) @ k_t  # [B, H, m, N]
    if mask is not None:
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    return marks, real_marks, scores


def landmark_pass(
    marks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shared values softmax(S) V [B, H, m, D] and the scores S = marks K^T [B, H, m, N] (-inf at
    padded keys), for landmarks ``marks`` [B, H, m, D] already scaled by 1 / sqrt(D)."""
    scores = marks @ k.transpose(-1, -2)  # [B, H, m, N]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return scores.softmax(dim=-1) @ v, scores


@torch.no_grad()
def route_best(q: torch.Tensor, marks: torch.Tensor, real_marks: Optional[torch.Tensor]) -> torch.Tensor:
    """Each query's best real landmark: argmax_j q . marks_j over the landmarks with real_marks (the
    first of equal values), -1 where a head has none. q [G, N, D], marks [G, m, D], real_marks [G, m]
    bool or None (all real) -> [G, N] long. Each score is one sum over d, in the same order for every
    landmark, so equal landmarks score equally (a GEMM may round its columns differently and break
    the tie either way)."""
    gate = (q[:, :, None, :] * marks[:, None, :, :]).sum(-1)  # [G, N, m]
    if real_marks is not None:
        gate.masked_fill_(~real_marks[:, None, :], float("-inf"))
    best = gate.argmax(dim=-1)  # [G, N]
    if real_marks is None:
        return best
    return torch.where(real_marks.any(-1, keepdim=True), best, -1)
