"""Skyformer and Kernelized Attention against restatements of the authors' computation
(pkuzengqi/Skyformer src/models/attention_skyformer.py and attention.py), outputs and gradients."""
from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import kernelized, skyformer

B, H, N, D = 2, 2, 64, 16
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
MASKED = [pytest.param(False, id="full"), pytest.param(True, id="masked")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, N, D, generator=gen, dtype=dtype) * scale).requires_grad_() for _ in range(3)]


def make_mask(lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: torch.Tensor) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` at the real ``rows`` [B, N]."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return list(torch.autograd.grad((out * weight * rows[:, None, :, None]).sum(), inputs))


def assert_close(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], tol: float) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert rel_err(out, ref) < tol, f"tensor {i}: relative error {rel_err(out, ref):.2e}"


def authors_rbf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SoftmaxAttention_RBF.forward without its dropout: masked, D^-1/4-scaled q and k, exp of the
    negative half squared distance, padded keys pushed to exp(-1e9)."""
    p = q.shape[-1]
    m = mask.to(q.dtype)
    q = q * (m[:, None, :, None] * p**-0.25)
    k = k * (m[:, None, :, None] * p**-0.25)
    diag_q = ((q * q).sum(-1) * 0.5).unsqueeze(-1)
    diag_k = ((k * k).sum(-1) * 0.5).unsqueeze(-2)
    product = torch.einsum("...np,...mp->...nm", q, k) - diag_q - diag_k - 1e9 * (1 - m[:, None, None, :])
    return torch.exp(product) @ v


def authors_skyformer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Skyformer.forward for one sequence and head ([1, 1, n, p]) with the uniforms u [m] in place of
    torch.rand: landmark rows (n_real u).long(), the second half offset into the keys, STAS + 0.1 I,
    the symmetric normalisation, iterative_inv's 6 steps from its global-max start."""
    n, p = q.shape[-2:]
    m = mask.to(q.dtype)
    q = q * (m[:, None, :, None] * p**-0.25)
    k = k * (m[:, None, :, None] * p**-0.25)
    v = v * m[:, None, :, None]
    total = u.shape[0]
    s = (m.sum(-1)[:, None] * u[None, :]).long()  # [1, m]
    s[:, total // 2:] += n
    x = torch.cat([q, k], dim=2)  # [1, 1, 2n, p]
    xs = x[:, :, s[0]]
    kernel = torch.exp(x @ xs.transpose(-1, -2) - 0.5 * (x * x).sum(-1)[..., None] - 0.5 * (xs * xs).sum(-1)[..., None, :])
    kq, kk = kernel[:, :, :n], kernel[:, :, n:]
    stas = kernel[:, :, s[0]] + 1e-1 * torch.eye(total, dtype=q.dtype)
    d_inv = torch.sqrt(1 / stas.sum(-1))
    stas = d_inv[..., :, None] * stas * d_inv[..., None, :]
    eye = torch.eye(total, dtype=q.dtype)
    inv = 1 / torch.max(torch.sum(stas, dim=-2)) * stas.transpose(-1, -2)
    for _ in range(6):
        kv = stas @ inv
        inv = (0.25 * inv) @ (13 * eye - kv @ (15 * eye - kv @ (7 * eye - kv)))
    kk = ((kk * d_inv[..., None, :]) @ inv) * d_inv[..., None, :] * m[:, None, :, None]
    return kq @ (kk.transpose(-1, -2) @ v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", MASKED)
def test_kernelized_matches_the_authors_rbf_attention(masked: bool, dtype: torch.dtype) -> None:
    attn = build_attention("kernelized", num_heads=H, head_dim=D, max_len=N)
    q, k, v = make_qkv(dtype)
    mask = make_mask([N, 29] if masked else [N, N])
    out = attn(q, k, v, mask if masked else None)
    real = mask[:, None, :, None]
    got = [out * real] + grads(out, [q, k, v], mask)
    for ref in (authors_rbf(q, k, v, mask), kernelized.reference(q, k, v, mask)):
        assert_close(got, [ref * real] + grads(ref, [q, k, v], mask), TOL[dtype])


def test_kernelized_is_unnormalised_and_padding_free() -> None:
    """A key equal to the query weighs exactly 1 (no row normalisation); padded keys weigh 0."""
    attn = build_attention("kernelized", num_heads=1, head_dim=4, max_len=3)
    q = torch.tensor([[[[1.0, 2.0, 0.0, -1.0]]]])  # [1, 1, 1, 4]
    k = torch.cat([q, q + 100, q], dim=2)  # [1, 1, 3, 4]: the far key weighs exp(-2e4)
    v = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]]])
    out = attn(q.expand(1, 1, 3, 4), k, v, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("scale", [1.0, 10.0], ids=["unit", "far"])
def test_kernelized_slice_of_queries_is_the_slice_of_the_whole(scale: float) -> None:
    """At 10x the scale every weight is below 1e-25: still finite and relatively exact in fp32."""
    attn = build_attention("kernelized", num_heads=H, head_dim=D, max_len=N)
    q, k, v = (x.detach() * scale for x in make_qkv(torch.float32))
    whole = attn(q, k, v)
    exact = kernelized.reference(q.double(), k.double(), v.double())
    assert rel_err(whole, exact) < 1e-5
    assert rel_err(attn.attend(q[:, :, 5:20], k, v), exact[:, :, 5:20]) < 1e-5


def uniforms(attn: torch.nn.Module) -> torch.Tensor:
    """The stored draws as the uniforms the authors' torch.rand would have given: draws / 2^31, exact in fp64."""
    return attn.draws.to(torch.float64) / 2**skyformer.DRAW_BITS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", MASKED)
def test_skyformer_matches_the_authors_computation(masked: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=32).to(dtype).eval()
    q, k, v = make_qkv(dtype)
    mask = make_mask([N, 29] if masked else [N, N])
    out = attn(q, k, v, mask if masked else None)
    # the authors' initial scale is one max over the batch and heads: restated one sequence and head at a time
    ref = torch.stack([
        torch.cat([authors_skyformer(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], mask[b:b + 1],
                                     uniforms(attn)) for h in range(H)], dim=1)[0]
        for b in range(B)
    ])
    tol = {torch.float32: 1e-4, torch.float64: 1e-9}[dtype]
    assert_close([out * mask[:, None, :, None]] + grads(out, [q, k, v], mask),
                 [ref * mask[:, None, :, None]] + grads(ref, [q, k, v], mask), tol)


@pytest.mark.parametrize("sampling", skyformer.SAMPLINGS)
def test_skyformer_fast_path_matches_its_reference(sampling: str) -> None:
    torch.manual_seed(0)
    attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=24, sampling=sampling)
    attn = attn.double().eval()
    q, k, v = make_qkv(torch.float64)
    mask = make_mask([N, 29])
    rows, from_keys = skyformer.landmark_rows(attn.draws, mask.sum(-1), sampling)
    out = attn(q, k, v, mask)
    ref = skyformer.reference(q, k, v, rows, from_keys, mask)
    assert_close([out * mask[:, None, :, None]] + grads(out, [q, k, v], mask),
                 [ref] + grads(ref, [q, k, v], mask), 1e-10)


def test_skyformer_landmarks_are_real_tokens_split_between_queries_and_keys() -> None:
    draws = torch.tensor([0, 2**31 - 1, 2**30, 3 * 2**29])
    rows, from_keys = skyformer.landmark_rows(draws, torch.tensor([64, 10]), "split")
    assert rows.tolist() == [[0, 63, 32, 48], [0, 9, 5, 7]]
    assert from_keys.tolist() == [[False, False, True, True]] * 2
    rows, from_keys = skyformer.landmark_rows(draws, torch.tensor([10]), "uniform")
    # over the 20 real rows of [Q; K]: 0, 19, 10, 15 -> query 0, key 9, key 0, key 5
    assert rows.tolist() == [[0, 9, 0, 5]] and from_keys.tolist() == [[False, True, True, True]]


def test_skyformer_padded_equals_alone() -> None:
    torch.manual_seed(0)
    attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=16).eval()
    q, k, v = (x.detach() for x in make_qkv(torch.float32))
    out = attn(q, k, v, make_mask([N, 29]))
    alone = attn(q[1:, :, :29], k[1:, :, :29], v[1:, :, :29])
    assert rel_err(out[1:, :, :29], alone) < 1e-5
    # nor does the other sequence of the batch (the iteration's initial scale is per sequence and head)
    other = [torch.cat([3 * x[:1], x[1:]]) for x in (q, k, v)]
    assert rel_err(attn(*other, make_mask([N, 29]))[1, :, :29], out[1, :, :29]) < 1e-5


def test_skyformer_every_row_once_without_ridge_is_kernelized_attention() -> None:
    """Landmarks covering all 2N rows of [Q; K], no ridge, a converged inverse: the Nystrom sketch of
    the (well-conditioned) completion is exact, so Skyformer is Kernelized Attention."""
    attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=2 * N, sampling="uniform",
                           ridge=0.0, iterations=40).double().eval()
    # draw i = ceil(i 2^31 / 2N) picks row i of the 2N
    rows = torch.arange(2 * N)
    attn.draws.copy_(-((-rows * 2**skyformer.DRAW_BITS) // (2 * N)))
    q, k, v = (x.detach() for x in make_qkv(torch.float64))
    assert rel_err(attn(q, k, v), kernelized.reference(q, k, v)) < 1e-10


def test_skyformer_error_falls_as_landmarks_grow() -> None:
    """Relative error against exact Kernelized Attention, mean of 3 draws: measured 0.75, 0.55, 0.23,
    0.13 at 4, 16, 64, 128 landmarks (N = 64, real lengths 64 and 29)."""
    q, k, v = (x.detach() for x in make_qkv(torch.float64))
    mask = make_mask([N, 29])
    real = mask[:, None, :, None]
    exact = kernelized.reference(q, k, v, mask)
    errors = []
    for features in (4, 16, 64, 128):
        runs = []
        for seed in range(3):
            torch.manual_seed(seed)
            attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=features).double().eval()
            runs.append(float(((attn(q, k, v, mask) - exact) * real).norm() / exact.norm()))
        errors.append(sum(runs) / len(runs))
    assert all(a > 1.25 * b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.2, errors


def test_skyformer_draws_are_stored_and_redrawn_only_in_training() -> None:
    torch.manual_seed(0)
    attn = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=16)
    q, k, v = (x.detach() for x in make_qkv(torch.float32))
    # a checkpoint holds the draw: a fresh module loading it computes the same outputs
    torch.manual_seed(1)
    copy = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=16)
    assert not torch.equal(copy.draws, attn.draws)
    copy.load_state_dict(attn.state_dict())
    attn.eval(), copy.eval()
    torch.testing.assert_close(copy(q, k, v), attn(q, k, v), rtol=0, atol=0)
    before = attn.draws.clone()
    attn.train()
    attn(q, k, v)
    assert not torch.equal(attn.draws, before)
    fixed = build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, features=16, resample="never")
    before = fixed.draws.clone()
    fixed(q, k, v)
    assert torch.equal(fixed.draws, before)


@pytest.mark.parametrize("option, value, words", [
    ("features", 0, "features must be >= 1"),
    ("sampling", "random", "sampling 'random' is not one of split, uniform"),
    ("resample", "sometimes", "resample 'sometimes' is not one of train, always, never"),
    ("ridge", -1.0, "ridge >= 0"),
])
def test_skyformer_errors(option: str, value: object, words: str) -> None:
    with pytest.raises(AttentionError, match=words):
        build_attention("skyformer", num_heads=H, head_dim=D, max_len=N, **{option: value})
