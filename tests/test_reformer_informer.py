"""Reformer (LSH) and Informer (ProbSparse) attention: against plain restatements of the authors'
computations with the same hashes and samples (outputs and q/k/v gradients), which keys a query
reaches (by perturbation), padding, the degenerate settings that are full attention, seeded random
state saved with the model, and no N x N tensor."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attentions import build_attention
from attentions.backends import informer, reformer
from attentions.check import PASS, Battery, Sizes

B, H, N, D = 2, 2, 64, 16
TOL = 1e-10


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int = N, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]


def make_mask(lengths: Sequence[int], n: int = N) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of the real rows of ``out`` (zeros for an unused input)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if mask is not None:
        weight = weight * mask[:, None, :, None]
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]


def assert_same(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> None:
    for label, out, ref in zip(("out", "dq", "dk", "dv"), outs, refs):
        assert (out - ref).abs().max() <= TOL * ref.abs().max().clamp_min(1.0), f"{label}: {rel_err(out, ref):.2e}"


def lsh(**options) -> reformer.ReformerAttention:
    return build_attention("reformer", num_heads=H, head_dim=D, max_len=N, **options).double()


def probsparse(**options) -> informer.InformerAttention:
    return build_attention("informer", num_heads=H, head_dim=D, max_len=N, **options).double()


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return ((q @ k.transpose(-1, -2)) + bias).softmax(-1) @ v


# --- Reformer ---------------------------------------------------------------------------------------

def authors_lsh(qk: torch.Tensor, v: torch.Tensor, buckets: torch.Tensor, n_buckets: int, chunk: int) -> torch.Tensor:
    """HF LSHSelfAttention's flow (rounds laid end to end with bucket offsets, one stable sort, chunks of
    the whole, the chunk before by wrap-around, logsumexp over rounds), with the paper's in-bucket mask
    and log N_ij. No padding, N a multiple of chunk."""
    b, h, r, n = buckets.shape
    offset = (buckets + n_buckets * torch.arange(r)[:, None]).flatten(2)  # [B, H, R*N]
    ticket = offset.argsort(dim=-1, stable=True)  # [B, H, R*N]
    undo = ticket.argsort(dim=-1)
    pos = ticket % n
    take = lambda x: x.gather(2, pos[..., None].expand(-1, -1, -1, x.shape[-1])).view(b, h, -1, chunk, x.shape[-1])
    q_c, k_c, v_c = take(qk), take(reformer.shared_keys(qk)), take(v)
    back = lambda x: torch.cat([x, torch.cat([x[:, :, -1:], x[:, :, :-1]], dim=2)], dim=3)
    dots = q_c @ back(k_c).transpose(-1, -2)  # [B, H, chunks, c, 2c]
    qb, kb = offset.gather(2, ticket).view(b, h, -1, chunk), back(offset.gather(2, ticket).view(b, h, -1, chunk))
    qp, kp = pos.view(b, h, -1, chunk), back(pos.view(b, h, -1, chunk))
    table = buckets.transpose(2, 3)  # [B, H, N, R]
    rounds_i = table.gather(2, qp.flatten(2)[..., None].expand(-1, -1, -1, r)).view(*qp.shape, r)
    rounds_j = table.gather(2, kp.flatten(2)[..., None].expand(-1, -1, -1, r)).view(*kp.shape, r)
    n_ij = (rounds_i[..., :, None, :] == rounds_j[..., None, :, :]).sum(-1)
    dots = dots - n_ij.clamp_min(1).to(dots.dtype).log() - 1e5 * (qp[..., :, None] == kp[..., None, :])
    dots = dots.masked_fill(qb[..., :, None] != kb[..., None, :], float("-inf"))
    logits = dots.logsumexp(-1, keepdim=True)
    out = (dots - logits).exp() @ back(v_c)  # [B, H, chunks, c, D]
    out = out.flatten(2, 3).gather(2, undo[..., None].expand(-1, -1, -1, v.shape[-1])).view(b, h, r, n, -1)
    logits = logits.flatten(2).gather(2, undo).view(b, h, r, n, 1)
    return (out * torch.exp(logits - logits.logsumexp(dim=2, keepdim=True))).sum(2)


LSH_CASES = [
    pytest.param(dict(chunk_size=8), id="chunk8-2hashes-16buckets"),
    pytest.param(dict(chunk_size=16, n_hashes=1, n_buckets=4), id="chunk16-1hash-4buckets"),
    pytest.param(dict(chunk_size=16, n_hashes=3, n_buckets=2), id="chunk16-3hashes-2buckets"),
]


@pytest.mark.parametrize("options", LSH_CASES)
def test_reformer_matches_the_authors_flow_with_the_same_hashes(options) -> None:
    attn = lsh(**options)
    q, k, v = make_qkv()
    buckets = attn.buckets(q)
    # the hashes are really spread over the buckets (not a degenerate single bucket)
    assert buckets.unique().numel() == attn.n_buckets
    out = attn(q, k, v)
    ref = authors_lsh(q, v, buckets, attn.n_buckets, attn.cfg.chunk_size)
    assert_same([out, *grads(out, (q, k, v))], [ref, *grads(ref, (q, k, v))])


@pytest.mark.parametrize("options", LSH_CASES + [pytest.param(dict(chunk_size=5, n_buckets=6), id="chunk5-6buckets")])
@pytest.mark.parametrize("lengths", [(N, N), (N, 37), (23, 1)], ids=["full", "masked", "short"])
def test_reformer_matches_its_plain_reference(options, lengths) -> None:
    attn = lsh(**options)
    q, k, v = make_qkv()
    mask = make_mask(lengths)
    out = attn(q, k, v, mask)
    ref = reformer.reference(q, v, attn.buckets(q, mask), attn.cfg.chunk_size)
    assert_same([out * mask[:, None, :, None], *grads(out, (q, k, v), mask)],
                [ref * mask[:, None, :, None], *grads(ref, (q, k, v), mask)])


def test_reformer_uses_the_queries_as_shared_query_keys() -> None:
    attn = lsh(chunk_size=8)
    q, k, v = make_qkv()
    out = attn(q, k, v)
    assert torch.equal(out, attn(q, torch.randn_like(k), v))
    assert grads(out, (q, k, v))[1].abs().max() == 0


def test_reformer_reaches_only_keys_of_its_bucket_and_window() -> None:
    attn = lsh(chunk_size=8)
    q, k, v = (x.detach() for x in make_qkv())
    buckets = attn.buckets(q)  # [B, H, R, N]
    base = attn(q, k, v)
    i = 5
    apart = (buckets[0, 0, :, :] != buckets[0, 0, :, i, None]).all(0).nonzero().flatten()
    assert apart.numel() > 0
    # every key in another bucket than i's in every round, moved at once: query i does not move
    moved = v.clone()
    moved[0, 0, apart] += 100.0
    after = attn(q, k, moved)
    assert torch.equal(after[0, 0, i], base[0, 0, i])
    assert not torch.equal(after[0, 0, apart], base[0, 0, apart])
    # a key sharing i's bucket in round 0 and in its chunk or the one before moves it
    rank = reformer.sort_order(buckets).argsort(-1)[0, 0, 0] // 8
    same = buckets[0, 0, 0] == buckets[0, 0, 0, i]
    near = [j for j in range(N) if j != i and bool(same[j]) and 0 <= int(rank[i] - rank[j]) <= 1]
    assert near
    moved = v.clone()
    moved[0, 0, near[0]] += 100.0
    assert (attn(q, k, moved)[0, 0, i] - base[0, 0, i]).abs().max() > 1e-3


@pytest.mark.parametrize("n_hashes", [1, 2], ids=["1hash", "2hashes"])
@pytest.mark.parametrize("lengths", [(N, N), (N, 37)], ids=["full", "masked"])
def test_reformer_one_bucket_one_chunk_is_full_attention_without_self(n_hashes: int, lengths) -> None:
    assert_full_attention_without_self(lsh(n_buckets=1, chunk_size=N, n_hashes=n_hashes), lengths)


def assert_full_attention_without_self(attn: reformer.ReformerAttention, lengths: Sequence[int]) -> None:
    """q_i . q_j / |q_j| over every real j != i (the paper's self-exclusion), exactly; a token alone
    attends to itself."""
    q, k, v = make_qkv()
    mask = make_mask(lengths)
    out = attn(q, k, v, mask)
    bias = torch.zeros(B, 1, N, N, dtype=q.dtype).masked_fill(~mask[:, None, None, :], float("-inf"))
    bias = bias.masked_fill(torch.eye(N, dtype=torch.bool), float("-inf"))
    full = softmax_attention(q, reformer.shared_keys(q), v, bias)
    real = mask[:, None, :, None]
    assert_same([out * real, *grads(out, (q, k, v), mask)], [full * real, *grads(full, (q, k, v), mask)])
    alone = attn(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    assert torch.allclose(alone, v[:, :, :1], rtol=0, atol=1e-12)


def test_reformer_rotations_are_seeded_and_reload() -> None:
    q, k, v = (x.detach() for x in make_qkv())
    a, b, c = lsh(chunk_size=8, seed=1), lsh(chunk_size=8, seed=1), lsh(chunk_size=8, seed=2)
    assert "rotations" in a.state_dict() and torch.equal(a(q, k, v), b(q, k, v))
    assert not torch.equal(a.buckets(q), c.buckets(q))
    c.load_state_dict(a.state_dict())
    assert torch.equal(c(q, k, v), a(q, k, v))


def test_reformer_bucket_rule_is_hfs_and_factorised_hashing_combines_both_rotations() -> None:
    # HF: 2 N / chunk rounded down to a power of two, two factors above 2 max(sqrt(N / chunk), chunk)
    assert [reformer.default_buckets(n, 64) for n in (64, 1024, 2000, 4000, 16384, 65536)] == [
        (1,), (32,), (32,), (64,), (16, 32), (32, 64)]
    attn = build_attention("reformer", num_heads=H, head_dim=D, max_len=1024, chunk_size=16).double()
    assert attn.factors == (8, 16) and attn.n_buckets == 128 and attn.rotations.shape == (H, D, 2, 12)
    q = torch.randn(B, H, 1024, D, dtype=torch.float64)
    rotated = torch.einsum("bhnd,hdrk->bhrnk", q, attn.rotations)
    low = torch.cat([rotated[..., :4], -rotated[..., :4]], -1).argmax(-1)
    high = torch.cat([rotated[..., 4:], -rotated[..., 4:]], -1).argmax(-1)
    buckets = attn.buckets(q)
    assert torch.equal(buckets, low + 8 * high) and buckets.unique().numel() > 64


# --- Informer ---------------------------------------------------------------------------------------

def authors_probsparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, factor: int, index_sample: torch.Tensor):
    """Informer2020's ProbAttention (mask_flag False) with index_sample [N, U] given, no padding."""
    b, h, n, d = q.shape
    u = min(factor * math.ceil(math.log(n)), n)
    k_sample = k.unsqueeze(-3).expand(b, h, n, n, d)[:, :, torch.arange(n).unsqueeze(1), index_sample, :]
    q_k_sample = (q.unsqueeze(-2) @ k_sample.transpose(-2, -1)).squeeze(-2)
    m = q_k_sample.max(-1)[0] - torch.div(q_k_sample.sum(-1), n)
    m_top = m.topk(u, sorted=False)[1]
    q_reduce = q[torch.arange(b)[:, None, None], torch.arange(h)[None, :, None], m_top, :]
    attn = torch.softmax(q_reduce @ k.transpose(-2, -1) / math.sqrt(d), dim=-1)
    context = v.mean(dim=-2).unsqueeze(-2).expand(b, h, n, d).clone()
    context[torch.arange(b)[:, None, None], torch.arange(h)[None, :, None], m_top, :] = attn @ v
    return context


@pytest.mark.parametrize("factor", [2, 5], ids=["factor2", "factor5"])
def test_informer_matches_the_authors_code_with_the_same_samples(factor: int) -> None:
    attn = probsparse(factor=factor)
    q, k, v = make_qkv()
    u = informer.sample_count(factor, N)
    index_sample = (attn.uniform[:N, :u] * N).long()
    out = attn(q, k, v)
    ref = authors_probsparse(q, k, v, factor, index_sample)
    assert_same([out, *grads(out, (q, k, v))], [ref, *grads(ref, (q, k, v))])


@pytest.mark.parametrize("lengths", [(N, 37), (29, 7), (2, 1)], ids=["N-37", "29-7", "2-1"])
def test_informer_matches_its_plain_reference_under_padding(lengths) -> None:
    attn = probsparse(factor=2)
    q, k, v = make_qkv()
    mask = make_mask(lengths)
    out = attn(q, k, v, mask)
    ref = informer.reference(q, k, v, mask, attn.factor, attn.uniform)
    real = mask[:, None, :, None]
    assert_same([out * real, *grads(out, (q, k, v), mask)], [ref * real, *grads(ref, (q, k, v), mask)])


def test_informer_lazy_queries_take_the_mean_and_active_ones_reach_every_key() -> None:
    attn = probsparse(factor=2)
    q, k, v = (x.detach() for x in make_qkv())
    mask = make_mask((N, 40))
    u = informer.sample_count(2, 40)
    top = attn.measure(q, k, mask.sum(-1), informer.sample_count(2, N)).topk(u, dim=-1).indices[1, 0]
    lazy = [i for i in range(40) if i not in top.tolist()]
    base = attn(q, k, v, mask)
    # lazy rows: the mean of the 40 real values, not of the padded ones
    assert torch.allclose(base[1, 0, lazy], v[1, 0, :40].mean(0).expand(len(lazy), D), rtol=0, atol=1e-12)
    # a real key moved a little (the active set kept): active rows move, lazy rows do not
    j = lazy[0]
    moved = k.clone()
    moved[1, 0, j] += 1e-3
    after = attn(q, moved, v, mask)
    assert torch.equal(after[1, 0, lazy], base[1, 0, lazy])
    assert (after[1, 0, top] - base[1, 0, top]).abs().amin(-1).max() > 0


@pytest.mark.parametrize("lengths", [(N, N), (N, 37)], ids=["full", "masked"])
def test_informer_with_every_query_active_is_full_attention(lengths) -> None:
    attn = probsparse(factor=N)
    q, k, v = make_qkv()
    mask = make_mask(lengths)
    out = attn(q, k, v, mask)
    bias = torch.zeros(B, 1, 1, N, dtype=q.dtype).masked_fill(~mask[:, None, None, :], float("-inf"))
    full = softmax_attention(q / math.sqrt(D), k, v, bias)
    real = mask[:, None, :, None]
    assert_same([out * real, *grads(out, (q, k, v), mask)], [full * real, *grads(full, (q, k, v), mask)])


def test_informer_factor_follows_skyformer_features() -> None:
    # Skyformer: factor = ceil(in_nb_features / ln max_seq_len): 17 at 2000 tokens, 16 at 4000, 19 at 1024
    made = {n: build_attention("informer", num_heads=1, head_dim=8, max_len=n, features=128).factor for n in (2000, 4000, 1024)}
    assert made == {2000: 17, 4000: 16, 1024: 19}


def test_informer_samples_are_seeded_and_reload() -> None:
    q, k, v = (x.detach() for x in make_qkv())
    a, b, c = probsparse(seed=1), probsparse(seed=1), probsparse(seed=2)
    assert "uniform" in a.state_dict() and torch.equal(a(q, k, v), b(q, k, v))
    assert not torch.equal(a(q, k, v), c(q, k, v))
    c.load_state_dict(a.state_dict())
    assert torch.equal(c(q, k, v), a(q, k, v))


# --- both -------------------------------------------------------------------------------------------

class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("name,options", [("reformer", dict(chunk_size=16)), ("reformer", dict(chunk_size=16, form="chunked")),
                                          ("informer", dict(chunk_size=128))],
                         ids=["reformer", "reformer-chunked", "informer"])
def test_no_n_by_n_tensor_forward_or_backward(name: str, options) -> None:
    n = 1024
    attn = build_attention(name, num_heads=1, head_dim=8, max_len=n, **options)
    q, k, v = (torch.randn(1, 1, n, 8, requires_grad=True) for _ in range(3))
    with LargestTensor() as seen:
        attn(q, k, v, make_mask((n - 100,), n)[:1]).sum().backward()
    assert seen.most <= n * n // 8, seen.most


@pytest.mark.parametrize("name,options", [("reformer", dict(chunk_size=8)), ("reformer", dict(chunk_size=6, n_hashes=3)),
                                          ("informer", dict(factor=2)), ("informer", dict(features=16))],
                         ids=["reformer-chunk8", "reformer-chunk6-3hashes", "informer-factor2", "informer-features16"])
def test_contract_battery_with_hashing_and_sampling_options(name: str, options) -> None:
    """lra-check-attn's padding checks at settings where buckets, chunks and lazy queries are at work."""
    battery = Battery(name, Sizes(), seed=0, overrides=options)
    battery.builds()
    battery.pick_dtype()
    for check in (battery.padding_invariance, battery.padding_gradient, battery.padded_vs_alone):
        check()
