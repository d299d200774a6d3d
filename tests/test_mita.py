"""MiTA: the grouped fast path against the plain reference (outputs and gradients), against a loop
over queries written here from the paper's five steps, on a case worked by hand, and under padding."""
from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import mita
from attentions.ops import tuning
from attentions.ops.grouped import reference as grouped
from attentions.ops.tuning import GPU_CHUNK_SCALE, chunk_rows
from attentions.check import Battery, Sizes
from attentions.backends.mita import reference
from conftest import lengths_mask, rel_err

# (B, H, N, D, real lengths or None, Config overrides)
CASES = {
    "B2-N64-H2-D16-m8-k8-nomask": (2, 2, 64, 16, None, {"landmarks": 8, "topk": 8}),
    "B2-N61-H2-D16-m8-k8-masked": (2, 2, 61, 16, [61, 29], {"landmarks": 8, "topk": 8}),
    "B3-N37-H1-D8-m8-k16-masked-short": (3, 1, 37, 8, [37, 20, 5], {"landmarks": 8, "topk": 16}),
    "B1-N6-H2-D8-m8-k8-fewer-tokens-than-landmarks": (1, 2, 6, 8, None, {"landmarks": 8, "topk": 8}),
    "B2-N50-H2-D16-m8-k8-E2-masked": (2, 2, 50, 16, [50, 23], {"landmarks": 8, "topk": 8, "experts_per_query": 2}),
    "B2-N64-H2-D16-m8-k8-E2-nomask": (2, 2, 64, 16, None, {"landmarks": 8, "topk": 8, "experts_per_query": 2}),
    "B2-N50-H2-D16-m8-k8-routed-only-masked": (
        2, 2, 50, 16, [50, 23], {"landmarks": 8, "topk": 8, "shared_expert": False}
    ),
    "B2-N64-H2-D16-m64-k64-defaults": (2, 2, 64, 16, None, {}),
}


def run_and_grads(fn, inputs: List[torch.Tensor], mask: Optional[torch.Tensor], weight: torch.Tensor):
    out = fn(*inputs, mask)
    return out, torch.autograd.grad((out * weight).sum(), inputs)


# cases rerun with two tiles per chunk of the fast path's loop, so experts straddle chunk boundaries,
# and queries routed 16 at a time (B=2, H=2, m=8)
SMALL_CHUNK_CASES = ["B2-N61-H2-D16-m8-k8-masked", "B2-N50-H2-D16-m8-k8-E2-masked"]


def test_a_gpu_scores_more_queries_at_once() -> None:
    # MiTA's routing and MoBA's gate: CPU chunks of ROUTE_ELEMENTS scores; a GPU's are 16x larger
    per_row = 32 * 4 * 64  # B x H x m at 64K tokens x batch 32
    assert chunk_rows(tuning.ROUTE_ELEMENTS, per_row, torch.device("cpu")) == 512
    assert chunk_rows(tuning.ROUTE_ELEMENTS, per_row, torch.device("cuda")) == 512 * GPU_CHUNK_SCALE
    assert chunk_rows(10, per_row, torch.device("cpu")) == 1


@pytest.mark.parametrize(
    "case, small_chunks",
    [pytest.param(c, False, id=i) for i, c in CASES.items()]
    + [pytest.param(CASES[i], True, id=f"{i}-small-chunks") for i in SMALL_CHUNK_CASES],
)
def test_fast_path_matches_reference(case: tuple, small_chunks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    b, h, n, d, lengths, overrides = case
    if small_chunks:
        monkeypatch.setattr(tuning, "CHUNK_SLOTS", 2 * grouped.MIN_TILE)
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
        monkeypatch.setattr(tuning, "ROUTE_ELEMENTS", 16 * 2 * 2 * 8)
    torch.manual_seed(0)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention("mita", num_heads=h, head_dim=d, max_len=4096, **overrides)
    cfg = attn.cfg
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    # the loss ignores padded rows, whose outputs the contract leaves free
    weight = torch.randn(b, h, n, d, dtype=torch.float64) * (1 if mask is None else mask[:, None, :, None])

    def ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return reference(q, k, v, mask, cfg.landmarks, cfg.topk, cfg.shared_expert, cfg.experts_per_query)

    out, grads = run_and_grads(attn, inputs, mask, weight)
    ref_out, ref_grads = run_and_grads(ref, inputs, mask, weight)
    assert rel_err(out * (weight != 0), ref_out * (weight != 0)) < 1e-10
    assert torch.isfinite(out).all()
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) < 1e-10, f"d{name} differs"
        assert g.abs().sum() > 0, f"no gradient reaches {name}"


