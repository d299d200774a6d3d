"""TTT-Linear and TTT-MLP: the dual form against the primal form and against the authors' computation
(outputs and gradients), causality, padding (also for the reversed scan of ``bidirectional``)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import pytest
import torch

from attentions import AttentionError, build_attention

B, H, N, D = 2, 2, 64, 16
NAMES = [pytest.param("ttt_linear", id="linear"), pytest.param("ttt_mlp", id="mlp")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def build(name: str, **options) -> torch.nn.Module:
    """A backend whose learned pieces are moved off their initial values (ones, zeros), so a test sees them;
    the per-place offsets (added to 1/t >= 1/16) only a little, so no step size is clamped to 0."""
    torch.manual_seed(0)
    attn = build_attention(name, num_heads=H, head_dim=D, max_len=N, **options).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.add_((0.01 if "token_offset" in name else 0.2) * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return attn


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` (restricted to real ``rows`` [B, N] if given), in
    float64 whatever ``out``'s dtype (so that float32 and float64 outputs meet the same projection)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if rows is not None:
        weight = weight * rows[:, None, :, None]
    return list(torch.autograd.grad((out.double() * weight).sum(), inputs))


@pytest.mark.parametrize("options", [
    pytest.param({}, id="default"),
    pytest.param({"token_average": False}, id="plain-sum"),
    pytest.param({"bidirectional": True}, id="bidirectional"),
    pytest.param({"mini_batch": 5}, id="mini-batch-5"),
])
@pytest.mark.parametrize("masked", [pytest.param(False, id="full"), pytest.param(True, id="masked")])
@pytest.mark.parametrize("name", NAMES)
def test_dual_form_matches_primal_form(name: str, masked: bool, options: dict) -> None:
    """N = 60 leaves a partial last mini-batch; gradients reach q, k, v and every learned piece."""
    attn = build(name, **options)
    q, k, v = make_qkv(60)
    mask = make_mask(60, [60, 37]) if masked else None
    inputs = [q, k, v, *attn.parameters()]
    out = attn(q, k, v, mask)
    attn.cfg.form = "primal"
    ref = attn(q, k, v, mask)
    assert rel_err(out, ref) < 1e-12
    for i, (got, want) in enumerate(zip(grads(out, inputs), grads(ref, inputs))):
        assert rel_err(got, want) < 1e-11, f"gradient {i}"


def authors_ttt(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ttt-lm-pytorch ttt.py, TTTLinear/TTTMLP.ttt with use_dual_form, restated: full mini-batches of 16,
    then the remainder as one shorter mini-batch carrying the last weights; eta = token_eta * ttt_lr_eta.
    The lr gate reads k (the backend's input) where the authors' reads the hidden state x."""
    p = attn.scans[0]
    n, size = q.shape[2], attn.cfg.mini_batch
    ln_w, ln_b = p.ln_weight, p.ln_bias  # [H, 1, D]

    def ln_fwd(x):
        mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
        return ln_w * (x - mu) / torch.sqrt(var + 1e-6) + ln_b

    def ln_fused_l2_bwd(x, target):
        mu, std = x.mean(-1, keepdim=True), torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-6)
        x_hat = (x - mu) / std
        g = (ln_w * x_hat + ln_b - target) * ln_w
        return (D * g - g.sum(-1, keepdim=True) - x_hat * (g * x_hat).sum(-1, keepdim=True)) / (D * std)

    def gelu_bwd(x):
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)

    gelu = torch.nn.GELU(approximate="tanh")
    ttt_lr = attn.cfg.base_lr * torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, p.lr_weight) + p.lr_bias[:, None]) / D
    token_idx = torch.clamp_min(1.0 / torch.arange(1, size + 1, dtype=q.dtype) + p.token_offset, 0.0)
    params = [w.expand(q.shape[0], *w.shape) for w in p.initial_state()]
    outs = []
    for s in range(0, n, size):
        xq, xk, xv, lr = q[:, :, s:s + size], k[:, :, s:s + size], v[:, :, s:s + size], ttt_lr[:, :, s:s + size]
        kb = xq.shape[2]
        eta = token_idx[:kb, None] * lr[:, :, None, :]  # [B, H, K, K]
        last = eta[:, :, -1, :, None]
        if len(params) == 2:
            w1, b1 = params
            grad_z1 = ln_fused_l2_bwd(xk @ w1 + b1, xv - xk)
            z1_bar = xq @ w1 - (eta * torch.tril(xq @ xk.transpose(-2, -1))) @ grad_z1 + b1 - torch.tril(eta) @ grad_z1
            params = [w1 - (last * xk).transpose(-1, -2) @ grad_z1, b1 - (last * grad_z1).sum(-2, keepdim=True)]
            outs.append(xq + ln_fwd(z1_bar))
        else:
            w1, b1, w2, b2 = params
            z1 = xk @ w1 + b1
            x2 = gelu(z1)
            grad_z2 = ln_fused_l2_bwd(x2 @ w2 + b2, xv - xk)
            grad_z1 = grad_z2 @ w2.transpose(-2, -1) * gelu_bwd(z1)
            z1_bar = xq @ w1 - (eta * torch.tril(xq @ xk.transpose(-2, -1))) @ grad_z1 + b1 - torch.tril(eta) @ grad_z1
            x2_bar = gelu(z1_bar)
            z2_bar = x2_bar @ w2 - (eta * torch.tril(x2_bar @ x2.transpose(-2, -1))) @ grad_z2 + b2 - torch.tril(eta) @ grad_z2
            params = [w1 - (last * xk).transpose(-1, -2) @ grad_z1, b1 - (last * grad_z1).sum(-2, keepdim=True),
                      w2 - (last * x2).transpose(-1, -2) @ grad_z2, b2 - (last * grad_z2).sum(-2, keepdim=True)]
            outs.append(xq + ln_fwd(z2_bar))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("n", [pytest.param(64, id="N64"), pytest.param(53, id="N53-remainder")])
