"""MiTA (Wen et al. 2026, Mixture-of-Top-k Attention: Efficient Attention via Scalable Fast Weights).

The queries are average-pooled into m landmarks. Landmark j builds routed expert j from the k keys
it scores highest; a shared expert compresses all values onto the landmarks (softmax(L K^T) V).
Each query goes to the expert of its best landmark and takes one softmax over the m landmark
logits (scaled by 1/D, as in the authors' code) and its expert's k key logits (scaled by 1/sqrt(D)).
At the defaults (m = 64, k = 64) one query attends to m + k = 128 keys. Cost O((m + k) N D) time
and O((m + k) N) memory: building the experts is O(m N D), each query then costs O((m + k) D).

experts_per_query = E > 1 follows the authors' variant: each query goes to its E best landmarks
(top-E of q . L_j) and each expert keeps k // E keys, all in one softmax with the m landmark logits;
a key in two of a query's experts counts twice. shared_expert = False drops the landmark logits.
The fast path groups queries by expert (ops/grouped; on the CPU the C kernel, which reads the expert
keys by index, and for the default form the whole layer as one operator on the C kernels,
ops/landmark/mita_layer_cpu.py); ``reference`` is the plain form.

dwc = True is the paper's "MiTA + DWC" configuration (its ImageNet-1K enhancement; the authors'
QishuaiWen/MiTA ``MiTA-DeiT/mita/mita_attention_conv.py``): a depth-wise convolution of the values,
one learned kernel and bias per channel of the H * D value channels, added to the attention output
(before the model's output projection). The authors convolve 3 x 3 over the image grid; here the
convolution runs along the sequence (1-D, kernel ``dwc_kernel``) or, with ``dwc_grid`` = s, 2-D over
the s x s grid (a leading token beyond s * s, a cls token, is left out of it, as the authors leave
out DeiT's class token). Padded values are zeroed before the convolution, so padding never reaches
a real position. Off (the default) adds no parameter and leaves every output as base MiTA's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..ops import landmark
from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..masking import pool_real, real_key_mask
from ..ops import tuning
from ..ops.grouped import check_kernel, gather_rows, kernel_name, merge, pick_grouped
from ..ops.grouped.cpu import grouped_attention_cpu, merge_cpu
from ..ops.landmark import landmark_scores
from ..ops.landmark.cpu import landmark_pass, pool_queries, route_best
from ..ops.landmark import mita_layer_cpu
from ..ops.landmark.mita_layer_cpu import MiTACPU
from ..ops.topk_selection import topk_unsorted
from ..registry import register

# the default form on the CPU kernels as one operator (ops/landmark/mita_layer_cpu.py); off: the
# composed path of the same kernels (the tests compare the two)
FUSED_CPU = True


@dataclass
class MiTAConfig:
    # m: landmarks, i.e. routed experts (and the shared expert's compressed keys)
    landmarks: int = 64
    # k: keys per routed expert (split evenly over a query's experts when experts_per_query > 1)
    topk: int = 64
    # add the landmark-compressed shared expert to every query's softmax
    shared_expert: bool = True
    # E: routed experts per query; each keeps topk // E keys
    experts_per_query: int = 1
    # grouped attention kernels: "torch", "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "cpu"
    # (the C kernel, float32 on the CPU), or "auto" (Triton on CUDA when installed, as validated and
    # timed on an H200; the C kernel on the CPU where it builds; PyTorch otherwise)
    kernel: str = "auto"
    # add a depth-wise convolution of the values to the output (the paper's MiTA + DWC); off is base MiTA
    dwc: bool = False
    # the convolution's width along each axis (odd; the authors' 3, a 3 x 3 kernel on the image grid)
    dwc_kernel: int = 3
    # 0: 1-D along the sequence; s > 0: 2-D over an s x s grid (N = s * s, or s * s + 1 with a leading
    # cls token that the convolution leaves out)
    dwc_grid: int = 0


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    landmarks: int = 64,
    topk: int = 64,
    shared_expert: bool = True,
    experts_per_query: int = 1,
) -> torch.Tensor:
    """MiTA in five plain steps, every query gathering its own copy of its experts. [B, H, N, D]."""
    b, h, n, d = q.shape
    real_keys = real_key_mask(mask, q)[:, None, None, :]  # [B, 1, 1, N]
    keys = min(topk // experts_per_query, n)
    # 1. landmarks: q pooled over each sequence's real tokens
    marks, real_marks = pool_real(q, mask, landmarks)  # [B, H, m, D], [B, m]
    # 2. routed experts: the top keys of each landmark (padded keys never chosen)
    scores = ((marks / math.sqrt(d)) @ k.transpose(-1, -2)).masked_fill(~real_keys, float("-inf"))  # [B, H, m, N]
    top, index = scores.topk(keys, dim=-1)  # [B, H, m, keys]
    # 3. shared expert: every landmark's softmax summary of the values
    shared_values = scores.softmax(dim=-1) @ v  # [B, H, m, D]
    # 4. routing: each query to its E best real landmarks
    gate = (q @ marks.transpose(-1, -2)).masked_fill(~real_marks[:, None, None, :], float("-inf"))
    choice = gate.topk(experts_per_query, dim=-1).indices  # [B, H, N, E]
    # 5. one softmax over the landmark logits and the chosen experts' key logits
    flat = choice.flatten(2)[..., None].expand(-1, -1, -1, keys)  # [B, H, N*E, keys]
    key_index = index.gather(2, flat).view(b, h, n, -1)  # [B, H, N, E*keys]
    key_ok = torch.isfinite(top).gather(2, flat).view(b, h, n, experts_per_query, keys)
    key_ok = key_ok & torch.isfinite(gate.gather(-1, choice))[..., None]
    picked = key_index.flatten(2)[..., None].expand(-1, -1, -1, d)  # [B, H, N*E*keys, D]
    expert_k = k.gather(2, picked).view(b, h, n, -1, d)  # [B, H, N, E*keys, D]
    expert_v = v.gather(2, picked).view(b, h, n, -1, d)
    routed = (q[..., None, :] * expert_k).sum(-1) / math.sqrt(d)  # [B, H, N, E*keys]
    routed = routed.masked_fill(~key_ok.flatten(-2), float("-inf"))
    if not shared_expert:
        return (routed.softmax(dim=-1)[..., None] * expert_v).sum(-2)
    weights = torch.cat([gate / d, routed], dim=-1).softmax(dim=-1)  # [B, H, N, m + E*keys]
    return weights[..., :landmarks] @ shared_values + (weights[..., landmarks:, None] * expert_v).sum(-2)


def top_keys(scores: torch.Tensor, keys: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The choice of step 2: each landmark's ``keys`` best keys [B, H, m, keys] (in no order) and
    which of them are real keys (a padded key scores -inf; one comparison, where isfinite is four
    kernels on the CPU)."""
    top, index = topk_unsorted(scores.detach(), keys)  # [B, H, m, keys]
    return index, top > float("-inf")


