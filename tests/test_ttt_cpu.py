"""TTT's dual form on the C kernel (attentions/ops/ttt/cpu.py, csrc/ttt_cpu.c) against the PyTorch dual
form (dual.py, in float64): outputs and the gradients of q, k, v and every learned piece; causality,
padding, thread counts, and which form ``kernel`` picks."""
from __future__ import annotations

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.ops import native
from attentions.ops.ttt import cpu, dispatch, dual_form

from test_ttt import (B, D, H, N, NAMES, assert_causal, assert_padding_is_exact, build, grads, make_mask, make_qkv,
                      rel_err)

needs_kernel = pytest.mark.skipif(bool(cpu.refusals(torch.zeros(0))), reason="the TTT C kernel does not build here")


@needs_kernel
@pytest.mark.parametrize("options, masked", [
    pytest.param({}, False, id="default"),
    pytest.param({}, True, id="masked"),
    pytest.param({"token_average": False}, False, id="plain-sum"),
    pytest.param({"bidirectional": True}, True, id="bidirectional-masked"),
    pytest.param({"mini_batch": 5}, True, id="mini-batch-5-masked"),
])
@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_the_pytorch_dual_form(name: str, options: dict, masked: bool) -> None:
    """The kernel in float32 against the PyTorch dual form in float64, from the same weights and inputs;
    N = 60 leaves a partial last mini-batch."""
    ref_attn = build(name, kernel="torch", **options)
    attn = build(name, kernel="cpu", **options).float()
    q, k, v = make_qkv(60)
    mask = make_mask(60, [60, 37]) if masked else None
    ref = ref_attn(q, k, v, mask)
    out = attn(q.float(), k.float(), v.float(), mask)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    got = grads(out, [q, k, v, *attn.parameters()], mask)
    want = grads(ref, [q, k, v, *ref_attn.parameters()], mask)
    for (key, _), g, w in zip([("q", 0), ("k", 0), ("v", 0), *attn.named_parameters()], got, want):
        assert rel_err(g, w) < 1e-5, key


@needs_kernel
@pytest.mark.parametrize("name, tol", [pytest.param("ttt_linear", 1e-5, id="linear"),
                                       pytest.param("ttt_mlp", 1e-4, id="mlp")])
