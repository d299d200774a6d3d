"""BigBird and Sinkhorn attention: against plain restatements of the authors' computations (outputs
and gradients), reachability by perturbation, degenerate settings, padding and saved random state."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Set

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import bigbird as bigbird_module
from attentions.backends import sinkhorn
from attentions.backends.full import reference as full_reference

B, H, N, D = 2, 2, 64, 16
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
MASKED = [pytest.param(False, id="full"), pytest.param(True, id="masked")]
LENGTHS = (N, 37)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int, dtype: torch.dtype, seed: int = 0, batch: int = B) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, n, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], mask: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of the real rows of ``out``."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if mask is not None:
        weight = weight * mask[:, None, :, None]
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def assert_close(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], tol: float) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert rel_err(out, ref) < tol, f"tensor {i}: relative error {rel_err(out, ref):.2e}"


# ---- BigBird ----

def bigbird(n: int = N, **options) -> torch.nn.Module:
    return build_attention("bigbird", num_heads=H, head_dim=D, max_len=n, **options)


def bigbird_blocks(m: int, i: int, head: int, draws: torch.Tensor, r: int) -> Set[int]:
    """The key blocks query block i of a sequence of m real blocks reaches, by the paper's rule:
    global rows reach every block; the others the first and last block, blocks i-1..i+1 and r random
    middle blocks outside the window, each draw the y-th block not drawn yet (y from the seeded draws)."""
    if i in (0, m - 1):
        return set(range(m))
    reached = {0, m - 1} | {j for j in (i - 1, i, i + 1) if 0 <= j < m}
    remaining = [j for j in range(1, m - 1) if abs(j - i) > 1]
    for t in range(min(r, len(remaining))):
        reached.add(remaining.pop((int(draws[i, head, t]) * len(remaining)) >> 31))
    return reached


def bigbird_dense(q, k, v, mask, block_size: int, draws: torch.Tensor, r: int) -> torch.Tensor:
    """Softmax over each query's reachable real keys, on the [N, N] score matrix (tests only)."""
    b, h, n, d = q.shape
    lengths = mask.sum(-1).tolist() if mask is not None else [n] * b
    allowed = torch.zeros(b, h, n, n, dtype=torch.bool)
    for row, length in enumerate(lengths):
        m = -(-length // block_size)
        for head in range(h):
            for i in range(m):
                for j in bigbird_blocks(m, i, head, draws, r):
                    allowed[row, head, i * block_size:(i + 1) * block_size, j * block_size:min((j + 1) * block_size, length)] = True
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1).nan_to_num() @ v
    return out if mask is None else out * mask[:, None, :, None]


SETTINGS = [
    pytest.param(dict(block_size=4, num_random_blocks=3), id="b4-r3"),
    pytest.param(dict(block_size=8, num_random_blocks=1), id="b8-r1"),
    pytest.param(dict(block_size=6, num_random_blocks=2), id="b6-r2-short-last-block"),
    pytest.param(dict(block_size=4, num_random_blocks=0), id="b4-r0"),
]


@pytest.mark.parametrize("options", SETTINGS)
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bigbird_equals_the_dense_restatement(options, masked: bool, dtype: torch.dtype) -> None:
    attn = bigbird(seed=3, **options).to(dtype)
    q, k, v = make_qkv(N, dtype)
    mask = make_mask(N, LENGTHS) if masked else None
    out = attn(q, k, v, mask)
    ref = bigbird_dense(q, k, v, mask, options["block_size"], attn.draws, options["num_random_blocks"])
    want = [ref, *grads(ref, (q, k, v), mask)]
    assert_close([out, *grads(out, (q, k, v), mask)], want, TOL[dtype])
    # the blockwise reference beside the fast path agrees too
    plain = bigbird_module.reference(q, k, v, mask, options["block_size"], attn.draws)
    assert_close([plain, *grads(plain, (q, k, v), mask)], want, TOL[dtype])


def test_bigbird_query_chunks_equal_the_dense_restatement(monkeypatch) -> None:
    """Query blocks computed a chunk at a time (3 blocks here; the last chunk short) give the same."""
    monkeypatch.setattr(bigbird_module, "QUERIES_PER_CHUNK", 12)
    attn = bigbird(seed=4, block_size=4, num_random_blocks=2).double()
    q, k, v = make_qkv(N, torch.float64)
    mask = make_mask(N, LENGTHS)
    out = attn(q, k, v, mask)
    ref = bigbird_dense(q, k, v, mask, 4, attn.draws, 2)
    assert_close([out, *grads(out, (q, k, v), mask)], [ref, *grads(ref, (q, k, v), mask)], TOL[torch.float64])


