"""Linear, Linformer and Agent attention against plain references written here, outputs and gradients."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F

from attentions import AttentionError, build_attention

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


def grads(
    out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None
) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` (restricted to real ``rows`` [B, N] if given)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if rows is not None:
        weight = weight * rows[:, None, :, None]
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def assert_close(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert rel_err(out, ref) < TOL[dtype], f"tensor {i}: relative error {rel_err(out, ref):.2e}"


def phi(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1


def linear_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """Accumulate S and z one real key at a time (the RNN view), then read every query out."""
    state = q.new_zeros(B, H, D, D)
    norm = q.new_zeros(B, H, D)
    for j in range(q.shape[2]):
        real = mask[:, j, None, None].to(q.dtype)  # [B, 1, 1]
        phi_k = phi(k[:, :, j])  # [B, H, D]
        state = state + real[..., None] * phi_k[..., :, None] * v[:, :, j, None, :]
        norm = norm + real * phi_k
    numerator = torch.einsum("bhnd,bhde->bhne", phi(q), state)
    denominator = torch.einsum("bhnd,bhd->bhn", phi(q), norm)[..., None]
    return numerator / (denominator + eps)


def linear_quadratic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, eps: float
) -> torch.Tensor:
    """phi(Q) phi(K)^T with padded columns zeroed, rows normalised, times V."""
    scores = phi(q) @ phi(k).transpose(-1, -2) * mask[:, None, None, :]  # [B, H, N, N]
    return scores @ v / (scores.sum(dim=-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("reference", [linear_loop, linear_quadratic], ids=["loop", "quadratic"])
def test_linear_matches_references(reference, masked: bool, dtype: torch.dtype) -> None:
    attn = build_attention("linear", num_heads=H, head_dim=D, max_len=N)
    q, k, v = make_qkv(N, dtype)
    mask = make_mask(N, [N, 29] if masked else [N, N])
    out = attn(q, k, v, mask if masked else None)
    ref = reference(q, k, v, mask, attn.eps)
    assert_close([out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v]), dtype)


def test_linear_rejects_negative_eps() -> None:
    with pytest.raises(AttentionError, match="eps"):
        build_attention("linear", num_heads=H, head_dim=D, max_len=N, eps=-1.0)


def linformer_formula(
    attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """softmax(Q (E K)^T / sqrt(D)) (F V) with padded keys and values zeroed, written out with einsum."""
    n = q.shape[2]
    e = attn.E[:, :n]
    f = e if attn.F is None else attn.F[:, :n]
    real = mask[:, None, :, None].to(q.dtype)
    k_proj = torch.einsum("rn,bhnd->bhrd", e, k * real)  # [B, H, k, D]
    v_proj = torch.einsum("rn,bhnd->bhrd", f, v * real)  # [B, H, k, D]
    scores = torch.einsum("bhnd,bhrd->bhnr", q, k_proj) / math.sqrt(D)
    return scores.softmax(dim=-1) @ v_proj


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("share_kv", [False, True], ids=["EF", "shared"])
def test_linformer_matches_formula(share_kv: bool, dtype: torch.dtype) -> None:
    # N = 48 < max_len = 64: the leading 48 columns of E and F are used
    attn = build_attention("linformer", num_heads=H, head_dim=D, max_len=N, k=32, share_kv=share_kv).to(dtype)
    q, k, v = make_qkv(48, dtype)
    mask = make_mask(48, [48, 29])
    params = [p for p in (attn.E, attn.F) if p is not None]
    out = attn(q, k, v, mask)
    ref = linformer_formula(attn, q, k, v, mask)
    assert_close([out] + grads(out, [q, k, v, *params]), [ref] + grads(ref, [q, k, v, *params]), dtype)


def test_linformer_padded_equals_alone() -> None:
    attn = build_attention("linformer", num_heads=H, head_dim=D, max_len=N, k=32)
    q, k, v = make_qkv(48, torch.float32)
    out = attn(q, k, v, make_mask(48, [48, 29]))
    alone = attn(q[1:, :, :29], k[1:, :, :29], v[1:, :, :29])
    assert rel_err(out[1:, :, :29], alone) < 1e-5


@pytest.mark.parametrize("share_kv", [False, True], ids=["EF", "shared"])
def test_linformer_projections_are_per_instance_parameters(share_kv: bool) -> None:
    first, second = (
        build_attention("linformer", num_heads=H, head_dim=D, max_len=N, k=32, share_kv=share_kv) for _ in range(2)
    )
    names = sorted(name for name, _ in first.named_parameters())
    assert names == (["E"] if share_kv else ["E", "F"])
    assert sum(p.numel() for p in first.parameters()) == (1 if share_kv else 2) * 32 * N
    assert first.E.data_ptr() != second.E.data_ptr() and not torch.equal(first.E, second.E)
    # Xavier-uniform with gain 1/sqrt(2): bounded by, and reaching close to, the bound
    bound = math.sqrt(6 / (32 + N)) / math.sqrt(2)
    assert bound * 0.9 < float(first.E.detach().abs().max()) <= bound


def test_linformer_errors() -> None:
    with pytest.raises(AttentionError, match="k must be >= 1"):
        build_attention("linformer", num_heads=H, head_dim=D, max_len=N, k=0)
    attn = build_attention("linformer", num_heads=H, head_dim=D, max_len=32, k=8)
    q, k, v = make_qkv(N, torch.float32)
    with pytest.raises(AttentionError, match=r"max_len=32.*N=64"):
        attn(q, k, v)


def pool_bins(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Average [H, L, D] over torch's adaptive bins: bin j covers floor(jL/n) .. ceil((j+1)L/n) - 1."""
    length = x.shape[1]
    means = [x[:, (j * length) // bins : -((-(j + 1) * length) // bins)].mean(dim=1) for j in range(bins)]
    return torch.stack(means, dim=1)  # [H, bins, D]


def agent_reference(
    attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Each sequence alone at its real length; padded rows left at zero."""
    out = torch.zeros_like(q)
    for b, length in enumerate(lengths):
        qb, kb, vb = q[b, :, :length], k[b, :, :length], v[b, :, :length]  # [H, L, D]
        agents = pool_bins(qb, min(attn.cfg.agents, length))  # [H, n, D]
        agent_v = (agents @ kb.transpose(-1, -2) / math.sqrt(D)).softmax(dim=-1) @ vb  # [H, n, D]
        ob = (qb @ agents.transpose(-1, -2) / math.sqrt(D)).softmax(dim=-1) @ agent_v  # [H, L, D]
        if attn.dwc is not None:
            channels = vb.transpose(-1, -2).reshape(1, H * D, length)  # [1, H*D, L]
            conv = F.conv1d(channels, attn.dwc.weight, attn.dwc.bias, padding=attn.cfg.dwc_kernel // 2, groups=H * D)
            ob = ob + conv.reshape(H, D, length).transpose(-1, -2)
        out[b, :, :length] = ob
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize(
    "overrides",
    [{"agents": 8}, {"agents": 128}, {"agents": 8, "dwc": True}, {"agents": 8, "dwc": True, "dwc_kernel": 5}],
    ids=["n8", "n128-clamped", "n8-dwc3", "n8-dwc5"],
)
def test_agent_matches_reference(overrides: dict, masked: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = build_attention("agent", num_heads=H, head_dim=D, max_len=N, **overrides).to(dtype)
    q, k, v = make_qkv(N, dtype)
    lengths = [N, 29] if masked else [N, N]
    mask = make_mask(N, lengths)
    out = attn(q, k, v, mask if masked else None)
    ref = agent_reference(attn, q, k, v, lengths)
    assert bool(out.isfinite().all())
    # loss on real rows only: gradients at padded positions must be zero in the module as in the reference
    outs = [out * mask[:, None, :, None]] + grads(out, [q, k, v], mask)
    assert_close(outs, [ref] + grads(ref, [q, k, v], mask), dtype)


def test_agent_dwc_parameters() -> None:
    attn = build_attention("agent", num_heads=H, head_dim=D, max_len=N, dwc=True, dwc_kernel=5)
    assert sum(p.numel() for p in attn.parameters()) == H * D * 5 + H * D
    assert sum(p.numel() for p in build_attention("agent", num_heads=H, head_dim=D, max_len=N).parameters()) == 0


@pytest.mark.parametrize(
    "overrides, message",
    [({"agents": 0}, "agents >= 1"), ({"dwc_kernel": 2}, "odd"), ({"dwc_kernel": 0}, "odd")],
    ids=["agents0", "kernel-even", "kernel0"],
)
def test_agent_errors(overrides: dict, message: str) -> None:
    with pytest.raises(AttentionError, match=message):
        build_attention("agent", num_heads=H, head_dim=D, max_len=N, **overrides)


def test_budgets() -> None:
    budgets: List[Tuple[str, dict, str]] = [
        ("linformer", {"k": 128}, "k = 128"),
        ("agent", {"agents": 64}, "n = 64 agents"),
    ]
    for name, overrides, expected in budgets:
        assert build_attention(name, num_heads=H, head_dim=D, max_len=N, **overrides).budget() == expected
