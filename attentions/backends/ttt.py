"""Test-Time Training layers (Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive
Hidden States): TTT-Linear and TTT-MLP.

The hidden state is the weights W of a small model f(x) = x + LN(g(x; W)), g linear (D x D) or a
2-layer MLP (4D hidden units, GELU), learned from an initial W0 as the sequence is read: mini-batch by
mini-batch of 16 tokens, W takes gradient steps on reconstructing each value from its key,
1/2 ||f(k_t) - v_t||^2, and query t reads f(q_t) with the weights the keys up to t have taught.
Each key's learning rate is a learned gate times the base rate, base_lr * sigmoid(theta . k_t + beta)
/ D; the gate reads the key (the authors read the layer's input x, which a backend does not see).
The dual form runs: on float32 CPU tensors the C kernel (attentions/ops/ttt/cpu.py, ``kernel: auto``),
else PyTorch (dual.py); the primal form (reference.py) is the reference.
Cost O(N D (D + 16)) for TTT-Linear, O(N 4D (D + 16)) per layer of TTT-MLP; state O(D^2) per head.
Causal: query t reads keys up to t only. ``bidirectional`` (the suite's extension, off by default)
averages a second scan over each sequence's real tokens in reverse, with its own learned pieces.

The authors' code (test-time-training/ttt-lm-pytorch ttt.py; ttt-lm-jax) and the paper: the code
scales the summed gradients at the t-th token of a mini-batch by 1/t plus a learned offset per place
(clamped at 0) and divides the learning rate by D; the paper writes a plain sum. The default follows
the code, which trained the paper's models; ``token_average: false`` gives the paper's sum. The code's
RoPE (positions modulo 16), output norm, gate and output projection are the model's, not the backend's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from ..base import Attention, AttentionError, AttnDims, Taxonomy, check_inputs
from ..ops.ttt import primal_form
from ..ops.ttt.dispatch import check_kernel, kernel_name, pick_dual
from ..registry import register

FORMS = ("dual", "primal")


@dataclass
class TTTLinearConfig:
    # tokens per inner gradient step (the authors' mini_batch_size)
    mini_batch: int = 16
    # the inner learning rate's base, times the learned gate, over D (ttt_base_lr)
    base_lr: float = 1.0
    # the authors' 1/t + learned offset on the summed gradients at a mini-batch's t-th token;
    # false: the paper's plain sum
    token_average: bool = True
    # the suite's extension: average with a scan of the real tokens in reverse (not causal)
    bidirectional: bool = False
    # "dual" (matmuls, the fast path) or "primal" (a weight copy per token, the reference)
    form: str = "dual"
    # the dual form's implementation: "auto" (the C kernel on float32 CPU tensors where it builds, else
    # PyTorch), "torch" (attentions/ops/ttt/dual.py) or "cpu" (the C kernel, csrc/ttt_cpu.c)
    kernel: str = "auto"
    # the inner layer norm's epsilon
    eps: float = 1e-6


@dataclass
class TTTMLPConfig(TTTLinearConfig):
    # ttt-lm-jax scripts/ttt_mlp/*.sh: ttt_base_lr=0.1
    base_lr: float = 0.1


class InnerLearner(nn.Module):
    """One scan's learned pieces: the initial weights W0 (W1, b1[, W2, b2]), the inner layer norm, the
    learning-rate gate and (``average``) the per-place offsets, initialised as the authors do."""

    def __init__(self, heads: int, dim: int, hidden: Optional[int], mini_batch: int, average: bool) -> None:
        super().__init__()
        self.mini_batch = mini_batch
        widths = [dim, dim] if hidden is None else [dim, hidden, dim]
        self.names = []
        for i, (a, b) in enumerate(zip(widths, widths[1:]), start=1):
            setattr(self, f"W{i}", nn.Parameter(torch.randn(heads, a, b) * 0.02))
            setattr(self, f"b{i}", nn.Parameter(torch.zeros(heads, 1, b)))
            self.names += [f"W{i}", f"b{i}"]
        self.ln_weight = nn.Parameter(torch.ones(heads, 1, dim))
        self.ln_bias = nn.Parameter(torch.zeros(heads, 1, dim))
        self.lr_weight = nn.Parameter(torch.randn(heads, dim) * 0.02)
        self.lr_bias = nn.Parameter(torch.zeros(heads))
        self.token_offset = nn.Parameter(torch.zeros(mini_batch)) if average else None

    def initial_state(self) -> Tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.names)

    def learning_rate(self, k: torch.Tensor, base_lr: float) -> torch.Tensor:
        """Each key's learning rate [B, H, N]: base_lr * sigmoid(theta_h . k_t + beta_h) / D."""
        gate = torch.einsum("bhnd,hd->bhn", k, self.lr_weight) + self.lr_bias[:, None]
        return base_lr * torch.sigmoid(gate) / k.shape[-1]

    def token_scale(self) -> torch.Tensor:
        """The factor [K] on the summed steps at each place of a mini-batch: 1 (the paper's sum), or the
        authors' 1/t + a learned offset, clamped at 0."""
        like = self.lr_bias
        if self.token_offset is None:
            return like.new_ones(self.mini_batch)
        places = torch.arange(1, self.mini_batch + 1, dtype=like.dtype, device=like.device)
        return torch.clamp_min(1.0 / places + self.token_offset, 0.0)


