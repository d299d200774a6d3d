"""MiTA's default form as one autograd Function on the CPU kernels (attentions/ops/landmark/mita_layer_cpu.py) against
the composed path of the same kernels and against ``mita.reference``: outputs and q, k, v gradients,
with padding, rows shorter than the landmark count, a row with one real token, D not a multiple of
8, N not a multiple of the key block, and a gradient arriving as a strided view. Its forward's
preparation in one call (pooling, landmark pass, selection, routing a head at a time) against the
separate operators, and its backward operator, the grouped and landmark backward head by head,
against those two operators in turn."""
from __future__ import annotations

import pytest
import torch

import attentions.backends.mita as mita
from attentions import build_attention
from attentions.base import AttentionError
from attentions.ops import tuning
from attentions.ops.grouped import cpu as grouped_cpu
from attentions.ops.grouped.reference import expert_runs
from attentions.ops.landmark import cpu as landmark_cpu
from attentions.ops.landmark import mita_layer_cpu
from attentions.ops.landmark.mita_layer_cpu import MiTACPU, mita_backward
from conftest import lengths_mask, rel_err

needs_kernel = pytest.mark.skipif(bool(landmark_cpu.refusals(torch.zeros(1))),
                                  reason="the C kernels do not build here (no C compiler)")


def run(attn, q, k, v, mask, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, mask)
    grads = torch.autograd.grad((out * weight).sum(), [q, k, v])
    return [out.detach(), *grads]


@needs_kernel
@pytest.mark.parametrize("saved", [True, False], ids=["rows-saved", "rows-recomputed"])
@pytest.mark.parametrize("b, h, n, d, m, topk, lengths", [
    (2, 2, 1000, 32, 64, 64, [1000, 517]),  # LRA's settings, a padded row, N not a multiple of 64
    (3, 1, 200, 33, 16, 24, [200, 9, 1]),   # rows shorter than m, one with a single real token; odd D
    (1, 2, 50, 8, 64, 64, None),            # fewer tokens than landmarks, no mask
    (2, 3, 300, 16, 8, 8, None),            # several landmarks per key block, every key real
])
def test_fused_path_equals_composed_path_and_reference(monkeypatch, b, h, n, d, m, topk, lengths, saved) -> None:
    if not saved:
        # the grouped kernel's backward recomputes the softmax rows from the forward's log-sum-exps, as
        # above SAVE_ELEMENTS (G N (m + k) > 2^24: B = 1, H = 4 from N = 64K); the fused Function once
        # dropped those and the backward read freed memory there
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    mask = None if lengths is None else lengths_mask(lengths, n)
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    # the loss reads real rows only, as a model's does: the fused path leaves padded queries out (their
    # output 0), the others attend from them, and the gradients agree where no loss reads those rows
    weight = torch.randn(b, h, n, d, generator=gen) * real[:, None, :, None]
    attn = build_attention("mita", num_heads=h, head_dim=d, max_len=max(n, m), landmarks=m, topk=topk)
    calls = []
    real_apply = MiTACPU.apply
    monkeypatch.setattr(mita.MiTACPU, "apply", lambda *a: calls.append(1) or real_apply(*a))
    fused = run(attn, q, k, v, mask, weight)
    assert calls, "the default form on the CPU did not take the fused Function"
    monkeypatch.setattr(mita, "FUSED_CPU", False)
    composed = run(attn, q, k, v, mask, weight)
    assert len(calls) == 1
    ref = [t for t in run(lambda *a: mita.reference(*a, landmarks=m, topk=topk), q, k, v, mask, weight)]
    assert (fused[0] * ~real[:, None, :, None] == 0).all()  # padded queries: output 0
    for name, got, same, want in zip(("out", "dq", "dk", "dv"), fused, composed, ref):
        got, same, want = (t * real[:, None, :, None] for t in (got, same, want))  # padded rows are free
        assert torch.isfinite(got).all(), name
        assert rel_err(got, same) < 1e-5, (name, rel_err(got, same))
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


@needs_kernel
@pytest.mark.parametrize("lengths", [None, [300, 41]], ids=["unmasked", "padded"])
def test_queries_sorted_into_expert_order_or_read_in_place_give_the_same_bits(monkeypatch, lengths) -> None:
    # long rows are copied into expert order and gathered back; short ones read and written where they lie
    gen = torch.Generator().manual_seed(2)
    b, h, n, d = 2, 2, 300, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    weight = torch.randn(b, h, n, d, generator=gen)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention("mita", num_heads=h, head_dim=d, max_len=n, landmarks=16, topk=16)
    forms = {}
    for name, threshold in (("sorted", 0), ("in place", 1 << 40)):
        monkeypatch.setattr(mita_layer_cpu, "SORTED_ROWS_BYTES", threshold)
        assert mita_layer_cpu.sorted_rows(n, d) == (name == "sorted")
        forms[name] = run(attn, q, k, v, mask, weight)
    for what, a, c in zip(("out", "dq", "dk", "dv"), forms["sorted"], forms["in place"]):
        assert torch.equal(a, c), (what, float((a - c).abs().max()))