@pytest.mark.parametrize("name", NAMES)
def test_matches_the_authors_computation(name: str, n: int) -> None:
    attn = build(name)
    q, k, v = make_qkv(n)
    out = attn(q, k, v)
    ref = authors_ttt(attn, q, k, v)
    # the authors' GELU derivative rounds sqrt(2 / pi) to 8 digits
    tol = 1e-12 if name == "ttt_linear" else 1e-8
    assert rel_err(out, ref) < tol
    inputs = [q, k, v, *attn.parameters()]
    for i, (got, want) in enumerate(zip(grads(out, inputs), grads(ref, inputs))):
        assert rel_err(got, want) < tol, f"gradient {i}"


def assert_causal(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A later token moves no earlier output, and does move its own and later ones."""
    out = attn(q, k, v)
    # token 37 sits inside its mini-batch (32 .. 47): earlier queries of that mini-batch must not see it
    later = [x.clone() for x in (q, k, v)]
    for x in later:
        x[:, :, 37] += 3.0
    moved = attn(*later)
    assert torch.equal(moved[:, :, :37], out[:, :, :37])
    assert (moved[:, :, 37:] - out[:, :, 37:]).abs().amax(dim=(0, 1, 3)).min() > 1e-6


def assert_padding_is_exact(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            tol: float) -> None:
    """Each row alone (lengths 45 and 17: partial mini-batches) equals its real part of a padded batch
    whose padding is large noise; padded rows are zero and send no gradient."""
    lengths = [45, 17]
    mask = make_mask(q.shape[2], lengths)
    noisy = [torch.where(mask[:, None, :, None], x, 1e3 * torch.randn_like(x)) for x in (q, k, v)]
    out = attn(*noisy, mask)
    g = grads(out, [q, k, v], rows=mask)
    for row, n in enumerate(lengths):
        sl = (slice(row, row + 1), slice(None), slice(0, n))
        alone = attn(q[sl], k[sl], v[sl])
        assert rel_err(out[sl], alone.double()) < tol
        assert not out[row, :, n:].any()
        assert all(not x[row, :, n:].any() for x in g)


@pytest.mark.parametrize("form", ["dual", "primal"])
@pytest.mark.parametrize("name", NAMES)
def test_causal_a_later_token_moves_no_earlier_output(name: str, form: str) -> None:
    q, k, v = (x.detach() for x in make_qkv(N))
    assert_causal(build(name, form=form), q, k, v)
    # the reversed scan of the bidirectional option does read later tokens
    both = build(name, bidirectional=True)
    later = [x.clone() for x in (q, k, v)]
    for x in later:
        x[:, :, 37] += 3.0
    assert not torch.allclose(both(*later)[:, :, :37], both(q, k, v)[:, :, :37])


@pytest.mark.parametrize("bidirectional", [pytest.param(False, id="causal"), pytest.param(True, id="bidirectional")])
@pytest.mark.parametrize("name", NAMES)
def test_padding_at_the_end_changes_no_real_output(name: str, bidirectional: bool) -> None:
    assert_padding_is_exact(build(name, bidirectional=bidirectional), *make_qkv(N), tol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_bidirectional_averages_a_scan_of_the_real_tokens_reversed(name: str) -> None:
    attn = build(name, bidirectional=True)
    q, k, v = (x.detach() for x in make_qkv(N))
    out = attn(q, k, v, make_mask(N, [N, 29]))
    one_way = build(name)
    forward, backward = attn.scans
    for row, n in enumerate([N, 29]):
        qr, kr, vr = (x[row:row + 1, :, :n] for x in (q, k, v))
        one_way.scans[0] = forward
        ahead = one_way(qr, kr, vr)
        one_way.scans[0] = backward
        behind = one_way(*(x.flip(2) for x in (qr, kr, vr))).flip(2)
        assert rel_err(out[row:row + 1, :, :n], 0.5 * (ahead + behind)) < 1e-12


def test_learned_pieces_are_parameters_per_scan() -> None:
    linear = build_attention("ttt_linear", num_heads=H, head_dim=D, max_len=N)
    assert sorted(n for n, _ in linear.named_parameters()) == sorted(
        f"scans.0.{n}" for n in ("W1", "b1", "ln_weight", "ln_bias", "lr_weight", "lr_bias", "token_offset"))
    mlp = build_attention("ttt_mlp", num_heads=H, head_dim=D, max_len=N, bidirectional=True)
    assert mlp.scans[1].W1.shape == (H, D, 4 * D) and mlp.scans[1].W2.shape == (H, 4 * D, D)
    assert not torch.equal(mlp.scans[0].W1, mlp.scans[1].W1)
    assert mlp.cfg.base_lr == 0.1 and linear.cfg.base_lr == 1.0


@pytest.mark.parametrize("option, message", [
    ({"form": "chunked"}, "form 'chunked' is not one of dual, primal"),
    ({"mini_batch": 0}, "mini_batch must be >= 1"),
    ({"base_lr": 0.0}, "base_lr and eps must be > 0"),
])
def test_bad_options_say_what_is_valid(option: dict, message: str) -> None:
    with pytest.raises(AttentionError, match=message):
        build_attention("ttt_linear", num_heads=H, head_dim=D, max_len=N, **option)