def loop_mita(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int, topk: int) -> torch.Tensor:
    """The five steps, one query at a time, for unpadded inputs with N divisible by m."""
    b_size, h_size, n, d = q.shape
    size = n // m
    heads = []
    for b in range(b_size):
        for h in range(h_size):
            qs, ks, vs = q[b, h], k[b, h], v[b, h]
            # 1. landmark j: the mean of queries j*size .. (j+1)*size - 1
            marks = [qs[j * size : (j + 1) * size].mean(0) for j in range(m)]
            experts, shared = [], []
            for mark in marks:
                scores = torch.stack([mark @ ks[t] for t in range(n)])
                # 2. routed expert: the topk keys this landmark scores highest
                plain = scores.tolist()
                experts.append(sorted(range(n), key=lambda t: -plain[t])[:topk])
                # 3. shared expert: the landmark's softmax summary of all values
                weights = torch.softmax(scores / math.sqrt(d), dim=0)
                shared.append(sum(weights[t] * vs[t] for t in range(n)))
            rows = []
            for i in range(n):
                # 4. the landmark with the largest q_i . L_j picks the expert
                e = max(range(m), key=lambda j: (qs[i] @ marks[j]).item())
                # 5. one softmax over m landmark logits (1/D) and the expert's key logits (1/sqrt D)
                logits = [qs[i] @ mark / d for mark in marks] + [qs[i] @ ks[t] / math.sqrt(d) for t in experts[e]]
                weights = torch.softmax(torch.stack(logits), dim=0)
                values = shared + [vs[t] for t in experts[e]]
                rows.append(sum(w * value for w, value in zip(weights, values)))
            heads.append(torch.stack(rows))
    return torch.stack(heads).view(b_size, h_size, n, d)


def test_matches_loop_over_queries_in_float32() -> None:
    torch.manual_seed(3)
    b, h, n, d, m, topk = 1, 2, 32, 8, 4, 4
    inputs = [torch.randn(b, h, n, d, requires_grad=True) for _ in range(3)]
    attn = build_attention("mita", num_heads=h, head_dim=d, max_len=n, landmarks=m, topk=topk)
    weight = torch.randn(b, h, n, d)
    out, grads = run_and_grads(attn, inputs, None, weight)
    loop_out, loop_grads = run_and_grads(lambda q, k, v, mask: loop_mita(q, k, v, m, topk), inputs, None, weight)
    assert rel_err(out, loop_out) < 1e-5
    for name, g, r in zip("qkv", grads, loop_grads):
        assert rel_err(g, r) < 1e-4, f"d{name} differs"


