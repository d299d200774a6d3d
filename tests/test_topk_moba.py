"""Top-k and MoBA: fast paths against their references (outputs and gradients), the limits where
both equal full attention, MoBA's block choice by hand, padding invariance and invalid settings."""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import full, moba, topk
from attentions.ops import tuning
from attentions.ops.grouped import reference as grouped
from attentions.check import Battery, Sizes
from conftest import lengths_mask, rel_err

# (B, H, N, D, real lengths or None, Config overrides)
TOPK_CASES = {
    "B2-N64-H2-D16-k8-nomask": (2, 2, 64, 16, None, {"topk": 8}),
    "B2-N61-H2-D16-k8-masked-chunks7": (2, 2, 61, 16, [61, 29], {"topk": 8, "chunk_size": 7}),
    "B3-N37-H1-D8-k16-masked-short": (3, 1, 37, 8, [37, 20, 5], {"topk": 16}),
}
MOBA_CASES = {
    "B2-N64-H2-D16-bs8-top2-nomask": (2, 2, 64, 16, None, {"block_size": 8, "topk": 2}),
    "B2-N61-H2-D16-bs8-top3-masked": (2, 2, 61, 16, [61, 29], {"block_size": 8, "topk": 3}),
    "B3-N37-H1-D8-bs7-top2-masked-short": (3, 1, 37, 8, [37, 20, 5], {"block_size": 7, "topk": 2}),
    "B2-N50-H2-D16-bs8-top2-no-own-block": (
        2, 2, 50, 16, [50, 23], {"block_size": 8, "topk": 2, "include_own_block": False}
    ),
    "B2-N64-H2-D16-bs64-top2-defaults": (2, 2, 64, 16, None, {}),
}


def check_against(name: str, ref: Callable, case: tuple, tol: float = 1e-10) -> None:
    """Outputs at real positions and d(q, k, v) of the backend equal those of ``ref``."""
    b, h, n, d, lengths, overrides = case
    torch.manual_seed(0)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention(name, num_heads=h, head_dim=d, max_len=n, **overrides)
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    # the loss ignores padded rows, whose outputs the contract leaves free
    weight = torch.randn(b, h, n, d, dtype=torch.float64) * (1 if mask is None else mask[:, None, :, None])
    results = []
    for fn in (attn, lambda q, k, v, mask: ref(attn.cfg, q, k, v, mask)):
        out = fn(*inputs, mask)
        results.append((out * (weight != 0), torch.autograd.grad((out * weight).sum(), inputs)))
    (out, grads), (ref_out, ref_grads) = results
    assert rel_err(out, ref_out) < tol
    for label, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) < tol, f"d{label} differs"
        assert g.abs().sum() > 0, f"no gradient reaches {label}"