def build_experts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], landmarks: int, keys: int,
    native: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3: landmarks [B, H, m, D], real landmarks [B, m], each landmark's key index
    [B, H, m, keys] and which of those are real keys [B, H, m, keys], shared values [B, H, m, D].
    native: the landmarks, scores and shared values from the C kernels (ops/landmark) where they
    take the inputs (float32 on the CPU), instead of the PyTorch pooling matrix, matmuls and softmax."""
    if native and landmark.takes(q):
        marks, real_marks = pool_queries(q, mask, landmarks)
        shared_values, scores = landmark_pass(marks / math.sqrt(q.shape[-1]), k, v, mask)
    else:
        marks, real_marks, scores = landmark_scores(q, k, mask, landmarks)
        shared_values = scores.softmax(dim=-1) @ v  # [B, H, m, D]
    index, key_ok = top_keys(scores, keys)
    return marks, real_marks, index, key_ok, shared_values


def route(
    q: torch.Tensor, marks: torch.Tensor, real_marks: torch.Tensor, per_query: int, native: bool = False,
    all_real: bool = False,
) -> torch.Tensor:
    """Step 4: each query's E best real landmarks, as expert numbers over (batch, head, landmark).

    q: [B, H, N, D], marks: [B, H, m, D], real_marks: [B*H, m] -> [B*H, N, E]; a choice that falls
    on a missing landmark (a sequence shorter than E) becomes B*H*m, meaning no expert.
    native: one expert per query from the C kernel (ops/landmark/cpu.route_best) where it takes the inputs.
    all_real: the caller knows every landmark is real (no mask, N >= m): no masking of the scores.
    """
    b, h, n, d = q.shape
    m = marks.shape[2]
    heads = torch.arange(b * h, device=q.device)[:, None, None] * m
    if native and per_query == 1 and landmark.takes(q):
        best = route_best(q.reshape(b * h, n, d), marks.reshape(b * h, m, d), real_marks)[..., None]  # [B*H, N, 1]
        return torch.where(best >= 0, best + heads, b * h * m)
    missing = None
    if not all_real:
        missing = torch.zeros(real_marks.shape, dtype=q.dtype, device=q.device).masked_fill(~real_marks, float("-inf"))
    # the result is made whole before the loop (as in MoBA's gate): small per-chunk results kept
    # between score-sized temporaries fragment the heap
    choice = torch.empty(b, h, n, per_query, dtype=torch.long, device=q.device)
    with torch.no_grad():
        # a chunk of queries at a time: the [B, H, chunk, m] scores stay small
        chunk = tuning.chunk_rows(tuning.ROUTE_ELEMENTS, b * h * m, q.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            gate = q[:, :, rows] @ marks.transpose(-1, -2)  # [B, H, chunk, m]
            if missing is not None:
                gate += missing.view(b, h, 1, m)
            if per_query == 1:
                choice[:, :, rows] = gate.argmax(dim=-1, keepdim=True)
            else:
                choice[:, :, rows] = gate.topk(per_query, dim=-1).indices
            del gate
    choice = choice.view(b * h, n, per_query)
    expert = choice + heads
    if all_real:
        return expert
    real = real_marks.gather(1, choice.flatten(1)).view_as(choice)
    return torch.where(real, expert, b * h * m)


@register("mita")
class MiTAAttention(Attention):
    order = 6
    paper = "Wen et al. 2026, Mixture-of-Top-k Attention: Efficient Attention via Scalable Fast Weights"
    published_as = ("MiTA",)
    Config = MiTAConfig
    cost = "O((m + k) N D)"
    whole_sequence = {"landmarks": "one landmark per token"}
    taxonomy = Taxonomy(
        scaling="both",
        expert_count="m routed + 1 shared",
        expert_type="routed: top-k raw KV; shared: landmark-compressed KV",
        construction="top-k keys per landmark query (content-based, reusable)",
        routing="per-query argmax over landmarks (1 expert)",
    )

    def __init__(self, dims: AttnDims, cfg: MiTAConfig) -> None:
        super().__init__(dims, cfg)
        for name in ("landmarks", "topk", "experts_per_query"):
            if getattr(cfg, name) < 1:
                raise AttentionError(f"mita {name} must be a positive integer, got {getattr(cfg, name)}")
        if cfg.experts_per_query > cfg.landmarks or cfg.topk < cfg.experts_per_query:
            raise AttentionError(
                f"mita experts_per_query={cfg.experts_per_query} must be at most landmarks={cfg.landmarks} "
                f"and at most topk={cfg.topk} (each expert keeps topk // experts_per_query keys)"
            )
        check_kernel(cfg.kernel, "mita")
        self.dwc = None
        if cfg.dwc:
            if cfg.dwc_kernel < 1 or cfg.dwc_kernel % 2 == 0:
                raise AttentionError(
                    f"mita dwc_kernel must be a positive odd integer (same-length output); got {cfg.dwc_kernel}"
                )
            if cfg.dwc_grid < 0:
                raise AttentionError(
                    f"mita dwc_grid must be 0 (1-D along the sequence) or the grid side s > 0; got {cfg.dwc_grid}"
                )
            channels = dims.num_heads * dims.head_dim
            conv = nn.Conv2d if cfg.dwc_grid else nn.Conv1d
            # groups = channels: one kernel and bias per value channel, as the authors' nn.Conv2d(dim, dim, groups=dim)
            self.dwc = conv(channels, channels, cfg.dwc_kernel, padding=cfg.dwc_kernel // 2, groups=channels)

    @classmethod
    def implementation(cls, cfg: MiTAConfig, device: torch.device) -> str:
        return f"attentions.mita ({kernel_name(cfg.kernel, device)} kernel)"

    @classmethod
    def flops(cls, cfg: MiTAConfig, n: int, d: int) -> Tuple[float, float]:
        """m landmarks, k routed keys per query, shared expert on (per head, length n, head dim d):
        landmark scores L K^T 2 m N D (under no_grad: no backward); shared expert softmax(L K^T) V
        4 m N D; per query the gate q L^T 2 N m D, routed logits 2 N k D and the mixing of the m shared
        and k routed values 2 N (m + k) D: together 4 N (m + k) D; with dwc, the convolution 2 N D taps
        (taps = dwc_kernel, squared on a grid). Train = forward + 2x (forward - scores)."""
        m = min(cfg.landmarks, n)
        k = min(cfg.experts_per_query * (cfg.topk // cfg.experts_per_query), n)
        scores = 2.0 * m * n * d
        forward = scores + 4.0 * m * n * d + 4.0 * n * (m + k) * d
        if cfg.dwc:
            forward += 2.0 * n * d * cfg.dwc_kernel ** (2 if cfg.dwc_grid else 1)
        return forward, forward + 2.0 * (forward - scores)

    def budget(self) -> str:
        cfg = self.cfg
        routed = cfg.experts_per_query * (cfg.topk // cfg.experts_per_query)
        if not cfg.shared_expert:
            return f"k = {routed}"
        return f"m + k = {cfg.landmarks + routed}"

    @torch.no_grad()
    def selected_keys(
        self, q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The keys each landmark selects into its routed expert, as the forward selects them (steps
        1-3, the same function and kernels; the shared values are dropped): key positions
        [B, H, m, keys] (in no order) and which selections are real [B, H, m, keys] (a real key
        chosen by a real landmark; a sequence with fewer real tokens than m or k leaves the rest
        False). keys = min(topk // experts_per_query, N)."""
        check_inputs(q, k, k, mask)
        keys = min(self.cfg.topk // self.cfg.experts_per_query, q.shape[2])
        native = pick_grouped(self.cfg.kernel, q.device) is grouped_attention_cpu
        _, real_marks, index, key_ok, _ = build_experts(q, k, k, mask, self.cfg.landmarks, keys, native)
        return index, key_ok & real_marks[:, None, :, None]

    def depthwise(self, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The DWC term: the depth-wise convolution of the values (padded ones zeroed), [B, H, N, D]."""
        b, h, n, d = v.shape
        if mask is not None:
            v = v.masked_fill(~mask[:, None, :, None], 0.0)
        x = v.permute(0, 1, 3, 2).reshape(b, h * d, n)  # [B, H*D, N], channel h*D + d
        side = self.cfg.dwc_grid
        if not side:
            y = self.dwc(x)  # [B, H*D, N]
        else:
            skip = n - side * side
            if skip not in (0, 1):
                raise AttentionError(
                    f"mita dwc_grid={side} lays the values on a {side} x {side} grid: N must be {side * side} "
                    f"(or {side * side + 1} with a cls token); got N={n}"
                )
            grid = self.dwc(x[..., skip:].reshape(b, h * d, side, side))  # [B, H*D, s, s]
            y = F.pad(grid.reshape(b, h * d, side * side), (skip, 0))  # the cls token gets no term
        return y.view(b, h, d, n).transpose(-1, -2)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        out = self.mix(q, k, v, mask)
        if self.dwc is None:
            return out
        return out + self.depthwise(v, mask)

    def mix(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Steps 1-5 on the kernels (base MiTA's output). [B, H, N, D]"""
        split = tuning.in_batch_chunks(self.mix, q, k, v, mask)
        if split is not None:
            return split
        cfg = self.cfg
        b, h, n, d = q.shape
        m, per_query = cfg.landmarks, cfg.experts_per_query
        # one copy each of inputs that arrive as strided views (the model's q, k, v), not one per step
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        keys = min(cfg.topk // per_query, n)
        grouped_attention = pick_grouped(cfg.kernel, q.device)
        # the C kernels on the CPU: the landmark pass and routing as well as the grouped attention
        native = grouped_attention is grouped_attention_cpu
        if (native and FUSED_CPU and per_query == 1 and cfg.shared_expert and landmark.takes(q)
                and not mita_layer_cpu.refusals(q)):
            return MiTACPU.apply(q, k, v, mask, m, keys, top_keys)
        marks, real_marks, index, key_ok, shared_values = build_experts(q, k, v, mask, m, keys, native)
        real_marks = real_marks.repeat_interleave(h, dim=0)  # [B*H, m]
        # every landmark real: no padding, and at least m tokens to pool
        all_real = mask is None and n >= m
        expert = route(q, marks, real_marks, per_query, native, all_real)  # [B*H, N, E]
        # step 5: routed experts [B*H*m, keys, D] read once from k and v; queries grouped by expert
        heads = torch.arange(b * h, device=q.device)[:, None]  # [B*H, 1]
        rows = (index.view(b * h, m * keys) + heads * n).view(b * h * m, keys)
        if grouped_attention is grouped_attention_cpu:
            # the C kernel reads the expert keys by index: no gathered tables; a head's m experts
            # share key rows, so its threads take whole heads
            grouped_attention = partial(grouped_attention_cpu, rows=rows, unit=m)
            expert_k, expert_v = k.reshape(b * h * n, d), v.reshape(b * h * n, d)
        else:
            expert_k = gather_rows(k.reshape(b * h * n, d), rows)
            expert_v = gather_rows(v.reshape(b * h * n, d), rows)
        # all-real masks are dropped for the PyTorch form on the CPU (where a check costs little, and a
        # graph break under torch.compile beside that form's own); the C kernel takes them as they are
        # (a mask only sets each key's bias); on CUDA they stay (a check would wait for the device)
        on_cpu = not q.is_cuda and not native
        expert_ok = None if mask is None or (on_cpu and bool(key_ok.all())) else key_ok.view(b * h * m, keys)
        shared = None
        if cfg.shared_expert:
            # the m landmarks join the keys of a query's first expert, pre-scaled so q . L gets 1/D
            ok = None if all_real or (on_cpu and bool(real_marks.all())) else real_marks
            shared = (marks.reshape(b * h, m, d) / math.sqrt(d), shared_values.reshape(b * h, m, d), ok, m)
        q_rows = q.reshape(b * h * n, d)
        scale = 1 / math.sqrt(d)
        first = expert[..., 0].flatten()
        out, lse = grouped_attention(q_rows, first, expert_k, expert_v, expert_ok, scale, per_query > 1, shared)
        if per_query == 1:
            return out.view(b, h, n, d)
        # further experts hold routed keys only; one softmax across all of a query's experts
        q_rest, rest_expert = q_rows.repeat_interleave(per_query - 1, dim=0), expert[..., 1:].flatten()
        rest, rest_lse = grouped_attention(q_rest, rest_expert, expert_k, expert_v, expert_ok, scale, True)
        out = (merge_cpu if native else merge)(
            torch.cat([out[:, None], rest.view(-1, per_query - 1, d)], dim=1),
            torch.cat([lse[:, None], rest_lse.view(-1, per_query - 1)], dim=1),
        )
        return out.view(b, h, n, d)