def test_a_long_sequence_stays_within_float32_rounding(name: str, tol: float) -> None:
    """1,024 tokens (64 mini-batches of recurrence), the kernel's float32 against the float64 form. TTT-MLP's
    recurrence amplifies float32 rounding, the PyTorch form's alike (its own float32 run was 2e-5 off the
    float64 one at 2,048 tokens in the gradients of k and v, as the kernel's), hence its tolerance."""
    torch.manual_seed(0)
    ref_attn = build_attention(name, num_heads=1, head_dim=D, max_len=1024, kernel="torch").double()
    attn = build_attention(name, num_heads=1, head_dim=D, max_len=1024, kernel="cpu")
    attn.load_state_dict(ref_attn.state_dict())
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 1024, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    ref = ref_attn(q, k, v)
    out = attn(q.float(), k.float(), v.float())
    assert rel_err(out, ref) < tol
    for g, w in zip(grads(out, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(g, w) < tol


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
def test_causal_a_later_token_moves_no_earlier_output(name: str) -> None:
    assert_causal(build(name, kernel="cpu").float(), *(x.detach() for x in make_qkv(N, dtype=torch.float32)))


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
def test_padding_at_the_end_changes_no_real_output(name: str) -> None:
    assert_padding_is_exact(build(name, kernel="cpu").float(), *make_qkv(N, dtype=torch.float32), tol=1e-6)


@needs_kernel
@pytest.mark.parametrize("name", NAMES)
def test_the_thread_count_changes_nothing(name: str) -> None:
    """Each (batch, head) group runs on one thread: the same bits on 1 and 2 threads."""
    attn = build(name, kernel="cpu").float()
    q, k, v = make_qkv(N, dtype=torch.float32)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = attn(q, k, v)
            results.append([out, *grads(out, [q, k, v])])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@needs_kernel
def test_no_states_are_kept_without_a_gradient() -> None:
    attn = build_attention("ttt_mlp", num_heads=H, head_dim=D, max_len=N)
    q, k, v = (x.detach().float() for x in make_qkv(N))
    with torch.no_grad():
        out = attn(q, k, v)
    assert out.shape == (B, H, N, D)
    flat = [torch.randn(2, 3, 4, D) for _ in range(3)]
    _, states, saved = cpu.ttt_forward(*flat, torch.rand(2, 3, 4), 1.0 / torch.arange(1, 5),
                                    torch.zeros(2, cpu.state_size(D, 4 * D)), torch.ones(2, D), torch.zeros(2, D),
                                    1e-6, 4 * D, False)
    assert states.numel() == 0 and saved.numel() == 0


@needs_kernel
def test_auto_takes_the_kernel_for_float32_cpu_tensors_only() -> None:
    x32, x64 = torch.zeros(1, 1, 4, D), torch.zeros(1, 1, 4, D, dtype=torch.float64)
    assert dispatch.pick_dual("auto", x32) is cpu.dual_form_cpu
    assert dispatch.pick_dual("cpu", x32) is cpu.dual_form_cpu
    assert dispatch.pick_dual("auto", x64) is dual_form
    assert dispatch.pick_dual("cpu", x64) is dual_form
    assert dispatch.pick_dual("torch", x32) is dual_form
    assert dispatch.refusals(x64) == ["ttt_cpu takes float32, not float64"]
    mlp = build_attention("ttt_mlp", num_heads=H, head_dim=D, max_len=N)
    assert type(mlp).implementation(mlp.cfg, torch.device("cpu")) == "attentions.ttt_mlp (cpu kernel)"
    mlp.cfg.kernel = "torch"
    assert type(mlp).implementation(mlp.cfg, torch.device("cpu")) == "attentions.ttt_mlp (torch kernel)"


def test_an_unknown_kernel_says_what_is_valid() -> None:
    with pytest.raises(AttentionError, match="kernel='triton' is not one of auto, torch, cpu"):
        build_attention("ttt_linear", num_heads=H, head_dim=D, max_len=N, kernel="triton")


def test_without_a_compiler_auto_runs_the_pytorch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where the kernel cannot be built: "auto" runs dual.py (and records say so), "cpu" says why."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    x = torch.zeros(1, 1, 4, D)
    assert dispatch.pick_dual("auto", x) is dual_form
    attn = build_attention("ttt_linear", num_heads=H, head_dim=D, max_len=N)
    assert type(attn).implementation(attn.cfg, torch.device("cpu")) == "attentions.ttt_linear (torch kernel)"
    q, k, v = make_qkv(N, dtype=torch.float32)
    out = attn(q, k, v)
    assert out.shape == (B, H, N, D) and all(g.abs().sum() > 0 for g in grads(out, [q, k, v]))
    with pytest.raises(AttentionError, match=r"ttt_mlp kernel='cpu' needs the C kernel.*no-such-compiler.*"
                                             r"kernel='torch'"):
        build_attention("ttt_mlp", num_heads=H, head_dim=D, max_len=N, kernel="cpu")


@needs_kernel
@pytest.mark.parametrize("size, d, hidden", [(16, 32, 0), (16, 32, 128), (5, 16, 64), (4, 4, 8)])
def test_the_buffer_sizes_agree_with_the_kernels(size: int, d: int, hidden: int) -> None:
    """The floats cpu.py allocates per state and per mini-batch are those the kernel writes."""
    lib = cpu.library()
    assert lib.ttt_state_size(d, hidden) == cpu.state_size(d, hidden)
    assert lib.ttt_saved_size(size, d, hidden) == cpu.saved_size(size, d, hidden)