@torch.no_grad()
def test_bigbird_reachability_by_perturbation() -> None:
    """A key or value moved outside a query's blocks leaves its output still; inside, it moves it."""
    size, r = 8, 1
    attn = bigbird(seed=5, block_size=size, num_random_blocks=r).double()
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64, batch=1))
    base = attn(q, k, v)
    m = N // size
    for head in range(H):
        # rows away from the ends reach 2 + 3 + r distinct blocks, fewer than all
        for i in range(2, m - 2):
            assert len(bigbird_blocks(m, i, head, attn.draws, r)) == 2 + 3 + r < m
    for j in range(m):
        for which in (1, 2):
            moved = [k, v][which - 1].clone()
            moved[:, :, j * size + 3] += 5.0
            out = attn(q, moved, v) if which == 1 else attn(q, k, moved)
            for head in range(H):
                for i in range(m):
                    change = float((out - base)[0, head, i * size:(i + 1) * size].abs().max())
                    reached = j in bigbird_blocks(m, i, head, attn.draws, r)
                    assert (change > 1e-6) == reached, (head, i, j, which, change)


def test_bigbird_random_blocks_are_distinct_outside_window_and_global_and_differ_by_head() -> None:
    size, r, m = 4, 3, 16
    attn = bigbird(seed=11, block_size=size, num_random_blocks=r)
    index, used = bigbird_module.block_pattern(torch.tensor([m * size]), m, size, attn.draws)  # [1, M, H, 8]
    for i in range(1, m - 1):
        for head in range(H):
            rand = index[0, i, head, 5:].tolist()
            assert used[0, i, head, 5:].all() and len(set(rand)) == r
            assert all(1 <= j <= m - 2 and abs(j - i) > 1 for j in rand)
    assert not torch.equal(index[0, :, 0, 5:], index[0, :, 1, 5:])


@pytest.mark.parametrize("options", [pytest.param(dict(block_size=64), id="one-block"),
                                     pytest.param(dict(block_size=100), id="block-longer-than-N"),
                                     pytest.param(dict(block_size=10, num_random_blocks=3), id="7-blocks-all-reached")])
@pytest.mark.parametrize("masked", MASKED)
def test_bigbird_degenerate_settings_equal_full_attention(options, masked: bool) -> None:
    """One block spanning the sequence is a global block; with 7 blocks, 2 + 3 + 3 reach them all."""
    attn = bigbird(n=100, **options).double()
    q, k, v = make_qkv(N, torch.float64)
    mask = make_mask(N, LENGTHS) if masked else None
    ref = full_reference(q, k, v, mask)
    if mask is not None:
        ref = ref * mask[:, None, :, None]
    out = attn(q, k, v, mask)
    assert_close([out, *grads(out, (q, k, v), mask)], [ref, *grads(ref, (q, k, v), mask)], TOL[torch.float64])


def test_bigbird_padding_changes_nothing_real() -> None:
    """The last real block is the global one and random blocks are drawn among real blocks."""
    attn = bigbird(n=96, seed=2, block_size=4, num_random_blocks=2).double()
    q, k, v = (x.detach() for x in make_qkv(96, torch.float64))
    alone = attn(q[:1, :, :37], k[:1, :, :37], v[:1, :, :37])
    padded = attn(q, k, v, make_mask(96, (37, 96)))
    assert rel_err(padded[:1, :, :37], alone) < 1e-12
    assert padded[0, :, 37:].abs().max() == 0


def test_bigbird_random_blocks_are_saved_and_reloaded() -> None:
    torch.manual_seed(0)
    first, second = bigbird(block_size=4), bigbird(block_size=4)
    assert not torch.equal(first.draws, second.draws), "two layers of one model must get their own pattern"
    q, k, v = make_qkv(N, torch.float32)
    second.load_state_dict(first.state_dict())
    assert torch.equal(first(q, k, v), second(q, k, v))
    # a fixed seed gives the same draws; a dtype change keeps them (an integer buffer)
    assert torch.equal(bigbird(seed=7).draws, bigbird(seed=7).to(torch.float64).draws)


def test_bigbird_refuses_sequences_past_max_len() -> None:
    with pytest.raises(AttentionError, match="max_len >= 80"):
        bigbird(n=64, block_size=4)(*(torch.randn(1, H, 80, D) for _ in range(3)))


# ---- Sinkhorn ----