def topk_ref(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return topk.reference(q, k, v, mask, cfg.topk)


def moba_ref(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return moba.reference(q, k, v, mask, cfg.block_size, cfg.topk, cfg.include_own_block)


def full_ref(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return full.reference(q, k, v, mask)


@pytest.mark.parametrize("case", TOPK_CASES.values(), ids=TOPK_CASES.keys())
def test_topk_matches_reference(case: tuple) -> None:
    check_against("topk", topk_ref, case)


def test_topk_without_grad_matches_reference() -> None:
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, 40, 8) for _ in range(3))
    mask = lengths_mask([40, 13], 40)
    with torch.no_grad():
        out = build_attention("topk", num_heads=2, head_dim=8, max_len=40, topk=5, chunk_size=16)(q, k, v, mask)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_err(out[real], topk.reference(q, k, v, mask, 5)[real]) < 1e-6


@pytest.mark.parametrize("lengths", [None, [64, 29]], ids=["nomask", "masked"])
def test_topk_with_k_at_least_n_is_full(lengths: Optional[List[int]]) -> None:
    check_against("topk", full_ref, (2, 2, 64, 16, lengths, {"topk": 64, "chunk_size": 24}))
    check_against("topk", full_ref, (2, 2, 64, 16, lengths, {"topk": 500}))


SMALL_CHUNK_CASE = "B2-N61-H2-D16-bs8-top3-masked"


@pytest.mark.parametrize(
    "case, small_chunks",
    [pytest.param(c, False, id=i) for i, c in MOBA_CASES.items()]
    + [pytest.param(MOBA_CASES[SMALL_CHUNK_CASE], True, id=f"{SMALL_CHUNK_CASE}-small-chunks")],
)
def test_moba_matches_reference(case: tuple, small_chunks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if small_chunks:
        # two tiles per chunk of the grouped loop (blocks straddle chunk boundaries); 16 queries gated at once
        # (B=2, H=2, 8 blocks)
        monkeypatch.setattr(tuning, "CHUNK_SLOTS", 2 * grouped.MIN_TILE)
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
        monkeypatch.setattr(tuning, "GATE_ELEMENTS", 16 * 2 * 2 * 8)
    check_against("moba", moba_ref, case)


@pytest.mark.parametrize("lengths", [None, [61, 29]], ids=["nomask", "masked"])
def test_moba_covering_all_blocks_is_full(lengths: Optional[List[int]]) -> None:
    # 8 blocks of 8 cover N = 61; topk beyond the number of blocks is clamped
    check_against("moba", full_ref, (2, 2, 61, 16, lengths, {"block_size": 8, "topk": 8}))
    check_against("moba", full_ref, (2, 2, 61, 16, lengths, {"block_size": 16, "topk": 9, "include_own_block": False}))


def block_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: List[int]) -> torch.Tensor:
    """softmax(q k_t / sqrt D) v over the listed keys only, for one query q [D]."""
    logits = torch.stack([q @ k[t] for t in keys]) / math.sqrt(q.shape[0])
    return torch.softmax(logits, 0) @ v[keys]


def test_moba_block_choice_by_hand() -> None:
    # N=6 in blocks {0,1} {2,3} {4,5}; block mean keys (1,0), (0,1), (-1,0)
    k = torch.tensor([[2.0, 0], [0, 0], [0, 3], [0, -1], [-1, 1], [-1, -1]])
    v = torch.arange(12.0).view(6, 2)
    q = torch.tensor([[1.0, 0.5], [0, 1], [-1, 0.2], [1, 0], [0.5, 1], [-2, -3]])
    # gate q . mean: block 0 scores x, block 1 scores y, block 2 scores -x
    own_plus_best = [[0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4, 5], [0, 1, 2, 3], [4, 5, 2, 3], [4, 5, 0, 1]]
    best_one = [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]
    for own, chosen in [(True, own_plus_best), (False, best_one)]:
        per_query = 2 if own else 1
        attn = build_attention(
            "moba", num_heads=1, head_dim=2, max_len=6, block_size=2, topk=per_query, include_own_block=own
        )
        out = attn(q[None, None], k[None, None], v[None, None])[0, 0]
        expected = torch.stack([block_softmax(q[i], k, v, chosen[i]) for i in range(6)])
        assert torch.allclose(out, expected, atol=1e-6), f"include_own_block={own}"


def test_moba_block_means_use_real_keys_only() -> None:
    # block {2, 3} holds one real key (0, 1) and one padded key that would flip its mean
    k = torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, -50]])
    v = torch.arange(8.0).view(4, 2)
    q = torch.tensor([[0, 1.0], [0, 1], [0, 1], [0, 1]])
    mask = lengths_mask([3], 4)
    attn = build_attention("moba", num_heads=1, head_dim=2, max_len=4, block_size=2, topk=1, include_own_block=False)
    out = attn(q[None, None], k[None, None], v[None, None], mask)[0, 0]
    # q . mean = 0 for block {0, 1} and 1 for the real part of block {2, 3}: every query picks it
    expected = block_softmax(q[0], k, v, [2])
    assert torch.allclose(out[:3], expected.expand(3, 2), atol=1e-6)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("topk", {"topk": 8}),
        ("moba", {"block_size": 8, "topk": 2}),
        ("moba", {"block_size": 8, "topk": 2, "include_own_block": False}),
    ],
    ids=["topk-k8", "moba-bs8-top2", "moba-bs8-top2-no-own-block"],
)
def test_padding_never_changes_a_sequence(name: str, overrides: dict) -> None:
    # lra-check-attn's padding checks (attentions/check.py) at these options, in float64 on real lengths
    # 64, 29 and 7: noise at padded q, k and v changes no real output and gets no gradient, and each row
    # of the mixed-length batch equals the sequence run alone
    battery = Battery(name, Sizes(), seed=1, overrides=overrides)
    assert battery.pick_dtype() == ""
    battery.finite()
    battery.padding_invariance()
    battery.padding_gradient()
    battery.padded_vs_alone()


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("topk", {"topk": 0}),
        ("topk", {"topk": -1}),
        ("topk", {"chunk_size": 0}),
        ("moba", {"block_size": 0}),
        ("moba", {"topk": 0}),
    ],
    ids=["topk-k0", "topk-k-negative", "topk-chunk0", "moba-block0", "moba-topk0"],
)
def test_invalid_hyperparameters_raise(name: str, overrides: dict) -> None:
    with pytest.raises(AttentionError, match=name):
        build_attention(name, num_heads=2, head_dim=16, max_len=64, **overrides)


def test_budgets() -> None:
    assert build_attention("topk", num_heads=2, head_dim=16, max_len=64, topk=32).budget() == "k = 32"
    assert build_attention("moba", num_heads=2, head_dim=16, max_len=1024).budget() == "topk x block_size = 128"
    # past the sequence: what covers it, every key (two blocks of 64 where 64 tokens hold one)
    assert build_attention("topk", num_heads=2, head_dim=16, max_len=64, topk=128).budget() == "k = 64"
    assert build_attention("moba", num_heads=2, head_dim=16, max_len=64).budget() == "topk x block_size = 64"


def test_moba_cpu_kernel_leaves_padded_queries_out_and_real_rows_as_the_reference() -> None:
    # float32 on the CPU: the merged kernel path, where a padded query takes no block (output 0)
    torch.manual_seed(0)
    b, h, n, d = 2, 2, 300, 16
    attn = build_attention("moba", num_heads=h, head_dim=d, max_len=n, block_size=32, topk=3)
    mask = lengths_mask([300, 170], n)
    inputs = [torch.randn(b, h, n, d, requires_grad=True) for _ in range(3)]
    weight = torch.randn(b, h, n, d) * mask[:, None, :, None]  # the loss reads real rows only
    out = attn(*inputs, mask)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    ref = moba.reference(*wide, mask, 32, 3, True)
    ref_grads = torch.autograd.grad((ref * weight.double()).sum(), wide)
    real = mask[:, None, :, None]
    assert (out * ~real == 0).all()
    assert rel_err(out * real, ref.float() * real) < 1e-5
    for label, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r.float()) < 1e-5, f"d{label} differs"
