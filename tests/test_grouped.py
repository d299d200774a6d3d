"""The PyTorch form of grouped attention (attentions/ops/grouped/reference.py) against a loop over pairs written here: every
tile size, weights kept or recomputed in chunks, empty experts, experts of one pair, pairs with no
expert, masked keys, shared tables; outputs, log-sum-exps and gradients in float64."""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from attentions.ops import tuning
from attentions.ops.grouped import reference as grouped
from attentions.ops.grouped.reference import gather_rows, grouped_attention, merge, pick_tile, tile_by_expert
from conftest import rel_err


def loop_reference(q, expert, keys, values, key_ok, scale, shared):
    """Each pair alone: one softmax over its shared rows (if any) and its expert's real keys."""
    outs, lses = [], []
    for p in range(q.shape[0]):
        e = int(expert[p])
        if e == keys.shape[0]:
            outs.append(torch.zeros_like(q[p]))
            lses.append(torch.tensor(float("-inf"), dtype=q.dtype))
            continue
        ks, vs = keys[e], values[e]
        ok = torch.ones(ks.shape[0], dtype=torch.bool) if key_ok is None else key_ok[e]
        if shared is not None:
            s_keys, s_values, s_ok, group = shared
            g = e // group
            ks, vs = torch.cat([s_keys[g], ks]), torch.cat([s_values[g], vs])
            ok = torch.cat([torch.ones(s_keys.shape[1], dtype=torch.bool) if s_ok is None else s_ok[g], ok])
        logits = (scale * (ks @ q[p])).masked_fill(~ok, float("-inf"))
        outs.append(logits.softmax(0) @ vs)
        lses.append(logits.logsumexp(0))
    return torch.stack(outs), torch.stack(lses)


def make_case(pairs: int, experts: int, keys: int, d: int, masked: bool, with_shared: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # skewed routing: some experts get many pairs, some one, some none; a few pairs get no expert
    weights = torch.rand(experts, generator=gen) ** 4
    weights[0] = 0.0
    expert = torch.multinomial(weights, pairs, replacement=True, generator=gen)
    expert[torch.rand(pairs, generator=gen) < 0.05] = experts
    single = int(weights[1:].argmin()) + 1
    expert[expert == single] = experts
    expert[0] = single
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, table_k, table_v = rand(pairs, d), rand(experts, keys, d), rand(experts, keys, d)
    key_ok = None
    if masked:
        key_ok = torch.rand(experts, keys, generator=gen) > 0.3
        key_ok[:, 0] = True
    shared = None
    if with_shared:
        group = 4
        groups = -(-experts // group)
        s_ok = torch.rand(groups, 5, generator=gen) > 0.3 if masked else None
        shared = (rand(groups, 5, d), rand(groups, 5, d), s_ok, group)
    return q, expert, table_k, table_v, key_ok, shared


CASES = {
    f"P{p}-X{x}-S{s}-D{d}{'-masked' if m else ''}{'-shared' if sh else ''}": (p, x, s, d, m, sh)
    for p, x, s, d, m, sh in [
        (300, 12, 7, 8, False, False),
        (300, 12, 7, 8, True, False),
        (257, 9, 16, 4, True, True),
        (64, 40, 5, 8, False, True),
    ]
}


@pytest.mark.parametrize("keep", [True, False], ids=["weights-kept", "chunks-recomputed"])
@pytest.mark.parametrize("tile", [None, *grouped.TILES], ids=["tile-auto", *[f"tile{t}" for t in grouped.TILES]])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_loop_over_pairs(case: tuple, tile: Optional[int], keep: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not keep:
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
        monkeypatch.setattr(tuning, "CHUNK_SLOTS", 2 * grouped.MIN_TILE)
    q, expert, keys, values, key_ok, shared = make_case(*case, seed=7)
    inputs = [q, keys, values] + ([shared[0], shared[1]] if shared is not None else [])
    for t in inputs:
        t.requires_grad_()
    scale = 1 / math.sqrt(q.shape[1])
    out, lse = grouped_attention(q, expert, keys, values, key_ok, scale, True, shared, tile=tile)
    ref_out, ref_lse = loop_reference(q, expert, keys, values, key_ok, scale, shared)
    assert rel_err(out, ref_out) < 1e-12
    routed = expert < keys.shape[0]
    assert torch.equal(torch.isinf(lse), ~routed) and rel_err(lse[routed], ref_lse[routed]) < 1e-12
    weight = torch.randn_like(out)
    lse_weight = torch.randn_like(lse) * routed
    grads = torch.autograd.grad((out * weight).sum() + (lse.nan_to_num(0, 0, 0) * lse_weight).sum(), inputs)
    ref_grads = torch.autograd.grad(
        (ref_out * weight).sum() + (ref_lse.nan_to_num(0, 0, 0) * lse_weight).sum(), inputs
    )
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_err(g, r) < 1e-10, f"gradient of input {i} differs"


def test_every_expert_holding_one_pair() -> None:
    q, _, keys, values, _, _ = make_case(20, 20, 6, 8, False, False, seed=3)
    expert = torch.randperm(20)
    out, lse = grouped_attention(q, expert, keys, values, None, 0.5, True)
    ref_out, ref_lse = loop_reference(q, expert, keys, values, None, 0.5, None)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    assert tile_by_expert(expert, 20).tile == grouped.TILES[0]


def test_tile_size_follows_the_pairs_per_expert() -> None:
    # a few pairs per expert: the smallest tile; thousands: the largest (less padding vs fewer tiles)
    assert pick_tile(torch.full((100,), 3)) == grouped.TILES[0]
    assert pick_tile(torch.full((100,), 5000)) == grouped.TILES[-1]
    # every pair sits in a tile of its own expert, each slot holds at most one pair
    expert = torch.tensor([2, 0, 2, 2, 5, 0, 2])
    tiling = tile_by_expert(expert, 6, tile=2)
    assert torch.equal(tiling.expert, torch.tensor([0, 2, 2, 5]))
    assert torch.equal(tiling.expert.repeat_interleave(2)[tiling.slot], expert)
    assert sorted(tiling.source[~tiling.empty].tolist()) == list(range(7))


def test_gather_rows_adds_repeated_rows_gradients() -> None:
    table = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([[3, 3, 9], [0, 3, 1]])
    out = gather_rows(table, rows)
    assert torch.equal(out, table[rows])
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weight).sum(), table)
    (ref,) = torch.autograd.grad((table[rows] * weight).sum(), table)
    assert rel_err(grad, ref) < 1e-14


def test_merge_of_parts_without_expert_is_zero() -> None:
    out = torch.randn(3, 2, 4)
    lse = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")], [1.0, 2.0]])
    merged = merge(out, lse)
    assert torch.isfinite(merged).all() and torch.equal(merged[1], torch.zeros(4))
    assert torch.allclose(merged[0], out[0, 0])
