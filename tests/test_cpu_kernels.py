"""The C kernels for the CPU (attentions/ops/native.py builds them): the grouped attention kernel of
MiTA and MoBA (ops/grouped), the top-k selection (ops/topk_selection), Top-k attention's fused forward
(ops/topk_attention) and the products with chosen rows (ops/row_products) against their PyTorch references: outputs and q/k/v gradients, padding, empty
experts, a pair with no expert, ties and infinities; and what happens where they cannot be built."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import topk
from attentions.ops import native, row_products, topk_selection, tuning
from attentions.ops.grouped import cpu as grouped_cpu, pick_grouped
from attentions.ops.grouped.cpu import grouped_attention_cpu
from attentions.ops.grouped.reference import expert_runs, grouped_attention
from attentions.ops.row_products import cpu as row_kernels, reference as row_reference
from attentions.ops.topk_attention import cpu as fused_cpu, reference as fused_reference
from attentions.ops.topk_selection import topk_unsorted
from conftest import lengths_mask, rel_err
from test_grouped_triton import (BACKEND_CASES, GROUPED_CASES, check_all_masked_expert, check_backend_kernel,
                                 check_grouped_against_torch_path, outputs_and_grads, run_grouped)

needs_kernels = pytest.mark.skipif(not grouped_cpu.takes(torch.zeros(0)),
                                   reason="the C kernels do not build here (no C compiler)")


@needs_kernels
@pytest.mark.parametrize("saved", [True, False], ids=["rows-saved", "rows-recomputed"])
@pytest.mark.parametrize("case", GROUPED_CASES.values(), ids=GROUPED_CASES.keys())
def test_grouped_kernel_matches_torch_path(case: tuple, saved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not saved:  # the backward recomputes the softmax rows from the saved log-sum-exps
        monkeypatch.setattr(tuning, "SAVE_ELEMENTS", 0)
    check_grouped_against_torch_path(grouped_attention_cpu, case)


@needs_kernels
@pytest.mark.parametrize("case", GROUPED_CASES.values(), ids=GROUPED_CASES.keys())
def test_grouped_backward_writes_every_key_row_it_owns(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # without rows an expert's key rows are its own, and the backward writes their gradients into
    # unset tables (an expert without pairs gets zeros): unset memory here is NaN, so a row it missed shows
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *args, **kwargs: empty_like(t, *args, **kwargs).fill_(math.nan))
    check_grouped_against_torch_path(grouped_attention_cpu, case)


@needs_kernels
@pytest.mark.parametrize("d", [16, 32])
def test_grouped_kernel_reads_keys_by_index_like_gathered_tables(d: int) -> None:
    # rows [X, S] into [R, D] tables (MiTA's layout: a key in several experts, and here also twice in
    # one expert) against the gathered copies; D = 32 takes the key and value gradients' six- and
    # two-key tiles, which add a routed key's rows into the tables where they lie, D = 16 one key at a time
    gen = torch.Generator().manual_seed(0)
    p, x, s, rows_in_table = 300, 12, 16, 40
    q, table_k, table_v = (torch.randn(n, d, generator=gen).requires_grad_() for n in (p, rows_in_table, rows_in_table))
    rows = torch.randint(0, rows_in_table, (x, s), generator=gen)
    rows[:, 5] = rows[:, 0]  # a row twice in every expert, in one six-key tile
    rows[:, 13] = rows[:, 12]  # ... and in one two-key tile
    expert = torch.randint(0, x + 1, (p,), generator=gen)
    outs = []
    for by_index in (True, False):
        if by_index:
            out, _ = grouped_attention_cpu(q, expert, table_k, table_v, None, 0.25, rows=rows, unit=x)
        else:
            out, _ = grouped_attention(q, expert, table_k[rows], table_v[rows], None, 0.25)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        outs.append([out, *torch.autograd.grad((out * weight).sum(), [q, table_k, table_v])])
    for label, got, ref in zip(["out", "dq", "dk", "dv"], *outs):
        assert rel_err(got, ref) < 1e-5, label


@needs_kernels
def test_grouped_kernel_gives_the_same_bits_with_one_or_two_threads() -> None:
    # each expert is one thread's, in a fixed order: the thread count cannot change a result
    case = GROUPED_CASES["P1000-X16-S64-D32-M64-group8-lse"]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(run_grouped(grouped_attention_cpu, case, torch.float32))
    finally:
        torch.set_num_threads(threads)
    (out1, lse1, grads1), (out2, lse2, grads2) = results
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert all(torch.equal(a, b) for a, b in zip(grads1, grads2))


@needs_kernels
def test_the_kernels_exp_is_within_2e_7_of_torch_exp() -> None:
    # exp_nonpos (csrc/blocks.h), every kernel's softmax: a dense grid of its domain and the ends
    lib = native.load("grouped_cpu")
    lib.lra_exp_nonpos.argtypes, lib.lra_exp_nonpos.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    grid = torch.linspace(-87.3, 0.0, 1_000_001)
    ends = torch.tensor([0.0, -0.0, -87.7, -88.0, -100.0, -1e30, float("-inf"), float("nan")])
    x = torch.cat([grid, ends])
    y = torch.empty_like(x)
    lib.lra_exp_nonpos(x.data_ptr(), y.data_ptr(), x.numel())
    exact = torch.exp(grid.double())
    assert float(((y[: grid.numel()].double() - exact) / exact).abs().max()) < 2e-7
    # e^0 is 1 exactly; below -87.7 (a -inf logit too) the weight is 0; NaN stays NaN
    assert y[-8:-1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and math.isnan(y[-1])


@needs_kernels
def test_expert_runs_equal_the_stable_argsort() -> None:
    gen = torch.Generator().manual_seed(5)
    for pairs, experts in [(5000, 37), (1, 1), (0, 4), (300, 300)]:
        expert = torch.randint(0, experts + 1, (pairs,), generator=gen)  # experts + 1: no expert
        order, offsets = grouped_cpu.expert_runs_op(expert, experts)
        ref_order, ref_offsets = expert_runs(expert, experts)
        assert torch.equal(order, ref_order) and torch.equal(offsets, ref_offsets)
    with pytest.raises(AttentionError, match=r"outside \[0, 4\]"):
        grouped_cpu.expert_runs_op(torch.tensor([0, 5, 1]), 4)


@needs_kernels
def test_take_rows_equals_index_select() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(500, 33, generator=gen)
    index = torch.randint(0, 500, (777,), generator=gen)  # repeats, any order
    assert torch.equal(grouped_cpu.take_rows(x, index), x.index_select(0, index))
    assert grouped_cpu.take_rows(x, index[:0]).shape == (0, 33)
    for other in (x.double(), x[:, ::2]):  # not float32 / not contiguous: index_select itself
        assert torch.equal(grouped_cpu.take_rows(other, index), other.index_select(0, index))


@needs_kernels
def test_an_expert_with_every_key_masked_gives_zeros_not_nan() -> None:
    check_all_masked_expert(grouped_attention_cpu)


@needs_kernels
@pytest.mark.parametrize("name, case", BACKEND_CASES)
def test_backend_with_cpu_kernel_matches_torch_kernel_and_reference(name: str, case: tuple) -> None:
    check_backend_kernel(name, case, "cpu")


@needs_kernels
def test_bf16_inputs_take_the_torch_path() -> None:
    # the C kernel is float32; other dtypes give exactly the PyTorch path's result
    case = BACKEND_CASES[0].values[1]
    got = outputs_and_grads("mita", case, "cpu", torch.bfloat16)["cpu"]
    ref = outputs_and_grads("mita", case, "torch", torch.bfloat16)["torch"]
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_kernel_choice_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(AttentionError, match="kernel='cpu' runs on CPU tensors, these are on cuda"):
        pick_grouped("cpu", torch.device("cuda"))
    expected = grouped_attention_cpu if grouped_cpu.takes(torch.zeros(0)) else grouped_attention
    assert pick_grouped("auto", cpu) is expected
    # a machine where the kernel cannot be built: "auto" keeps the PyTorch path, "cpu" says why
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert pick_grouped("auto", cpu) is grouped_attention
    assert not topk_selection.takes(torch.zeros(3, 4))
    needs = r"mita kernel='cpu' needs the C kernel.*no-such-compiler-here.*kernel='torch'"
    with pytest.raises(AttentionError, match=needs):
        build_attention("mita", num_heads=2, head_dim=16, max_len=64, kernel="cpu")


def test_a_failed_build_is_reported_and_leaves_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCES", tmp_path)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("LRA_KERNEL_CACHE", str(tmp_path / "cache"))
    if native.compiler() is None:
        pytest.skip("no C compiler")
    assert native.load("broken") is None
    assert "building broken.c" in native.why_not("broken") and "failed" in native.why_not("broken")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_library_built_from_another_kernels_source_is_rebuilt_when_it_changes(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # mita_layer_cpu.c compiles grouped_cpu.c and landmark_cpu.c in its own unit: their text is in its cache key
    assert {p.name for p in native.included(native.SOURCES / "mita_layer_cpu.c")} >= {
        "grouped_cpu.c", "landmark_cpu.c", "blocks.h", "vec.h"}
    if native.compiler() is None:
        pytest.skip("no C compiler")
    (tmp_path / "part.c").write_text("int part(void) { return 1; }\n")
    (tmp_path / "whole.c").write_text('#include "part.c"\nint whole(void) { return part() + 1; }\n')
    monkeypatch.setattr(native, "SOURCES", tmp_path)
    monkeypatch.setenv("LRA_KERNEL_CACHE", str(tmp_path / "cache"))
    answers = []
    for value in (1, 5):
        (tmp_path / "part.c").write_text(f"int part(void) {{ return {value}; }}\n")
        monkeypatch.setattr(native, "_loaded", {})
        answers.append(native.load("whole").whole())
    assert answers == [2, 6] and len(list((tmp_path / "cache").iterdir())) == 2


def check_selection(x: torch.Tensor, k: int) -> None:
    """topk_unsorted against torch.topk: the same values chosen, indices that point at them, no repeats,
    and among equal values the lower indices (a stable sort's first k)."""
    values, index = topk_unsorted(x, k)
    ref = x.topk(k, dim=-1).values
    assert torch.equal(x.gather(-1, index), values)
    assert torch.equal(values.sort(-1, descending=True).values.nan_to_num(), ref.nan_to_num())
    assert bool((index.sort(-1).values.diff(dim=-1) > 0).all()), "an index chosen twice"
    lowest = x.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(index.sort(-1).values, lowest.sort(-1).values), "ties not broken to the lower indices"


@needs_kernels
# from n = 512 (select.h's ROW_SAMPLE_MIN) a sampled threshold picks the candidates; from n = 4096
# (FILTER_MIN) a row the sample misleads is filtered before the bisection
@pytest.mark.parametrize("n, k", [(1024, 128), (1024, 64), (100, 7), (65, 64), (9, 1), (300, 299),
                                  (512, 1), (2048, 256), (600, 150), (3000, 2999), (4095, 128),
                                  (4096, 128), (20000, 64), (5000, 1), (4100, 4099)])
def test_selection_chooses_what_torch_topk_chooses(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(40, n, generator=gen)
    assert topk_selection.takes(x)
    check_selection(x, k)
    x[:5, n // 2:] = float("-inf")  # padded keys: some rows with fewer than k real ones
    x[5:9] = 1.0  # every value tied
    x[9, :3] = float("inf")
    x[10] = torch.randint(0, 3, (n,), generator=gen).float()  # heavy ties at the boundary
    x[11] = float("-inf")
    x[12, ::2] = float("-inf")
    x[13] = torch.arange(n).float()  # ascending: every value raises the filter's threshold
    x[14] = -torch.arange(n).float()
    x[15] = torch.randint(0, 2, (n,), generator=gen).float()  # ties defeat the filter (whole-row fallback)
    x[16, n // 3:] = x[16, : n - n // 3].clone()  # repeated values across the row
    x[17, :: max(1, n // 40)] = 100.0  # a sample that overstates the row's largest values
    check_selection(x, k)
    # ties at the boundary go to the lower indices
    _, index = topk_unsorted(torch.ones(1, n), k)
    assert torch.equal(index.sort(-1).values, torch.arange(k)[None])


@needs_kernels
def test_selection_of_a_view_and_of_other_dtypes() -> None:
    x = torch.randn(6, 50, 64).transpose(1, 2)  # not contiguous
    check_selection(x, 10)
    values, index = topk_unsorted(x.double(), 10)  # float64: torch.topk
    assert values.dtype == torch.float64 and torch.equal(x.double().gather(-1, index), values)


@needs_kernels
@pytest.mark.parametrize("d", [32, 24, 5])
def test_sparse_row_products_match_their_references(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    groups, n, per_group, k = 3, 50, 7, 9
    w = torch.randn(groups * per_group, k, generator=gen)
    x = torch.randn(groups * per_group, d, generator=gen)
    table = torch.randn(groups * n, d, generator=gen)
    idx = torch.randint(0, n, (groups * per_group, k), generator=gen)
    mixed, ref_mixed = row_kernels.mix_rows(w, idx, table, per_group, n), row_reference.mix_rows(w, idx, table, per_group, n)
    assert rel_err(mixed, ref_mixed) < 1e-6
    dots, ref_dots = row_kernels.dot_rows(x, idx, table, per_group, n), row_reference.dot_rows(x, idx, table, per_group, n)
    assert rel_err(dots, ref_dots) < 1e-6
    got = row_kernels.scatter_outer(w, idx, x, torch.zeros_like(table), per_group, n)
    assert rel_err(got, row_reference.scatter_outer(w, idx, x, torch.zeros_like(table), per_group, n)) < 1e-6


@needs_kernels
@pytest.mark.parametrize("n, keys, chunk, lengths", [
    (67, 8, 1024, [67, 30]), (64, 16, 24, None), (150, 128, 40, [150, 9]), (50, 8, 1024, [50, 5]),
], ids=["N67-k8-masked", "N64-k16-chunks", "N150-k128-chunks-masked", "N50-k8-fewer-real-than-k"])
def test_topk_sparse_path_matches_dense_path_and_reference(
    monkeypatch: pytest.MonkeyPatch, n: int, keys: int, chunk: int, lengths
) -> None:
    torch.manual_seed(0)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention("topk", num_heads=2, head_dim=16, max_len=n, topk=keys, chunk_size=chunk)
    inputs = [torch.randn(2, 2, n, 16).requires_grad_() for _ in range(3)]
    weight = torch.randn(2, 2, n, 16) * (1 if mask is None else mask[:, None, :, None])

    def run(fn):
        out = fn(*inputs, mask)
        return [out * (weight != 0), *torch.autograd.grad((out * weight).sum(), inputs)]

    fast = run(attn)
    ref = run(lambda q, k, v, m: topk.reference(q, k, v, m, keys))
    monkeypatch.setattr(row_products, "takes", lambda x: False)
    dense = run(attn)
    for label, f, d, r in zip(["out", "dq", "dk", "dv"], fast, dense, ref):
        assert rel_err(f, d) < 1e-5, f"{label}: sparse vs dense path"
        assert rel_err(f, r) < 1e-5, f"{label}: sparse path vs reference"


@needs_kernels
@pytest.mark.parametrize("n, keys, queries, masked", [
    (700, 32, 50, False), (700, 32, 50, True), (40, 40, 17, True), (5000, 64, 3, True), (64, 1, 33, False),
], ids=["N700-k32", "N700-k32-masked", "k-equals-N-masked", "N5000-filtered-masked", "k1-odd-block"])
def test_fused_topk_forward_matches_its_torch_form(n: int, keys: int, queries: int, masked: bool) -> None:
    """lra::topk_attention against reference.py: the same keys chosen, the same weights and output;
    a padded key is never chosen while a real one is left (each row here has more real keys than k
    but one, whose extra places take padded keys at weight 0)."""
    gen = torch.Generator().manual_seed(n + keys)
    q, k, v = (torch.randn(2, 2, size, 16, generator=gen) for size in (queries, n, n))
    bias = None
    if masked:
        real = torch.tensor([n, max(1, keys - 1)])
        bias = torch.zeros(2, 1, 1, n).masked_fill(torch.arange(n) >= real[:, None, None, None], float("-inf"))
    out, index, weights = fused_cpu.topk_attention(q, k.transpose(-1, -2), v, bias, keys)
    ref_out, ref_index, ref_weights = fused_reference.topk_attention(q, k.transpose(-1, -2), v, bias, keys)
    order, ref_order = index.argsort(-1), ref_index.argsort(-1)
    if masked:  # padded keys tie at -inf: which of them fill the second sequence's spare places is free
        assert torch.equal(index[0].sort(-1).values, ref_index[0].sort(-1).values)
        assert bool((index[1].sort(-1).values[..., : keys - 1] < keys - 1).all())
    else:
        assert torch.equal(index.gather(-1, order), ref_index.gather(-1, ref_order))
    assert rel_err(weights.gather(-1, order), ref_weights.gather(-1, ref_order)) < 1e-6
    assert rel_err(out, ref_out) < 1e-6


@needs_kernels
def test_fused_topk_forward_gives_the_same_bits_with_one_or_two_threads() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 300, 16, generator=gen) for _ in range(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_cpu.topk_attention(q, k.transpose(-1, -2), v, None, 20)
        torch.set_num_threads(2)
        two = fused_cpu.topk_attention(q, k.transpose(-1, -2), v, None, 20)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