def test_worked_by_hand() -> None:
    # N=8, m=2, k=2, D=2; each half of q averages to an axis, so the landmarks are L_0=(1,0), L_1=(0,1)
    q = torch.tensor([[2, 0], [1, 0.75], [0.25, 0.5], [0.75, -1.25], [0, 2], [0.75, 1], [-1, 0.5], [0.25, 0.5]])
    k = torch.tensor([[3, 0], [0, 3], [2, 1], [1, 2], [-1, 0], [0, -1], [0.5, 0.5], [0, 0]])
    # v_t = (t, 1): the first output column is the weighted mean of t, the second the total weight
    v = torch.tensor([[float(t), 1.0] for t in range(8)])
    # routing: q_i . L_0 = x_i and q_i . L_1 = y_i, so expert 1 exactly where y > x (query 2 crosses)
    route = [0, 0, 1, 0, 1, 1, 1, 1]
    # L_0 . k_t = x_t = [3, 0, 2, 1, -1, 0, .5, 0] -> keys 0 and 2; L_1 . k_t = y_t -> keys 1 and 3
    experts = [[0, 2], [1, 3]]
    shared = [
        torch.softmax(torch.tensor([3, 0, 2, 1, -1, 0, 0.5, 0]) / math.sqrt(2), 0) @ v,
        torch.softmax(torch.tensor([0, 3, 1, 2, 0, -1, 0.5, 0]) / math.sqrt(2), 0) @ v,
    ]
    expected = []
    for i in range(8):
        x, y = q[i].tolist()
        a, c = experts[route[i]]
        logits = torch.tensor([x / 2, y / 2, float(q[i] @ k[a]) / math.sqrt(2), float(q[i] @ k[c]) / math.sqrt(2)])
        w = torch.softmax(logits, 0)
        expected.append(w[0] * shared[0] + w[1] * shared[1] + w[2] * v[a] + w[3] * v[c])
    attn = build_attention("mita", num_heads=1, head_dim=2, max_len=8, landmarks=2, topk=2)
    out = attn(q[None, None], k[None, None], v[None, None])[0, 0]
    assert torch.allclose(out, torch.stack(expected), atol=1e-6)
    assert torch.allclose(out[:, 1], torch.ones(8), atol=1e-6)


SMALL = {"landmarks": 8, "topk": 8}


@pytest.mark.parametrize(
    "overrides",
    [SMALL, {**SMALL, "experts_per_query": 2}, {**SMALL, "shared_expert": False}],
    ids=["m8-k8", "m8-k8-E2", "m8-k8-routed-only"],
)
def test_padding_never_changes_a_sequence(overrides: dict) -> None:
    # lra-check-attn's padding checks (attentions/check.py) at these options, in float64 on real lengths
    # 64, 29 and 7: noise at padded q, k and v changes no real output and gets no gradient, and each row
    # of the mixed-length batch equals the sequence run alone
    battery = Battery("mita", Sizes(), seed=1, overrides=overrides)
    assert battery.pick_dtype() == ""
    battery.finite()
    battery.padding_invariance()
    battery.padding_gradient()
    battery.padded_vs_alone()


@pytest.mark.parametrize(
    "overrides",
    [
        {"landmarks": 0},
        {"topk": 0},
        {"topk": -3},
        {"experts_per_query": 0},
        {"experts_per_query": 3, "landmarks": 2},
        {"experts_per_query": 4, "topk": 2},
    ],
    ids=["landmarks0", "topk0", "topk-negative", "E0", "E-above-landmarks", "E-above-topk"],
)
def test_invalid_hyperparameters_raise(overrides: dict) -> None:
    with pytest.raises(AttentionError, match="mita"):
        build_attention("mita", num_heads=2, head_dim=16, max_len=64, **overrides)


def test_budget_counts_landmarks_and_keys() -> None:
    attn = build_attention("mita", num_heads=2, head_dim=16, max_len=64)
    assert attn.budget() == "m + k = 128"
    routed_only = build_attention("mita", num_heads=2, head_dim=16, max_len=64, shared_expert=False, topk=32)
    assert routed_only.budget() == "k = 32"


def test_a_batch_split_for_the_cpu_cache_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from attentions.ops import tuning as base

    torch.manual_seed(2)
    b, h, n, d = 5, 2, 40, 8
    mask = lengths_mask([40, 33, 12, 40, 7], n)
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weight = torch.randn(b, h, n, d, dtype=torch.float64) * mask[:, None, :, None]
    for name in ("mita", "moba"):
        attn = build_attention(name, num_heads=h, head_dim=d, max_len=n, **({"landmarks": 8, "topk": 8} if name == "mita" else {"block_size": 8}))
        whole, whole_grads = run_and_grads(attn, inputs, mask, weight)
        # two sequences per pass: three passes of 2, 2 and 1 sequences
        monkeypatch.setattr(base, "CPU_BATCH_TOKENS", 2 * h * n)
        passes = []
        base.in_batch_chunks(lambda q, k, v, m: passes.append(q.shape[0]) or q, *inputs, mask)
        assert passes == [2, 2, 1]
        split, split_grads = run_and_grads(attn, inputs, mask, weight)
        monkeypatch.undo()
        assert base.in_batch_chunks(lambda q, k, v, m: q, *inputs, mask) is None
        assert rel_err(split, whole) < 1e-12
        for g, r in zip(split_grads, whole_grads):
            assert rel_err(g, r) < 1e-12


