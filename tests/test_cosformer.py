"""cosFormer against the paper's quadratic form and the authors' computation, outputs and gradients;
its positions over a row's real tokens; a hand-worked re-weighting."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from attentions import AttentionError, build_attention
from attentions.backends.cosformer import reference

B, H, N, D = 2, 2, 64, 16
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
MASKED = [pytest.param(False, id="full"), pytest.param(True, id="masked")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int, dtype: torch.dtype, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` (over the real ``rows`` [B, N] if given)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if rows is not None:
        weight = weight * rows[:, None, :, None]
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def authors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """OpenNLPLab/cosFormer cosformer.py's non-causal forward after its projections and ReLU, restated:
    index pi/2 * (1..M), M = max(source, target length), [x sin(index / M), x cos(index / M)], right product."""
    bh = q.shape[0] * q.shape[1]
    q, k, v = F.relu(q).reshape(bh, -1, D), F.relu(k).reshape(bh, -1, D), v.reshape(bh, -1, D)
    tgt_len, src_len = q.shape[1], k.shape[1]
    m = max(src_len, tgt_len)
    index = math.pi / 2 * torch.arange(1, m + 1, dtype=q.dtype).reshape(1, -1, 1)
    q_ = torch.cat([q * torch.sin(index[:, :tgt_len] / m), q * torch.cos(index[:, :tgt_len] / m)], dim=-1)
    k_ = torch.cat([k * torch.sin(index[:, :src_len] / m), k * torch.cos(index[:, :src_len] / m)], dim=-1)
    kv_ = torch.einsum("nld,nlm->ndm", k_, v)
    z_ = 1 / torch.clamp_min(torch.einsum("nld,nd->nl", q_, torch.sum(k_, dim=1)), eps)
    out = torch.einsum("nld,ndm,nl->nlm", q_, kv_, z_)
    return out.reshape(B, H, tgt_len, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", MASKED)
def test_matches_the_papers_quadratic_form(masked: bool, dtype: torch.dtype) -> None:
    attn = build_attention("cosformer", num_heads=H, head_dim=D, max_len=N)
    q, k, v = make_qkv(N, dtype)
    mask = make_mask(N, [N, 29]) if masked else None
    out = attn(q, k, v, mask)
    ref = reference(q, k, v, mask)
    rows = mask if masked else None
    for i, (got, want) in enumerate(zip([out] + grads(out, [q, k, v], rows), [ref] + grads(ref, [q, k, v], rows))):
        assert rel_err(got, want) < TOL[dtype], f"tensor {i}: relative error {rel_err(got, want):.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_authors_computation(dtype: torch.dtype) -> None:
    attn = build_attention("cosformer", num_heads=H, head_dim=D, max_len=N)
    q, k, v = make_qkv(N, dtype)
    out, ref = attn(q, k, v), authors(q, k, v)
    for i, (got, want) in enumerate(zip([out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v]))):
        assert rel_err(got, want) < TOL[dtype], f"tensor {i}: relative error {rel_err(got, want):.2e}"


def test_a_padded_row_is_the_authors_computation_on_its_real_tokens() -> None:
    """Positions count a row's real tokens and M is its real length: the padded row equals the authors'
    module run on the 29 real tokens, and M = N (padding counted) would give another answer."""
    attn = build_attention("cosformer", num_heads=H, head_dim=D, max_len=N).double()
    q, k, v = make_qkv(N, torch.float64)
    out = attn(q, k, v, make_mask(N, [N, 29]))
    alone = authors(q[:, :, :29], k[:, :, :29], v[:, :, :29])
    assert rel_err(out[1, :, :29], alone[1]) < 1e-10
    assert rel_err(out[0], authors(q, k, v)[0]) < 1e-10
    # padded keys zeroed (ReLU(0) = 0 adds nothing) but M = 64
    zeroed = torch.cat([k[:, :, :29], torch.zeros_like(k[:, :, 29:])], dim=2)
    counted = reference(q, zeroed, v, None)[1, :, :29]
    assert rel_err(counted, alone[1]) > 1e-3


def test_the_reweighting_worked_by_hand() -> None:
    """N = 2, one feature of 1 everywhere: a_i = pi/2 * i / 2, so cos(a_1 - a_2) = cos(pi/4); query 1's
    weights are (1, cos(pi/4)) / (1 + cos(pi/4)), read out by values (1, 0)."""
    attn = build_attention("cosformer", num_heads=1, head_dim=1, max_len=2).double()
    ones = torch.ones(1, 1, 2, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 2, 1)
    c = math.cos(math.pi / 4)
    want = torch.tensor([1 / (1 + c), c / (1 + c)], dtype=torch.float64)
    torch.testing.assert_close(attn(ones, ones, v)[0, 0, :, 0], want, rtol=1e-12, atol=0)


def test_queries_without_positive_features_give_zero_not_nan() -> None:
    attn = build_attention("cosformer", num_heads=H, head_dim=D, max_len=N)
    q, k, v = (x.detach() for x in make_qkv(N, torch.float32))
    out = attn(-q.abs(), k, v)  # ReLU(q) = 0: the normaliser is clamped to eps
    assert out.isfinite().all() and float(out.abs().max()) == 0.0


def test_flops_and_budget() -> None:
    attn = build_attention("cosformer", num_heads=H, head_dim=D, max_len=N)
    assert attn.budget().startswith("N ") and "32 x 16" in attn.budget()
    forward, train = attn.flops(attn.cfg, 1024, 32)
    assert forward == 8 * 1024 * 32 * 32 + 8 * 1024 * 32 and train == 3 * forward


def test_rejects_a_non_positive_eps() -> None:
    with pytest.raises(AttentionError, match="eps"):
        build_attention("cosformer", num_heads=H, head_dim=D, max_len=N, eps=0.0)