def sinkhorn_attn(n: int = N, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention("sinkhorn", num_heads=H, head_dim=D, max_len=n, **options)


@pytest.mark.parametrize("options", [
    pytest.param(dict(block_size=8, sinkhorn_iters=1), id="b8-iters1-local"),
    pytest.param(dict(block_size=8, sinkhorn_iters=0), id="b8-softmax-sort-local"),
    pytest.param(dict(block_size=6, sinkhorn_iters=3, local=False), id="b6-iters3-sorted-only"),
    pytest.param(dict(block_size=16, sinkhorn_iters=2, temperature=0.5), id="b16-iters2-T0.5"),
])
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinkhorn_equals_the_blockwise_restatement(options, masked: bool, dtype: torch.dtype) -> None:
    attn = sinkhorn_attn(**options).to(dtype)
    cfg = attn.cfg
    q, k, v = make_qkv(N, dtype)
    mask = make_mask(N, LENGTHS) if masked else None
    out = attn(q, k, v, mask)
    ref = sinkhorn.reference(q, k, v, mask, attn.sort_net.weight, cfg.block_size, cfg.sinkhorn_iters, cfg.temperature, cfg.local)
    # the sort network learns: its weight gets the same gradient both ways, and not zero
    inputs = (q, k, v, attn.sort_net.weight)
    got, want = grads(out, inputs, mask), grads(ref, inputs, mask)
    assert_close([out, *got], [ref, *want], TOL[dtype])
    assert got[3].abs().max() > 0


def test_sinkhorn_balancing_is_doubly_stochastic_over_real_blocks() -> None:
    logits = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    real = torch.arange(6)[None] < torch.tensor([[6], [4]])
    s = sinkhorn.balance(logits, real, iters=50)
    torch.testing.assert_close(s[0, 0].sum(-1), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(s[0, 0].sum(-2), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(s[1, 0, :4, :4].sum(-1), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(s[1, 0, :4, :4].sum(-2), torch.ones(4, dtype=torch.float64))
    assert s[1, 0, :4, 4:].abs().max() == 0 and s[1, 0, 4:, :4].abs().max() == 0
    # zero rounds is the row softmax the LRA JAX code sorts with
    torch.testing.assert_close(sinkhorn.balance(logits, real, 0)[0], logits[0].softmax(-1))


@torch.no_grad()
def test_sinkhorn_reachability_by_perturbation() -> None:
    """With a hard sort (row softmax at a tiny temperature) query block i reaches block i (local)
    and the block it sorted to; moving any other block's keys or values leaves its output still."""
    size = 8
    attn = sinkhorn_attn(block_size=size, sinkhorn_iters=0, temperature=1e-4).double()
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64, batch=1))
    base = attn(q, k, v)
    m = N // size
    pooled = k.view(1, H, m, size, D).sum(-2)
    chosen = attn.sort_net(pooled)[..., :m].argmax(-1)  # [1, H, M]
    hits = 0
    for j in range(m):
        for which in (1, 2):
            moved = [k, v][which - 1].clone()
            moved[:, :, j * size + 5] += 0.5
            out = attn(q, moved, v) if which == 1 else attn(q, k, moved)
            for head in range(H):
                for i in range(m):
                    change = float((out - base)[0, head, i * size:(i + 1) * size].abs().max())
                    reached = j in (i, int(chosen[0, head, i]))
                    assert (change > 1e-9) == reached, (head, i, j, which, change)
                    hits += reached and j != i
    assert hits > 0, "some block sorted to another block than its own"


@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("local", [pytest.param(False, id="sorted-only"), pytest.param(True, id="local")])
def test_sinkhorn_one_block_spanning_the_sequence_is_full_attention(masked: bool, local: bool) -> None:
    """One block sorts to itself (S = [[1]]): the sorted attention is full attention; the LRA JAX
    mixture adds the local attention, the same full attention again."""
    attn = sinkhorn_attn(n=N, block_size=N, local=local).double()
    q, k, v = make_qkv(N, torch.float64)
    mask = make_mask(N, LENGTHS) if masked else None
    ref = full_reference(q, k, v, mask) * (2 if local else 1)
    if mask is not None:
        ref = ref * mask[:, None, :, None]
    out = attn(q, k, v, mask)
    assert_close([out, *grads(out, (q, k, v), mask)], [ref, *grads(ref, (q, k, v), mask)], TOL[torch.float64])


def test_sinkhorn_padding_changes_nothing_real() -> None:
    attn = sinkhorn_attn(n=96, block_size=8).double()
    q, k, v = (x.detach() for x in make_qkv(96, torch.float64))
    alone = attn(q[:1, :, :37], k[:1, :, :37], v[:1, :, :37])
    noisy = [torch.where(make_mask(96, (37, 96))[:, None, :, None], x, 1e3) for x in (q, k, v)]
    padded = attn(*noisy, make_mask(96, (37, 96)))
    assert rel_err(padded[:1, :, :37], alone) < 1e-12
    assert padded[0, :, 37:].abs().max() == 0


def test_sinkhorn_refuses_sequences_past_max_len() -> None:
    with pytest.raises(AttentionError, match="max_len >= 80"):
        sinkhorn_attn(n=64, block_size=8)(*(torch.randn(1, H, 80, D) for _ in range(3)))
