"""The C kernels as torch.library operators: ``torch.library.opcheck`` (schema, fake tensors, autograd
registration, AOT dispatch with dynamic shapes) passes for every ``lra::`` operator on small inputs,
the profiler names them, and their autograd saves tensors, not kernel argument blocks."""
from __future__ import annotations

from typing import Callable, List, Tuple

import pytest
import torch

from attentions.ops.block_gate import cpu as gate
from attentions.ops.grouped import cpu as grouped
from attentions.ops.grouped.reference import expert_runs
from attentions.ops.landmark import cpu as landmark
from attentions.ops.landmark import mita_layer_cpu
from attentions.ops.row_products import cpu as rows
from attentions.ops.topk_attention import cpu as topk_attention
from attentions.ops.topk_selection import cpu as selection
from attentions.ops.ttt import cpu as ttt
from lra.model import dropout, gelu_dropout, layer_norm
from test_mita_cpu import layer_backward_inputs

needs_kernels = pytest.mark.skipif(not grouped.takes(torch.zeros(0)), reason="the C kernels do not build here")


def randn(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).requires_grad_(grad)


GEN = torch.Generator().manual_seed(0)


def grouped_inputs(shared: bool, masked: bool, by_rows: bool, grad: bool) -> tuple:
    """lra::grouped_forward's arguments: 20 pairs over 3 experts of 4 keys (a pair with no expert),
    D = 8; a shared table of 2 keys per group of 3 experts; key masks; the keys read by index."""
    p, x, s, d = 20, 3, 4, 8
    expert = torch.randint(0, x + 1, (p,), generator=GEN)
    order, offsets = expert_runs(expert, x)
    keys, values = (randn(10, d, grad=grad) for _ in range(2)) if by_rows else (randn(x, s, d, grad=grad)
                                                                               for _ in range(2))
    index = torch.randint(0, 10, (x, s), generator=GEN) if by_rows else None
    key_ok = (torch.rand(x, s, generator=GEN) > 0.3).view(torch.uint8) if masked else None
    if key_ok is not None:
        key_ok[:, 0] = 1
    shared_keys, shared_values = (randn(1, 2, d, grad=grad) for _ in range(2)) if shared else (None, None)
    shared_ok = torch.tensor([[1, 0]], dtype=torch.uint8) if shared and masked else None
    # a unit holds every expert that may share a key row with another (the kernel's contract: two
    # threads never add into one gradient row): with rows read by index, all three
    group, unit = (3, 3) if shared else (1, x if by_rows else 1)
    return (randn(p, d, grad=grad), keys, values, shared_keys, shared_values, index, key_ok, shared_ok, order,
            offsets, group, 0.35, unit)


def landmark_inputs(masked: bool, grad: bool) -> tuple:
    """lra::landmark_forward's arguments: 2 sequences x 2 heads, 3 landmarks, 10 keys, D = 8."""
    key_ok = torch.tensor([[1] * 10, [1] * 6 + [0] * 4], dtype=torch.uint8) if masked else None
    return randn(4, 3, 8, grad=grad), randn(4, 10, 8, grad=grad), randn(4, 10, 8, grad=grad), key_ok, 2


def pool_bounds() -> Tuple[torch.Tensor, torch.Tensor]:
    starts, ends, _ = landmark.kernel_bins(torch.arange(10)[None, :] < torch.tensor([[10], [7]]), 2, 10, 3,
                                           torch.device("cpu"))
    return starts, ends