@needs_kernel
def test_fused_path_takes_a_strided_gradient_and_keeps_other_forms_composed(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 130, 16, generator=gen) for _ in range(3))
    attn = build_attention("mita", num_heads=2, head_dim=16, max_len=130, landmarks=8, topk=8)
    q.requires_grad_()
    out = attn(q, k, v)
    # a gradient that is a transposed view (the model's heads merge this way; read in place), the same
    # bits as that gradient made contiguous
    grad = torch.randn(1, 130, 2, 16, generator=gen).transpose(1, 2)
    (dq,) = torch.autograd.grad(out, [q], grad, retain_graph=True)
    assert torch.equal(dq, torch.autograd.grad(out, [q], grad.contiguous())[0])
    ref_q = q.detach().clone().requires_grad_()
    (ref_dq,) = torch.autograd.grad(mita.reference(ref_q, k, v, landmarks=8, topk=8), [ref_q], grad)
    assert rel_err(dq, ref_dq) < 1e-4
    # two experts per query, or no shared expert: the composed path
    calls = []
    monkeypatch.setattr(mita.MiTACPU, "apply", lambda *a: calls.append(1))
    for options in ({"experts_per_query": 2}, {"shared_expert": False}):
        other = build_attention("mita", num_heads=2, head_dim=16, max_len=130, landmarks=8, topk=8, **options)
        assert other(q, k, v).shape == q.shape
    assert not calls


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b, h, n, d, m, keys, lengths, sort", [
    (2, 2, 1000, 32, 64, 64, [1000, 517], False),  # LRA's settings, a padded row
    (3, 1, 200, 33, 16, 24, [200, 9, 1], False),    # rows shorter than m, a single real token; odd D
    (2, 3, 300, 16, 8, 8, None, True),              # no mask; the queries sorted into expert order
    (1, 2, 4500, 8, 16, 32, [4500], False),         # rows of 4K or more: the selection's filter path
    (2, 1, 600, 8, 4, 100, [600, 60], True),        # fewer real keys than an expert keeps: padded picks
])
def test_one_call_preparation_equals_the_separate_operators(b, h, n, d, m, keys, lengths, sort, threads) -> None:
    # steps 1-4 of the fused Function: lra::mita_prepare, a head at a time, against the operators it replaces
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b * h, n, d, generator=gen) for _ in range(3))
    mask = None if lengths is None else lengths_mask(lengths, n).view(torch.uint8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        one = mita_layer_cpu.mita_prepare(q, k, v, mask, h, m, keys, sort)
    finally:
        torch.set_num_threads(before)
    separate = mita_layer_cpu.prepare_composed(q, k, v, mask, h, m, keys, sort, mita.top_keys)
    for name, got, want in zip(mita_layer_cpu.PREPARED, one, separate):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@needs_kernel
@pytest.mark.parametrize("rows, error", [
    ([[1] * 20, [1] * 5 + [0, 1] + [0] * 13], "right-padded"),
    ([[0] * 20, [1] * 5 + [0, 1] + [0] * 13], "right-padded"),  # both wrong: the padding is named first
    ([[1] * 20, [0] * 20], "at least one real token"),
])
def test_one_call_preparation_refuses_the_masks_the_operators_refuse(rows, error) -> None:
    q = torch.randn(4, 20, 8)
    mask = torch.tensor(rows, dtype=torch.uint8)
    for prepare in (mita_layer_cpu.mita_prepare, lambda *a: mita_layer_cpu.prepare_composed(*a, mita.top_keys)):
        with pytest.raises(AttentionError, match=error):
            prepare(q, q, q, mask, 2, 3, 4, False)


def layer_backward_inputs(masked: bool, b: int = 2, h: int = 2, n: int = 70, d: int = 8, m: int = 3, s: int = 5,
                          seed: int = 0) -> tuple:
    """lra::mita_backward's arguments as MiTACPU makes them: G = b h heads of n tokens, m landmarks and
    experts per head, s keys per expert read by index from the expert's own head, the queries in
    expert order. masked: the second sequence padded (its last 9 tokens), a few routed keys masked,
    one landmark missing and the last two queries in no expert."""
    gen = torch.Generator().manual_seed(seed)
    g, scale = b * h, d ** -0.5
    q, k, v = (torch.randn(g * n, d, generator=gen) for _ in range(3))  # [G N, D]; q in expert order
    marks = torch.randn(g, m, d, generator=gen) * scale  # [G, m, D], the landmarks pre-scaled
    token_ok = None
    if masked:
        token_ok = torch.ones(b, n, dtype=torch.uint8)
        token_ok[1, -9:] = 0
    shared, scores, marks_lse = landmark_cpu.landmark_forward(marks, k.view(g, n, d), v.view(g, n, d), token_ok, h)
    head = torch.arange(g * m) // m  # [G m]
    rows = torch.stack([torch.randperm(n, generator=gen)[:s] for _ in range(g * m)]) + head[:, None] * n  # [G m, s]
    key_ok = shared_ok = None
    if masked:
        key_ok = (torch.rand(g * m, s, generator=gen) > 0.3).view(torch.uint8)
        key_ok[:, 0] = 1
        shared_ok = torch.ones(g, m, dtype=torch.uint8)
        shared_ok[1, -1] = 0
    expert = (torch.arange(g * n) // n) * m + torch.randint(0, m, (g * n,), generator=gen)  # [G N]
    if masked:
        expert[-2:] = g * m
    expert = expert.sort().values  # the queries in expert order: pair p is row p
    order, offsets = expert_runs(expert, g * m)
    out, lse, probs = grouped_cpu.grouped_forward(q, k, v, marks, shared, rows, key_ok, shared_ok, order, offsets, m,
                                                  scale, m)
    d_out = torch.randn(g * n, d, generator=gen)
    return (q, k, v, marks, shared, rows, key_ok, shared_ok, order, offsets, out, lse, probs, d_out, token_ok, scores,
            marks_lse, h, scale)


@needs_kernel
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_layer_backward_reads_the_merged_heads_gradient_in_place(masked) -> None:
    # d_out in the layout of the model's heads merge, [B, N, H, D], read where it lies: the same bits
    # as its copy into [G N, D]
    b, h, n, d = 2, 3, 70, 8
    args = layer_backward_inputs(masked, b=b, h=h, n=n, d=d)
    d_out = args[13]
    merged = d_out.view(b, h, n, d).transpose(1, 2).contiguous()  # [B, N, H, D]
    plain = mita_backward(*args)
    in_place = mita_backward(*args[:13], merged, *args[14:], merged_d_out=True)
    for name, got, want in zip(("dq", "dk", "dv", "d marks"), in_place, plain):
        assert torch.equal(got, want), name


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("saved", [True, False], ids=["rows-saved", "rows-recomputed"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_layer_backward_equals_the_grouped_then_the_landmark_backward(monkeypatch, masked, saved, threads) -> None:
    if not saved:
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
    torch.set_num_threads(threads)
    args = layer_backward_inputs(masked)
    (q, k, v, marks, shared, rows, key_ok, shared_ok, order, offsets, out, lse, probs, d_out, token_ok, scores,
     marks_lse, h, scale) = args
    assert probs.shape[1] == (8 if saved else 0)
    g, m, d = marks.shape
    dq, dk, dv, d_marks, d_shared = grouped_cpu.grouped_backward(*args[:13], d_out, None, m, scale, m)
    landmark_cpu.landmark_backward_add(marks, k.view(g, -1, d), v.view(g, -1, d), token_ok, scores, marks_lse, shared,
                                       d_shared, h, d_marks, dk.view(g, -1, d), dv.view(g, -1, d))
    got = mita_backward(*args)
    for name, a, want in zip(("dq", "d keys", "d values", "d marks"), got, (dq, dk, dv, d_marks)):
        assert torch.equal(a, want), (name, float((a - want).abs().max()))
    # with the pooling's bins (the pairs are in query order here), the pooling's backward in the same
    # call: d marks scaled and spread over dq, the same bits as the operator run after the call
    n = q.shape[0] // g
    starts, ends, _ = landmark_cpu.kernel_bins(None if token_ok is None else token_ok.bool(), g // h, n, m, q.device)
    pooled = mita_backward(*args, starts, ends)
    dq_after = got[0].clone()
    landmark_cpu.pool_bins_backward_add(got[3] * scale, starts, ends, h, dq_after.view(g, n, d))
    assert not torch.equal(dq_after, got[0])
    assert torch.equal(pooled[0], dq_after) and torch.equal(pooled[3], got[3] * scale)
    assert torch.equal(pooled[1], got[1]) and torch.equal(pooled[2], got[2])
    if masked:
        assert (got[0][-2:] == 0).all()  # pairs with no expert
