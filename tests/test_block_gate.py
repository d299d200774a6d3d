"""MoBA's gate on the C kernel (attentions/ops/block_gate/cpu.py) against its PyTorch form through
moba.choose_blocks: the same blocks for every query, with padding, all-padding blocks, fewer real
blocks than slots, the own block on and off, ties, and the same bits for any thread count; and the
merge of a query's experts on the C kernel (ops/grouped/cpu.merge_cpu) against its PyTorch form."""
from __future__ import annotations

import pytest
import torch

from attentions import build_attention
from attentions.backends import moba
from attentions.base import AttentionError
from attentions.ops import block_gate
from conftest import lengths_mask, rel_err

needs_kernel = pytest.mark.skipif(bool(block_gate.refusals(torch.zeros(1), 1)),
                                  reason="the C kernels do not build here (no C compiler)")


def chosen_sets(chosen: torch.Tensor, ok: torch.Tensor) -> list:
    """Each query's set of real chosen blocks (the slots' order is free)."""
    rows = chosen.flatten(0, 2).tolist(), ok.flatten(0, 2).tolist()
    return [frozenset(c for c, real in zip(cs, oks) if real) for cs, oks in zip(*rows)]


@needs_kernel
@pytest.mark.parametrize("b, h, n, d, size, topk, own, lengths", [
    (2, 2, 1000, 32, 64, 2, True, [1000, 517]),  # the defaults at an LRA length, a padded row
    (3, 1, 130, 12, 16, 3, False, [130, 40, 1]),  # no own block; all-padding blocks; one real token
    (1, 2, 100, 8, 64, 5, True, None),             # more slots than blocks (2)
    (2, 1, 200, 16, 16, 4, True, [200, 10]),      # a row with fewer real blocks than slots
    (2, 2, 300, 16, 32, 1, False, [300, 150]),    # one block per query: the best gate alone
])
def test_kernel_chooses_the_blocks_of_the_pytorch_path(b, h, n, d, size, topk, own, lengths) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, d, generator=gen) for _ in range(2))
    mask = None if lengths is None else lengths_mask(lengths, n)
    got, got_ok = moba.choose_blocks(q, k, mask, size, topk, own, native=True)
    want, want_ok = moba.choose_blocks(q, k, mask, size, topk, own, native=False)
    assert got.shape == want.shape and got.dtype == want.dtype and got_ok.dtype == torch.bool
    assert torch.equal(got_ok.sum(-1), want_ok.sum(-1))
    assert chosen_sets(got, got_ok) == chosen_sets(want, want_ok)
    if own:  # the own block is in every query's choice where it holds a real key
        own_block = (torch.arange(n) // size)[None, None, :, None]
        has_own = ((got == own_block) & got_ok).any(-1)
        real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
        own_real = real[:, (torch.arange(n) // size) * size]  # the block's first key is real iff any is
        assert torch.equal(has_own, own_real[:, None, :].expand(b, h, n))


@needs_kernel
@pytest.mark.parametrize("per_query", [0, 5])
def test_the_operator_refuses_more_slots_than_blocks_or_none(per_query: int) -> None:
    q, means = torch.randn(1, 1, 64, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(AttentionError, match=f"per_query={per_query} .* 1 to the 4 blocks"):
        block_gate.cpu.block_gate(q, means, None, 16, per_query, True)


@needs_kernel
def test_ties_go_to_the_lower_block_and_threads_do_not_change_bits() -> None:
    q = torch.randn(1, 2, 256, 8, generator=torch.Generator().manual_seed(1))
    k = torch.ones(1, 2, 256, 8)  # every block mean equal: every gate of a query ties
    chosen, ok = moba.choose_blocks(q, k, None, 32, 3, False, native=True)
    assert ok.all() and torch.equal(chosen, torch.tensor([0, 1, 2]).expand_as(chosen))
    k = torch.randn(2, 3, 700, 16, generator=torch.Generator().manual_seed(2))
    q = torch.randn(2, 3, 700, 16, generator=torch.Generator().manual_seed(3))
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(moba.choose_blocks(q, k, None, 64, 3, True, native=True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_kernel
def test_moba_on_the_gate_kernel_equals_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 300, 16, generator=gen, requires_grad=True) for _ in range(3))
    mask = lengths_mask([300, 77], 300)
    attn = build_attention("moba", num_heads=2, head_dim=16, max_len=300, block_size=32, topk=3)
    out = attn(q, k, v, mask)
    ref = moba.reference(q, k, v, mask, block_size=32, topk=3)
    real = mask[:, None, :, None]
    assert rel_err(out * real, ref * real) < 1e-5
    grads = torch.autograd.grad((out * real).sum(), [q, k, v])
    ref_grads = torch.autograd.grad((ref * real).sum(), [q, k, v])
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-4


@needs_kernel
def test_merge_kernel_equals_merge_and_gives_zero_gradients_to_rows_without_experts() -> None:
    from attentions.ops.grouped.cpu import merge_cpu
    from attentions.ops.grouped.reference import merge

    gen = torch.Generator().manual_seed(5)
    parts = torch.randn(64, 3, 33, generator=gen, requires_grad=True)
    lse = torch.randn(64, 3, generator=gen)
    lse[5] = float("-inf")     # a query with no expert at all
    lse[7, 1] = float("-inf")  # an empty slot
    lse.requires_grad_()
    weight = torch.randn(64, 33, generator=gen)
    got, want = merge_cpu(parts, lse), merge(parts, lse)
    assert rel_err(got, want) < 1e-6 and torch.equal(got[5], torch.zeros(33))
    got_grads = torch.autograd.grad((got * weight).sum(), [parts, lse])
    want_grads = torch.autograd.grad((want * weight).sum(), [parts, lse])
    rows = torch.arange(64) != 5  # torch's logsumexp gives the row without experts nan gradients
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g[rows], w[rows]) < 1e-5
        assert torch.equal(g[5], torch.zeros_like(g[5]))
    # slot-major layout (parts [E, R, D], lse [E, R], as MoBA lays its pairs out): the same numbers
    parts_t = parts.detach().transpose(0, 1).contiguous().requires_grad_()
    lse_t = lse.detach().transpose(0, 1).contiguous().requires_grad_()
    got_t = merge_cpu(parts_t, lse_t, slot_major=True)
    assert torch.equal(got_t, got)
    for g_t, g in zip(torch.autograd.grad((got_t * weight).sum(), [parts_t, lse_t]), got_grads):
        assert torch.equal(g_t.transpose(0, 1), g)


@needs_kernel
@pytest.mark.parametrize("saved", [True, False], ids=["rows-kept", "rows-recomputed"])
def test_merged_parts_equal_the_grouped_kernel_then_the_merge(saved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # MoBA's parts on the C kernels with the merge folded into the grouped backward, against the
    # grouped attention of repeated queries and the merge as separate steps (the C kernels' composed
    # path, which tests/test_cpu_kernels.py holds to the PyTorch form): queries whose third part has
    # no block (expert X), masked keys, a block with every key masked (its parts weigh 0)
    from attentions.ops import tuning
    from attentions.ops.grouped.cpu import grouped_attention_cpu, merge_cpu
    from attentions.ops.grouped.merged_cpu import merged_attention_cpu

    if not saved:
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(11)
    r, parts, x, s, d = 90, 3, 7, 16, 32
    q = torch.randn(r, d, generator=gen, requires_grad=True)
    keys, values = (torch.randn(x, s, d, generator=gen, requires_grad=True) for _ in range(2))
    expert = torch.randint(0, x, (parts, r), generator=gen)
    expert[2, :30] = x                       # no block in the third part of 30 queries
    key_ok = torch.rand(x, s, generator=gen) > 0.25
    key_ok[4] = False                        # a block of padding only
    weight = torch.randn(r, d, generator=gen)
    got = merged_attention_cpu(q, expert.flatten(), keys, values, key_ok, 0.2)
    part_out, lse = grouped_attention_cpu(q.repeat(parts, 1), expert.flatten(), keys, values, key_ok, 0.2, True)
    want = merge_cpu(part_out.view(parts, r, d), lse.view(parts, r), slot_major=True)
    assert torch.equal(got, want)
    got_grads = torch.autograd.grad((got * weight).sum(), [q, keys, values])
    want_grads = torch.autograd.grad((want * weight).sum(), [q, keys, values])
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-4
    assert torch.equal(got_grads[1][4], torch.zeros(s, d)) and torch.equal(got_grads[2][4], torch.zeros(s, d))


@needs_kernel
def test_moba_merges_its_parts_in_the_grouped_backward_and_gives_the_composed_results() -> None:
    # the backend's CPU path (parts merged inside the kernels' backward) against the same kernels
    # composed (queries repeated per part, lra::merge_parts and its backward): the same forward bits
    # at real rows; the merged path leaves padded queries out (output 0), the composed one attends
    # from them, so the loss reads real rows only, as a model's does
    from attentions.ops.grouped import merged_cpu

    gen = torch.Generator().manual_seed(3)
    attn = build_attention("moba", num_heads=2, head_dim=16, max_len=200, block_size=32, topk=3)
    q, k, v = (torch.randn(2, 2, 200, 16, generator=gen, requires_grad=True) for _ in range(3))
    mask = lengths_mask([200, 131], 200)
    weight = torch.randn(2, 2, 200, 16, generator=gen) * mask[:, None, :, None]
    calls = []
    real = merged_cpu.MergedPartsCPU.apply
    try:
        merged_cpu.MergedPartsCPU.apply = lambda *a: calls.append(1) or real(*a)
        got = attn(q, k, v, mask)
    finally:
        merged_cpu.MergedPartsCPU.apply = real
    assert calls
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v])
    composed = moba.takes
    try:
        moba.takes = lambda x: False
        want = attn(q, k, v, mask)
    finally:
        moba.takes = composed
    want_grads = torch.autograd.grad((want * weight).sum(), [q, k, v])
    real_rows = mask[:, None, :, None]
    assert torch.equal(got * real_rows, want * real_rows) and (got * ~real_rows == 0).all()
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 1e-5