def cases() -> List[Tuple[str, Callable, tuple]]:
    out = []
    for shared in (False, True):
        for masked in (False, True):
            for by_rows in (False, True):
                label = f"shared{int(shared)}-masked{int(masked)}-rows{int(by_rows)}"
                args = grouped_inputs(shared, masked, by_rows, grad=True)
                out.append((f"grouped_forward-{label}", grouped.grouped_forward, args))
                plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                o, lse, probs = grouped.grouped_forward(*plain)
                backward = (*plain[:10], o, lse, probs, randn(*o.shape), randn(*lse.shape), *plain[10:])
                out.append((f"grouped_backward-{label}", grouped.grouped_backward, backward))
    # a query's parts as pairs p = e R + r (query_rows R = 10: 2 parts of 10 queries), their backward
    # per pair and with the merge folded in (the merged rows and the merge's weights)
    args = grouped_inputs(False, True, False, grad=True)
    parted = (randn(10, 8, grad=True), *args[1:], 10)
    out.append(("grouped_forward-query_rows", grouped.grouped_forward, parted))
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in parted)
    o, lse, probs = grouped.grouped_forward(*plain)
    out.append(("grouped_backward-query_rows", grouped.grouped_backward,
                (*plain[:10], o, lse, probs, randn(*o.shape), randn(*lse.shape), *plain[10:])))
    merged, weights = grouped.merge_parts(o.view(2, 10, 8), lse.view(2, 10), True)
    out.append(("grouped_backward-merged", grouped.grouped_backward,
                (*plain[:10], merged, lse, probs, randn(10, 8), None, *plain[10:], weights)))
    for slot_major in (False, True):
        parts, lse = randn(6, 3, 8, grad=True), randn(6, 3, grad=True)
        if slot_major:
            parts, lse = randn(3, 6, 8, grad=True), randn(3, 6, grad=True)
        out.append((f"merge_parts-slot_major{int(slot_major)}", grouped.merge_parts, (parts, lse, slot_major)))
        o, w = grouped.merge_parts(parts.detach(), lse.detach(), slot_major)
        out.append((f"merge_parts_backward-slot_major{int(slot_major)}", grouped.merge_parts_backward,
                    (parts.detach(), lse.detach(), o, w, randn(6, 8), slot_major)))
    out.append(("take_rows", grouped.take_rows_op, (randn(10, 8), torch.tensor([3, 0, 9, 3, 1]))))
    out.append(("expert_runs", grouped.expert_runs_op, (torch.tensor([2, 0, 3, 2, 1, 0]), 3)))
    starts, ends = pool_bounds()
    out.append(("pool_bins", landmark.pool_bins, (randn(4, 10, 8, grad=True), starts, ends, 2)))
    out.append(("pool_bins_backward", landmark.pool_bins_backward, (randn(4, 3, 8), starts, ends, 2, 10)))
    out.append(("pool_bins_backward_add", landmark.pool_bins_backward_add, (randn(4, 3, 8), starts, ends, 2,
                                                                            randn(4, 10, 8))))
    for masked in (False, True):
        args = landmark_inputs(masked, grad=True)
        out.append((f"landmark_forward-masked{int(masked)}", landmark.landmark_forward, args))
        plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        shared, scores, lse = landmark.landmark_forward(*plain)
        backward = (*plain[:4], scores, lse, shared, randn(4, 3, 8), 2)
        out.append((f"landmark_backward-masked{int(masked)}", landmark.landmark_backward, backward))
        out.append((f"landmark_backward_add-masked{int(masked)}", landmark.landmark_backward_add,
                    (*backward, randn(4, 3, 8), randn(4, 10, 8), randn(4, 10, 8))))
    for masked in (False, True):
        out.append((f"mita_backward-masked{int(masked)}", mita_layer_cpu.mita_backward,
                    layer_backward_inputs(masked, b=2, h=1, n=20, m=2, s=3)))
    # with the pooling's backward in the same call: the bins of 2 sequences of 20 tokens, 2 landmarks
    bins = landmark.kernel_bins(None, 2, 20, 2, torch.device("cpu"))[:2]
    out.append(("mita_backward-pooled", mita_layer_cpu.mita_backward,
                (*layer_backward_inputs(False, b=2, h=1, n=20, m=2, s=3), *bins)))
    # d_out in the heads-merged layout [B, N, H, D]: 2 sequences x 2 heads
    merged = layer_backward_inputs(True, b=2, h=2, n=20, m=2, s=3)
    merged = (*merged[:13], merged[13].view(2, 2, 20, 8).transpose(1, 2).contiguous(), *merged[14:], None, None, True)
    out.append(("mita_backward-merged", mita_layer_cpu.mita_backward, merged))
    # 2 sequences x 2 heads of 20 tokens, 3 landmarks of 4 keys; the second sequence 13 tokens long
    mask = (torch.arange(20)[None] < torch.tensor([[20], [13]])).view(torch.uint8)
    for masked in (False, True):
        for sort in (False, True):
            out.append((f"mita_prepare-masked{int(masked)}-sorted{int(sort)}", mita_layer_cpu.mita_prepare,
                        (randn(4, 20, 8), randn(4, 20, 8), randn(4, 20, 8), mask if masked else None, 2, 3, 4, sort)))
    out.append(("route_best", landmark.route_best_op, (randn(4, 10, 8), randn(4, 3, 8), None)))
    out.append(("route_best-masked", landmark.route_best_op,
                (randn(4, 10, 8), randn(4, 3, 8), torch.tensor([[1, 0, 1]] * 3 + [[0, 0, 0]], dtype=torch.uint8))))
    out.append(("route_order", landmark.route_order_op, (randn(4, 10, 8), randn(4, 3, 8), None)))
    out.append(("route_order-unsorted", landmark.route_order_op, (randn(4, 10, 8), randn(4, 3, 8), None, False)))
    out.append(("route_order-masked", landmark.route_order_op,
                (randn(4, 10, 8), randn(4, 3, 8), torch.tensor([[1, 0, 1]] * 3 + [[0, 0, 0]], dtype=torch.uint8))))
    out.append(("topk_select", selection.topk_rows, (randn(2, 3, 40), 7)))
    bias = torch.zeros(2, 1, 1, 30).masked_fill(torch.arange(30) >= 20, float("-inf"))
    for masked in (False, True):
        out.append((f"topk_attention-masked{int(masked)}", topk_attention.topk_attention,
                    (randn(2, 2, 9, 8), randn(2, 2, 8, 30), randn(2, 2, 30, 8), bias if masked else None, 5)))
    w, idx = randn(6, 4), torch.randint(0, 5, (6, 4), generator=GEN)
    out.append(("mix_rows", rows.mix_rows, (w, idx, randn(10, 8), 3, 5)))
    out.append(("dot_rows", rows.dot_rows, (randn(6, 8), idx, randn(10, 8), 3, 5)))
    out.append(("scatter_outer", rows.scatter_outer_op, (w, idx, randn(6, 8), torch.zeros(10, 8), 3, 5)))
    empty = torch.tensor([[0, 0, 0, 1], [0, 1, 1, 1]], dtype=torch.uint8)
    for own in (False, True):
        out.append((f"block_gate-own{int(own)}", gate.block_gate, (randn(2, 2, 13, 8), randn(2, 2, 4, 8), empty, 4,
                                                                   2, own)))
    out.append(("dropout", dropout.dropout_op, (randn(4, 16, grad=True), 0.3, torch.tensor(12345))))
    out.append(("gelu_dropout", gelu_dropout.gelu_dropout_op, (randn(4, 16, grad=True), 0.3, torch.tensor(12345))))
    out.append(("gelu_dropout_backward", gelu_dropout.gelu_dropout_backward,
                (randn(4, 16), randn(4, 16), 0.3, torch.tensor(12345))))
    x, weight, bias = randn(3, 5, 20, grad=True), randn(20, grad=True), randn(20, grad=True)
    out.append(("layer_norm", layer_norm.layer_norm_op, (x, weight, bias, 1e-5)))
    _, mean, rstd = layer_norm.layer_norm_op(x.detach(), weight.detach(), bias.detach(), 1e-5)
    out.append(("layer_norm_backward", layer_norm.layer_norm_backward,
                (randn(3, 5, 20), x.detach(), mean, rstd, weight.detach())))
    for hidden in (0, 8):
        # 3 groups of 2 mini-batches of 4 tokens, D = 4 (the MLP 8 hidden units)
        q, k, v = (randn(3, 2, 4, 4, grad=True) for _ in range(3))
        lr = (0.1 * torch.rand(3, 2, 4, generator=GEN)).requires_grad_()
        ts = (1.0 / torch.arange(1, 5)).requires_grad_()
        w0 = (0.3 * randn(3, ttt.state_size(4, hidden))).requires_grad_()
        lnw, lnb = (1.0 + 0.1 * randn(3, 4)).requires_grad_(), randn(3, 4, grad=True)
        args = (q, k, v, lr, ts, w0, lnw, lnb, 1e-6, hidden, True)
        out.append((f"ttt_forward-hidden{hidden}", ttt.ttt_forward, args))
        plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        o, states, saved = ttt.ttt_forward(*plain)
        out.append((f"ttt_backward-hidden{hidden}", ttt.ttt_backward,
                    (*plain[:5], *plain[6:8], states, saved, randn(*o.shape), 1e-6, hidden)))
    return out