class TTTAttention(Attention):
    """TTT-Linear and TTT-MLP share everything but the inner model's hidden width."""

    paper = "Sun et al. 2024, Learning to (Learn at Test Time): RNNs with Expressive Hidden States"
    Config = TTTLinearConfig
    # the inner MLP's hidden width in multiples of D; None: the linear model
    hidden: Optional[int] = None

    def __init__(self, dims: AttnDims, cfg: TTTLinearConfig) -> None:
        super().__init__(dims, cfg)
        if cfg.mini_batch < 1:
            raise AttentionError(f"{self.name} mini_batch must be >= 1 (tokens per inner step); got {cfg.mini_batch}")
        if cfg.form not in FORMS:
            raise AttentionError(f"{self.name} form {cfg.form!r} is not one of {', '.join(FORMS)}")
        if not cfg.base_lr > 0 or not cfg.eps > 0:
            raise AttentionError(f"{self.name} base_lr and eps must be > 0; got {cfg.base_lr}, {cfg.eps}")
        check_kernel(cfg.kernel, self.name)
        d = dims.head_dim
        hidden = None if self.hidden is None else self.hidden * d
        scans = 2 if cfg.bidirectional else 1
        self.scans = nn.ModuleList(InnerLearner(dims.num_heads, d, hidden, cfg.mini_batch, cfg.token_average) for _ in range(scans))

    def budget(self) -> str:
        d = self.dims.head_dim
        model = f"a {d} x {d} linear model" if self.hidden is None else f"a 2-layer MLP, {self.hidden * d} hidden"
        keys = "every key" if self.cfg.bidirectional else "every earlier key"
        return f"N ({keys}, learned into {model})"

    @classmethod
    def implementation(cls, cfg: TTTLinearConfig, device: torch.device) -> str:
        if cfg.form == "primal":
            return f"attentions.{cls.name} (primal form)"
        return f"attentions.{cls.name} ({kernel_name(cfg.kernel, device)} kernel)"

    @classmethod
    def flops(cls, cfg: TTTLinearConfig, n: int, d: int) -> Optional[Tuple[float, float]]:
        # per token: the model on k and q, its update (2 D E each), and the read matrices (2 K D each)
        k = cfg.mini_batch
        per_token = 6.0 * d * d + 4.0 * k * d if cls.hidden is None else 56.0 * d * d + 20.0 * k * d
        forward = per_token * n * (2 if cfg.bidirectional else 1)
        return forward, 3.0 * forward

    def scan(self, learner: InnerLearner, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             order: Optional[torch.Tensor]) -> torch.Tensor:
        """TTT over the tokens taken in ``order`` [B, N] (None: as they are); outputs in place."""
        b, h, n, d = q.shape
        dtype = q.dtype
        if order is not None:
            index = order[:, None, :, None].expand(b, h, n, d)
            q, k, v = (x.gather(2, index) for x in (q, k, v))
        # the scan in float32 under autocast too: a recurrence over N / mini_batch steps whose layer-norm
        # backward divides by small standard deviations, which bf16 rounding blows up
        wide = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = (x.to(wide) for x in (q, k, v))
            form = primal_form if self.cfg.form == "primal" else pick_dual(self.cfg.kernel, q)
            out = form(
                q, k, v, learner.initial_state(), learner.ln_weight, learner.ln_bias,
                learner.learning_rate(k, self.cfg.base_lr), learner.token_scale(), self.cfg.eps,
            ).to(dtype)
        if order is None:
            return out
        return torch.empty_like(out).scatter(2, index, out)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        check_inputs(q, k, v, mask)
        b, _, n, _ = q.shape
        places = torch.arange(n, device=q.device).expand(b, n)  # [B, N]
        # real tokens first, in order (padding then sits at the end, where a causal scan never reads it)
        order = None if mask is None else torch.where(mask, places, places + n).argsort(dim=1)
        out = self.scan(self.scans[0], q, k, v, order)
        if self.cfg.bidirectional:
            real = torch.ones_like(places, dtype=torch.bool) if mask is None else mask
            # each sequence's real tokens last to first, then its padding
            backward = torch.where(real, -places, places + n).argsort(dim=1)
            out = 0.5 * (out + self.scan(self.scans[1], q, k, v, backward))
        if mask is not None:
            out = out.masked_fill(~mask[:, None, :, None], 0.0)
        return out


@register("ttt_linear")
class TTTLinearAttention(TTTAttention):
    order = 2.6
    published_as = ()
    cost = "O(N D^2)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="learned linear model (D x D) + LN, trained on the sequence",
        construction="gradient steps reconstructing v from k, mini-batches of 16",
        routing="dense over earlier tokens (causal)",
    )


@register("ttt_mlp")
class TTTMLPAttention(TTTAttention):
    order = 2.7
    published_as = ()
    Config = TTTMLPConfig
    hidden = 4
    cost = "O(4 N D^2)"
    taxonomy = Taxonomy(
        scaling="compression",
        expert_count="1",
        expert_type="learned 2-layer MLP (4D hidden, GELU) + LN, trained on the sequence",
        construction="gradient steps reconstructing v from k, mini-batches of 16",
        routing="dense over earlier tokens (causal)",
    )
