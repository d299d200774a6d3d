"""MiTA's pooling, landmark pass and routing on the C kernel (attentions/ops/landmark/cpu.py) against the
PyTorch path they replace: landmarks, scores, shared values and the gradients, padding, landmark
counts that do not fill a pair, lengths that do not fill a key block, a softmax max that moves from
block to block, a landmark whose keys are all masked, the routing's ties and missing landmarks, and
the grouping of the routed queries by expert, and the same bits for any thread count."""
from __future__ import annotations

import math

import pytest
import torch

from attentions import build_attention
from attentions.ops.landmark import cpu as landmark_cpu
from attentions.ops.landmark import reference
from attentions.ops.grouped.reference import expert_runs
from attentions.ops.landmark.cpu import landmark_pass, pool_queries, route_best, route_order
from attentions.masking import pool_real
from conftest import lengths_mask, rel_err

needs_kernel = pytest.mark.skipif(bool(landmark_cpu.refusals(torch.zeros(1))),
                                  reason="the C kernels do not build here (no C compiler)")


def pass_and_grads(fn, marks, k, v, mask, weight):
    shared, scores = fn(marks, k, v, mask)
    grads = torch.autograd.grad((shared * weight).sum(), [marks, k, v])
    return [scores.detach(), shared.detach(), *grads]


@needs_kernel
@pytest.mark.parametrize("b, h, m, n, d, lengths", [
    (2, 2, 64, 1000, 32, [1000, 517]),  # LRA's settings, a padded row, N not a multiple of the block
    (1, 3, 7, 130, 16, None),           # an odd landmark count: the last pair is one landmark
    (2, 1, 1, 64, 33, [64, 1]),         # one landmark, D not a multiple of 8, a row with one real key
    (1, 2, 5, 3, 8, None),              # fewer keys than one block
])
def test_landmark_pass_matches_torch(b, h, m, n, d, lengths) -> None:
    gen = torch.Generator().manual_seed(0)
    marks = (torch.randn(b, h, m, d, generator=gen) / math.sqrt(d)).requires_grad_()
    k, v = (torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(2))
    mask = None if lengths is None else lengths_mask(lengths, n)
    weight = torch.randn(b, h, m, d, generator=gen)
    got = pass_and_grads(landmark_pass, marks, k, v, mask, weight)
    ref = pass_and_grads(reference.landmark_pass, marks, k, v, mask, weight)
    for label, g, r in zip(["scores", "shared", "d_marks", "dk", "dv"], got, ref):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), f"{label}: -inf in other places"
        assert rel_err(g[finite], r[finite]) < 1e-5, label
    if mask is not None:
        # padded keys get no gradient
        assert got[3][~mask[:, None, :, None].expand_as(k)].abs().max() == 0


@needs_kernel
@pytest.mark.parametrize("ramp", ["rising", "falling"])
def test_the_one_pass_softmax_follows_a_max_that_moves_across_key_blocks(ramp) -> None:
    # the forward keeps a running max per landmark over blocks of 64 keys: with scores that grow
    # along the keys the shared values are rescaled at every block; with scores that fall, never
    gen = torch.Generator().manual_seed(0)
    n = 1000
    growth = torch.linspace(0.2, 4.0, n) if ramp == "rising" else torch.linspace(4.0, 0.2, n)
    # landmarks and keys positive: every score positive, so the block maxima move with the ramp
    marks = (torch.randn(1, 2, 9, 16, generator=gen).abs() / 4).requires_grad_()
    k = (torch.randn(1, 2, n, 16, generator=gen).abs() * growth[:, None]).requires_grad_()
    v = torch.randn(1, 2, n, 16, generator=gen).requires_grad_()
    weight = torch.randn(1, 2, 9, 16, generator=gen)
    got = pass_and_grads(landmark_pass, marks, k, v, lengths_mask([900], n), weight)
    ref = pass_and_grads(reference.landmark_pass, marks, k, v, lengths_mask([900], n), weight)
    for label, g, r in zip(["scores", "shared", "d_marks", "dk", "dv"], got, ref):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), finite), f"{label}: -inf in other places"
        assert rel_err(g[finite], r[finite]) < 1e-5, label