def test_the_cpu_batch_split_follows_the_l2_size_read_from_sysfs(tmp_path) -> None:
    from attentions.ops import tuning

    def cache(name: str, level: str, kind: str, size: str) -> None:
        folder = tmp_path / name
        folder.mkdir()
        for field, value in (("level", level), ("type", kind), ("size", size)):
            (folder / field).write_text(value + "\n")

    assert tuning.l2_bytes(tmp_path) is None  # nothing to read: the caller falls back to 2^15 tokens
    cache("index0", "1", "Data", "48K")
    cache("index1", "1", "Instruction", "64K")
    cache("index3", "3", "Unified", "491520K")
    assert tuning.l2_bytes(tmp_path) is None
    cache("index2", "2", "Unified", "2048K")
    assert tuning.l2_bytes(tmp_path) == 2 << 20
    assert tuning.l2_bytes(tmp_path) // 16 == 1 << 17  # the Intel Xeon's split
    (tmp_path / "index2" / "size").write_text("512K\n")
    assert tuning.l2_bytes(tmp_path) // 16 == 1 << 15  # the AMD EPYC's
    (tmp_path / "index2" / "size").write_text("lots\n")
    assert tuning.l2_bytes(tmp_path) is None


SELECTION_CASES = {
    "B2-N61-H2-D16-m8-k8-masked": (2, 2, 61, 16, [61, 29], {"landmarks": 8, "topk": 8}),
    "B3-N37-H1-D8-m8-k16-masked-short": (3, 1, 37, 8, [37, 20, 5], {"landmarks": 8, "topk": 16}),
    "B1-N6-H2-D8-m8-k8-fewer-tokens-than-landmarks": (1, 2, 6, 8, None, {"landmarks": 8, "topk": 8}),
    "B2-N50-H2-D16-m8-k8-E2-masked": (2, 2, 50, 16, [50, 23], {"landmarks": 8, "topk": 8, "experts_per_query": 2}),
}


@pytest.mark.parametrize("case", SELECTION_CASES.values(), ids=SELECTION_CASES.keys())
def test_selected_keys_are_the_reference_paths_routed_experts(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """selected_keys (what lra-analyze tokens counts) against the keys the reference's step 2 picks:
    its first top-k call is spied on, so the selection compared is the reference's own."""
    b, h, n, d, lengths, overrides = case
    torch.manual_seed(4)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention("mita", num_heads=h, head_dim=d, max_len=4096, **overrides)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    calls: list = []
    topk = torch.Tensor.topk

    def spy(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(topk(self, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    reference(q, k, v, mask, **overrides)
    monkeypatch.undo()
    top, ref_index = calls[0]  # step 2: [B, H, m, keys]
    m = overrides["landmarks"]
    real_lengths = [n] * b if lengths is None else lengths
    # a landmark exists only where a sequence has that many real tokens
    ref_real = torch.isfinite(top) & (torch.arange(m)[None, :] < torch.tensor(real_lengths)[:, None].clamp(max=m))[:, None, :, None]
    index, real = attn.selected_keys(q, k, mask)
    assert index.shape == ref_index.shape == real.shape and index.dtype == torch.long
    for bi in range(b):
        for hi in range(h):
            for j in range(m):
                got = sorted(index[bi, hi, j][real[bi, hi, j]].tolist())
                want = sorted(ref_index[bi, hi, j][ref_real[bi, hi, j]].tolist())
                assert got == want, (bi, hi, j)
    # padded keys are never selected; every real landmark of a long enough row fills its expert
    assert all(int(index[bi][real[bi]].max()) < real_lengths[bi] for bi in range(b))
    assert bool(real[0, :, 0].all())