CASES = cases() if grouped.takes(torch.zeros(0)) else []


@needs_kernels
@pytest.mark.parametrize("name, op, args", CASES, ids=[c[0] for c in CASES])
def test_opcheck(name: str, op, args: tuple) -> None:
    torch.library.opcheck(op, args)


@needs_kernels
def test_every_kernel_entry_is_an_operator_in_one_namespace() -> None:
    names = {c[0].split("-")[0] for c in CASES}
    assert names == {"grouped_forward", "grouped_backward", "merge_parts", "merge_parts_backward", "take_rows",
                     "expert_runs", "pool_bins", "pool_bins_backward", "pool_bins_backward_add", "landmark_forward",
                     "landmark_backward", "landmark_backward_add", "mita_backward", "mita_prepare", "route_best",
                     "route_order", "topk_select", "topk_attention", "mix_rows", "dot_rows", "scatter_outer",
                     "block_gate", "dropout", "gelu_dropout", "gelu_dropout_backward", "layer_norm", "layer_norm_backward", "ttt_forward", "ttt_backward"}
    for name in names:
        assert hasattr(torch.ops.lra, name), name


@needs_kernels
def test_the_profiler_names_the_operators_of_a_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from attentions import build_attention

    q, k, v = (torch.randn(2, 2, 128, 16, requires_grad=True) for _ in range(3))
    seen = set()
    # MiTA with two experts a query merges its parts by lra::merge_parts (MoBA's merge is folded into
    # its grouped backward); MiTA's layer gathers its rows by lra::take_rows where it sorts them (long
    # rows: every row here) and prepares its experts in one lra::mita_prepare, or, where the experts
    # hold every key (topk >= N), by the separate operators (lra::route_order among them)
    monkeypatch.setattr(mita_layer_cpu, "SORTED_ROWS_BYTES", 0)
    for name, options in (("mita", {"landmarks": 8, "topk": 8}), ("mita", {"landmarks": 8, "topk": 128}),
                          ("mita", {"landmarks": 8, "topk": 8, "experts_per_query": 2}),
                          ("moba", {"block_size": 16, "topk": 3}), ("topk", {"topk": 8}), ("ttt_mlp", {})):
        attn = build_attention(name, num_heads=2, head_dim=16, max_len=128, **options)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            attn(q, k, v).sum().backward()
        seen |= {e.key for e in prof.key_averages() if e.key.startswith("lra::")}
    assert {"lra::mita_prepare", "lra::pool_bins", "lra::landmark_forward", "lra::route_order", "lra::topk_select",
            "lra::take_rows",
            "lra::grouped_forward", "lra::grouped_backward", "lra::mita_backward",
            "lra::pool_bins_backward_add", "lra::block_gate", "lra::expert_runs", "lra::merge_parts",
            "lra::merge_parts_backward", "lra::topk_attention", "lra::mix_rows", "lra::dot_rows", "lra::scatter_outer",
            "lra::ttt_forward", "lra::ttt_backward"} <= seen, sorted(seen)
