"""Performer and Nystromformer against the authors' computations restated here and plain references,
outputs and gradients; padding; degenerate settings; the approximation error as features and
landmarks grow."""
from __future__ import annotations

import io
from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from attentions import AttentionError, build_attention
from attentions.backends import nystromformer, performer

B, H, N, D = 2, 2, 64, 16
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int, dtype: torch.dtype, seed: int = 0, batch: int = B, heads: int = H, scale: float = 1.0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, D, generator=gen, dtype=dtype) for _ in range(3))
    return [(q * scale).requires_grad_(), (k * scale).requires_grad_(), v.requires_grad_()]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` (restricted to real ``rows`` [B, N] if given)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if rows is not None:
        weight = weight * rows[:, None, :, None]
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def assert_close(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], tol: float) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert rel_err(out, ref) < tol, f"tensor {i}: relative error {rel_err(out, ref):.2e}"


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


# ---- Performer -------------------------------------------------------------------------------------


def authors_favor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """lucidrains/performer-pytorch softmax_kernel + linear_attention, as the PyTorch LRA code calls it:
    keys and values zeroed at padding, one max over every key of the batch (detached, as theirs is),
    phi(0) left in the sum."""
    c, ratio = q.shape[-1] ** -0.25, w.shape[0] ** -0.5
    real = mask[:, None, :, None].to(q.dtype)

    def kernel(x: torch.Tensor, is_query: bool) -> torch.Tensor:
        dash = (c * x) @ w.T
        diag = (x**2).sum(-1, keepdim=True) / 2 * c**2
        stabiliser = (dash.amax(-1, keepdim=True) if is_query else dash.max()).detach()
        return ratio * (torch.exp(dash - diag - stabiliser) + eps)

    phi_q, phi_k = kernel(q, True), kernel(k * real, False)
    d_inv = 1 / (phi_q @ phi_k.sum(-2)[..., None])
    return phi_q @ (phi_k.transpose(-1, -2) @ (v * real)) * d_inv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_performer_matches_reference(masked: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=48).to(dtype)
    q, k, v = make_qkv(N, dtype, scale=0.5)
    mask = make_mask(N, [N, 29]) if masked else None
    out = attn(q, k, v, mask)
    ref = performer.reference(q, k, v, mask, attn.features, attn.cfg.eps)
    assert_close([out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v]), TOL[dtype] * 10)


@pytest.mark.parametrize("queries", [N, 17], ids=["all-queries", "17-queries"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_performer_hand_backward_matches_its_autograd_form(masked: bool, queries: int) -> None:
    """FavorSoftmax (the path that runs) against ``favor`` (plain autograd): outputs and q/k/v gradients,
    padded key rows' gradients exactly zero."""
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=40).double()
    q, k, v = make_qkv(N, torch.float64, scale=0.7)
    mask = make_mask(N, [N, 29]) if masked else None
    keys = None if mask is None else mask[:, None, :, None]
    out = performer.FavorSoftmax.apply(q[:, :, :queries], k, v, attn.features, keys, attn.cfg.eps)
    ref = attn.favor(q[:, :, :queries], k, v, mask)
    found, expected = [out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v])
    assert_close(found, expected, 1e-12)
    if masked:
        assert torch.equal(found[2][1, :, 29:], torch.zeros_like(found[2][1, :, 29:]))


@pytest.mark.parametrize(
    "eps,batch,heads", [(0.0, B, H), (1e-4, 1, 1)], ids=["eps0-B2-H2", "eps1e-4-B1-H1"]
)
def test_performer_matches_the_authors_unpadded(eps: float, batch: int, heads: int) -> None:
    """Unpadded, the authors' FAVOR+ is ours: with eps = 0 every stabiliser cancels; with one sequence
    and one head their batch-wide key max is our per-sequence one."""
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=heads, head_dim=D, max_len=N, features=40, eps=eps).double()
    q, k, v = make_qkv(N, torch.float64, batch=batch, heads=heads, scale=0.5)
    out = attn(q, k, v)
    ref = authors_favor(q, k, v, torch.ones(batch, N, dtype=torch.bool), attn.features, eps)
    assert_close([out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v]), 1e-9)


def test_performer_padding_leaves_nothing_in_the_normaliser() -> None:
    """Padded, ours equals the sequence alone; the authors' computation (phi(0) of every padded key in
    the normaliser) does not."""
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=1, head_dim=D, max_len=N, features=32).double()
    q, k, v = make_qkv(N, torch.float64, batch=1, heads=1, scale=0.5)
    mask = make_mask(N, [20])
    alone = attn(q[:, :, :20], k[:, :, :20], v[:, :, :20])
    assert rel_err(attn(q, k, v, mask)[:, :, :20], alone) < 1e-12
    theirs = authors_favor(q, k, v, mask, attn.features, attn.cfg.eps)[:, :, :20]
    assert rel_err(theirs, alone) > 1e-2


def test_performer_relu_kernel_is_the_generalised_attention() -> None:
    """feature_map="relu": normalised relu(W x D^-1/4) + 0.001 similarities over the real keys."""
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=24, feature_map="relu").double()
    q, k, v = make_qkv(N, torch.float64)
    mask = make_mask(N, [N, 33])
    w = attn.features
    phi_q, phi_k = (F.relu(x * D**-0.25 @ w.T) + 1e-3 for x in (q, k))
    scores = phi_q @ phi_k.transpose(-1, -2) * mask[:, None, None, :]  # [B, H, N, N]
    ref = scores @ v / scores.sum(-1, keepdim=True)
    out = attn(q, k, v, mask)
    assert_close([out] + grads(out, [q, k, v]), [ref] + grads(ref, [q, k, v]), 1e-10)


def test_performer_error_falls_as_features_grow() -> None:
    """The relative error against softmax attention, averaged over two draws, falls with m (about as
    m^-1/2: each 4x more features at least a third less error)."""
    counts = [16, 64, 256, 1024]
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64, scale=0.5))
    full = full_attention(q, k, v)
    errors = []
    for m in counts:
        draws = []
        for seed in range(2):
            torch.manual_seed(seed)
            attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=m).double()
            draws.append(float((attn(q, k, v) - full).norm() / full.norm()))
        errors.append(sum(draws) / len(draws))
    assert all(later < 0.67 * earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.15, errors


def test_performer_features_are_orthogonal_gaussian_blocks() -> None:
    w = performer.orthogonal_features(40, D, torch.Generator().manual_seed(0))
    assert w.shape == (40, D)
    for start in (0, 16, 32):
        block = w[start : start + 16]
        gram = block @ block.T
        # rows of a block are orthogonal; their lengths are chi(D) draws, not all equal
        assert torch.allclose(gram - torch.diag(torch.diagonal(gram)), torch.zeros_like(gram), atol=1e-4)
    lengths = w.norm(dim=1)
    assert lengths.std() > 0.1 and 2.5 < float(lengths.mean()) < 5.5


def test_performer_blocks_are_haar_distributed() -> None:
    """A plain QR factor's first column points to the same side of its first axis every time (LAPACK's
    sign convention), which biases the kernel estimate; a Haar block's is + or - with equal chance."""
    w = performer.orthogonal_features(4000 * 4, 4, torch.Generator().manual_seed(0))  # [4000 blocks x 4, 4]
    first = w.reshape(4000, 4, 4)[:, 0, 0]
    assert 0.45 < float((first > 0).double().mean()) < 0.55


def test_performer_features_are_a_seeded_buffer_a_checkpoint_reloads() -> None:
    torch.manual_seed(3)
    first = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=32)
    torch.manual_seed(3)
    same = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=32)
    other = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=32)
    assert torch.equal(first.features, same.features) and not torch.equal(first.features, other.features)
    assert list(first.parameters()) == [] and "features" in first.state_dict()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    q, k, v = make_qkv(N, torch.float32)
    assert torch.equal(other(q, k, v), first(q, k, v))


@pytest.mark.parametrize("interval", [0, 2], ids=["fixed", "redraw-every-2"])
def test_performer_redraws_only_when_asked_and_only_in_training(interval: int) -> None:
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=16, redraw_interval=interval)
    q, k, v = make_qkv(N, torch.float32)
    drawn = [attn.features.clone()]
    for _ in range(5):
        attn(q, k, v)
        drawn.append(attn.features.clone())
    changed = [not torch.equal(a, b) for a, b in zip(drawn, drawn[1:])]
    assert changed == ([False] * 5 if interval == 0 else [False, False, True, False, True])
    attn.eval()
    before = attn.features.clone()
    for _ in range(4):
        attn(q, k, v)
    assert torch.equal(attn.features, before)


def test_performer_slice_of_queries_is_the_slice_of_the_whole() -> None:
    torch.manual_seed(0)
    attn = build_attention("performer", num_heads=H, head_dim=D, max_len=N, features=32)
    q, k, v = make_qkv(N, torch.float32)
    torch.testing.assert_close(attn.favor(q[:, :, 5:17], k, v, None), attn(q, k, v)[:, :, 5:17])


@pytest.mark.parametrize(
    "overrides,match",
    [({"features": 0}, "features must be >= 1"), ({"feature_map": "exp"}, "not one of softmax, relu"),
     ({"eps": -1.0}, "eps"), ({"feature_map": "relu", "relu_eps": 0.0}, "relu_eps > 0"),
     ({"redraw_interval": -1}, "redraw_interval")],
    ids=["features", "feature-map", "eps", "relu-eps", "redraw"],
)
def test_performer_errors(overrides: dict, match: str) -> None:
    with pytest.raises(AttentionError, match=match):
        build_attention("performer", num_heads=H, head_dim=D, max_len=N, **overrides)


# ---- Nystromformer ---------------------------------------------------------------------------------


def authors_nystrom(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int, conv: Optional[torch.nn.Conv2d], per_head: bool
) -> torch.Tensor:
    """mlpen/Nystromformer NystromAttention.forward without padding (mask all ones, N a multiple of m):
    segment means, three softmaxes, six Moore-Penrose iterations, the convolution of V added."""
    b, h, n, d = q.shape
    q, k = q / d**0.25, k / d**0.25
    q_l = q.reshape(b, h, m, n // m, d).mean(dim=-2)
    k_l = k.reshape(b, h, m, n // m, d).mean(dim=-2)
    kernel_1 = torch.softmax(q @ k_l.transpose(-1, -2), dim=-1)
    kernel_2 = torch.softmax(q_l @ k_l.transpose(-1, -2), dim=-1)
    kernel_3 = torch.softmax(q_l @ k.transpose(-1, -2), dim=-1)
    eye = torch.eye(m, dtype=q.dtype)
    # "original": one max over the batch and heads; the other option: per matrix
    col_max = kernel_2.sum(-2).amax(-1)[..., None, None] if per_head else kernel_2.sum(-2).max()
    z = 1 / col_max * kernel_2.transpose(-1, -2)
    for _ in range(6):
        kz = kernel_2 @ z
        z = (0.25 * z) @ (13 * eye - kz @ (15 * eye - kz @ (7 * eye - kz)))
    x = (kernel_1 @ z) @ (kernel_3 @ v)
    return x if conv is None else x + conv(v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv_kernel", [0, 7], ids=["no-conv", "conv7"])
@pytest.mark.parametrize("batch,heads,per_head", [(1, 1, False), (B, H, True)], ids=["B1-H1-original", "B2-H2-per-head"])
def test_nystromformer_matches_the_authors(batch: int, heads: int, per_head: bool, conv_kernel: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = build_attention("nystromformer", num_heads=heads, head_dim=D, max_len=N, landmarks=8, conv_kernel=conv_kernel)
    attn = attn.to(dtype)
    q, k, v = make_qkv(N, dtype, batch=batch, heads=heads)
    out = attn(q, k, v)
    ref = authors_nystrom(q, k, v, 8, attn.conv, per_head)
    params = [] if attn.conv is None else [attn.conv.weight]
    assert_close([out] + grads(out, [q, k, v, *params]), [ref] + grads(ref, [q, k, v, *params]), TOL[dtype] * 10)
    plain = nystromformer.reference(q, k, v, 8)
    if attn.conv is None:
        assert rel_err(out, plain) < TOL[dtype] * 10


@pytest.mark.parametrize(
    "n,lengths,landmarks",
    [(61, [61, 37], 8), (64, [64, 5], 8), (50, [50, 50], 8)],
    ids=["N61-not-divisible", "shorter-than-landmarks", "N50-unpadded"],
)
def test_nystromformer_real_outputs_ignore_padding(n: int, lengths: List[int], landmarks: int) -> None:
    """Each row equals its real tokens run alone, with the convolution too, whatever N mod m is; large
    noise in the padding changes nothing at real positions."""
    torch.manual_seed(0)
    attn = build_attention("nystromformer", num_heads=H, head_dim=D, max_len=n, landmarks=landmarks, conv_kernel=5).double()
    q, k, v = make_qkv(n, torch.float64)
    mask = make_mask(n, lengths)
    out = attn(q, k, v, mask)
    for row, length in enumerate(lengths):
        alone = attn(q[row : row + 1, :, :length], k[row : row + 1, :, :length], v[row : row + 1, :, :length])
        assert rel_err(out[row : row + 1, :, :length], alone) < 1e-10
    real = mask[:, None, :, None]
    noisy = [torch.where(real, x, 100 * torch.randn_like(x)) for x in (q, k, v)]
    assert rel_err(attn(*noisy, mask) * real, out * real) < 1e-10
    assert bool(out.isfinite().all())


def test_nystromformer_as_many_landmarks_as_tokens_is_full_attention() -> None:
    """m = N: one landmark per token, softmax(QK^T) pinv(softmax(QK^T)) softmax(QK^T) V = softmax(QK^T) V
    once the iteration has converged; the authors' six iterations come near."""
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64))
    full = full_attention(q, k, v)
    errors = {}
    for iterations in (6, 25):
        attn = build_attention("nystromformer", num_heads=H, head_dim=D, max_len=N, landmarks=N, pinv_iterations=iterations)
        errors[iterations] = float((attn(q, k, v) - full).norm() / full.norm())
    assert errors[25] < 1e-9 and errors[6] < 0.1, errors
    # more landmarks than tokens: one per token, the spare ones masked
    attn = build_attention("nystromformer", num_heads=H, head_dim=D, max_len=N, landmarks=2 * N, pinv_iterations=25)
    assert rel_err(attn(q, k, v), full) < 1e-9


def test_nystromformer_error_falls_as_landmarks_grow() -> None:
    """The relative error against softmax attention, averaged over three inputs, falls with m at the
    authors' six iterations."""
    counts = [4, 8, 16, 32, 64]
    errors = []
    for m in counts:
        attn = build_attention("nystromformer", num_heads=H, head_dim=D, max_len=N, landmarks=m)
        draws = []
        for seed in range(3):
            q, k, v = (x.detach() for x in make_qkv(N, torch.float64, seed=seed, scale=0.5))
            full = full_attention(q, k, v)
            draws.append(float((attn(q, k, v) - full).norm() / full.norm()))
        errors.append(sum(draws) / len(draws))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.25 * errors[0], errors


def test_nystromformer_pinv_inverts_a_row_stochastic_matrix() -> None:
    a = torch.softmax(torch.randn(2, 3, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), dim=-1)
    z = nystromformer.iterative_pinv(a, 30)
    assert torch.allclose(a @ z, torch.eye(12, dtype=torch.float64).expand_as(a), atol=1e-8)


@pytest.mark.parametrize(
    "overrides,match",
    [({"landmarks": 0}, "landmarks must be >= 1"), ({"pinv_iterations": -1}, "pinv_iterations"),
     ({"conv_kernel": 4}, "odd length")],
    ids=["landmarks", "iterations", "even-conv"],
)
def test_nystromformer_errors(overrides: dict, match: str) -> None:
    with pytest.raises(AttentionError, match=match):
        build_attention("nystromformer", num_heads=H, head_dim=D, max_len=N, **overrides)


def test_flops_grow_linearly_in_n() -> None:
    from attentions import build_config, get_attention

    for name, options in (("performer", {"features": 128}), ("nystromformer", {"landmarks": 128, "conv_kernel": 35})):
        cls = get_attention(name)
        small, _ = cls.flops(build_config(name, options), 4096, 32)
        large, train = cls.flops(build_config(name, options), 16384, 32)
        # at most 4x from 4K to 16K; Nystromformer's m^3 pseudo-inverse is the same at every length
        assert 2.5 < large / small <= 4.0 and train == 3 * large