@needs_kernel
def test_a_landmark_with_every_key_masked_gives_zeros_not_nan() -> None:
    # (a row with no real token; PyTorch's softmax gives NaN there)
    marks = torch.randn(2, 1, 4, 8, requires_grad=True)
    k, v = (torch.randn(2, 1, 10, 8, requires_grad=True) for _ in range(2))
    mask = lengths_mask([10, 0], 10)
    shared, scores = landmark_pass(marks, k, v, mask)
    shared.sum().backward()
    assert torch.isneginf(scores[1]).all() and torch.equal(shared[1], torch.zeros_like(shared[1]))
    for grad in (marks.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all() and grad[1].abs().max() == 0 and grad[0].abs().max() > 0


@needs_kernel
@pytest.mark.parametrize("m", [9, 10, 23])
def test_routing_matches_argmax_with_ties_and_missing_landmarks(m: int) -> None:
    # the kernel scores landmarks six, then four, then one at a time: 9, 10 and 23 take each tail
    gen = torch.Generator().manual_seed(0)
    g, n, d = 4, 301, 16
    q, marks = torch.randn(g, n, d, generator=gen), torch.randn(g, m, d, generator=gen)
    marks[:, 5] = marks[:, 2]  # a tie between landmarks 2 and 5: the first wins, as in torch.argmax
    marks[:, m - 1] = marks[:, 3]  # and one across the groups the kernel scores together
    real = torch.rand(g, m, generator=gen) > 0.3
    real[:, 2] = real[:, 3] = True
    real[3] = False  # a head with no real landmark
    best = route_best(q, marks, real)
    assert torch.equal(best, reference.route_best(q, marks, real))
    assert (best[3] == -1).all()
    assert (best[:3] != 5).all() and (best[:3] != m - 1).all()
    assert torch.equal(route_best(q, marks, None), reference.route_best(q, marks, None))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_route_order_groups_the_queries_as_expert_runs_does(threads: int) -> None:
    gen = torch.Generator().manual_seed(1)
    g, n, m, d = 5, 203, 7, 16
    q, marks = torch.randn(g, n, d, generator=gen), torch.randn(g, m, d, generator=gen)
    marks[:, 4] = marks[:, 1]  # a tie: landmark 1 takes the queries, expert 4 of each head stays empty
    real = torch.rand(g, m, generator=gen) > 0.3
    real[:, 1] = True
    real[2] = False  # a head with no real landmark: its queries go after every expert, in query order
    best = reference.route_best(q, marks, real)  # [G, N]
    heads = torch.arange(g)[:, None]
    expected_order, expected_offsets = expert_runs(torch.where(best >= 0, best + heads * m, g * m).flatten(), g * m)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        order, offsets, inverse, ordered = route_order(q, marks, real)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(order, expected_order)
    assert torch.equal(offsets, expected_offsets)
    assert torch.equal(inverse[order], torch.arange(g * n))
    assert torch.equal(ordered, q.reshape(g * n, d)[expected_order])
    # with the padding mask (heads 0-4 as one sequence each): the padded queries join no expert, after
    # every run in query order, and the real ones keep their experts
    mask = torch.ones(g, n, dtype=torch.bool)
    mask[0, 150:] = False
    padded = route_order(q, marks, real, sort_rows=False, mask=mask)
    expected_order, expected_offsets = expert_runs(
        torch.where((best >= 0) & mask, best + heads * m, g * m).flatten(), g * m)
    assert torch.equal(padded[0], expected_order) and torch.equal(padded[1], expected_offsets)
    assert torch.equal(padded[0][padded[1][g * m]:][:n - 150], torch.arange(150, n))
    # without the sorted rows: the same grouping, no inverse and no copy of the queries made
    unsorted = route_order(q, marks, real, sort_rows=False)
    assert torch.equal(unsorted[0], order) and torch.equal(unsorted[1], offsets)
    assert unsorted[2].shape == (0,) and unsorted[3].shape == (0, d)
    assert offsets[g * m] == g * n - n  # head 2's queries are the only ones with no expert
    assert torch.equal(order[offsets[g * m]:], torch.arange(2 * n, 3 * n))
    # every landmark real (no mask given): the same as with an all-True mask
    all_real = route_order(q, marks, torch.ones(g, m, dtype=torch.bool))
    assert all(torch.equal(x, y) for x, y in zip(route_order(q, marks, None), all_real))


@needs_kernel
def test_landmark_kernels_give_the_same_bits_with_one_or_two_threads() -> None:
    gen = torch.Generator().manual_seed(0)
    marks = torch.randn(3, 2, 64, 32, generator=gen).requires_grad_()
    k, v = (torch.randn(3, 2, 700, 32, generator=gen).requires_grad_() for _ in range(2))
    mask, weight = lengths_mask([700, 400, 9], 700), torch.randn(3, 2, 64, 32, generator=gen)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(pass_and_grads(landmark_pass, marks, k, v, mask, weight)
                           + [route_best(k.detach().reshape(6, 700, 32), marks.detach().reshape(6, 64, 32), None)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@needs_kernel
def test_mita_selects_the_same_keys_in_selected_keys_and_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    # selected_keys (the analyses) selects through mita.top_keys on the selection kernel, the forward
    # inside lra::mita_prepare with the same kernel code: the same keys, in the same order
    import attentions.backends.mita as mita
    from attentions.ops.landmark import mita_layer_cpu

    attn = build_attention("mita", num_heads=2, head_dim=16, max_len=300, landmarks=8, topk=8)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 300, 16, generator=gen) for _ in range(3))
    mask = lengths_mask([300, 200], 300)
    seen = []
    real_grouped = mita_layer_cpu.grouped_forward
    # the grouped attention's key rows: expert g m + j reads rows g N + index[g, j] of [G N, D]
    monkeypatch.setattr(mita_layer_cpu, "grouped_forward", lambda *a: seen.append(a[5]) or real_grouped(*a))
    index, _ = attn.selected_keys(q, k, mask)
    attn(q, k, v, mask)
    heads = torch.arange(4)[:, None, None] * 300
    assert torch.equal(seen[0].view(4, 8, 8) - heads, index.view(4, 8, 8))


@needs_kernel
@pytest.mark.parametrize("n, d, bins, lengths", [
    (1000, 32, 64, [1000, 517, 40]),  # padded rows; one shorter than the bin count (one bin per token)
    (67, 12, 8, None),                # no mask, bins that overlap (67 tokens in 8 bins)
    (100, 8, 64, [100, 3]),
])
def test_pooled_landmarks_match_pool_real(n, d, bins, lengths) -> None:
    gen = torch.Generator().manual_seed(0)
    b = 1 if lengths is None else len(lengths)
    q = torch.randn(b, 2, n, d, generator=gen).requires_grad_()
    mask = None if lengths is None else lengths_mask(lengths, n)
    weight = torch.randn(b, 2, bins, d, generator=gen)
    got, got_real = pool_queries(q, mask, bins)
    ref, ref_real = pool_real(q, mask, bins)
    assert torch.equal(got_real, ref_real)
    assert rel_err(got, ref) < 1e-6
    got_grad, = torch.autograd.grad((got * weight).sum(), q)
    ref_grad, = torch.autograd.grad((ref * weight).sum(), q)
    assert rel_err(got_grad, ref_grad) < 1e-6
