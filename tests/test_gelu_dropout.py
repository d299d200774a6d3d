"""The FFN's GELU and dropout in one kernel (lra/model/gelu_dropout.py): the exact GELU to 1e-6 |x| and the
dropout kernel's mask element for element, its gradient against float64 autograd of the same,
the same draws from torch's generator as the two modules, the same bits through its operator (what
torch.compile traces) and its eager Function, and torch's GELU and the model's dropout wherever the
kernel does not apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attentions.ops import native
from conftest import same_both_ways
from lra.config import ModelConfig
from lra.model import LRAModel
from lra.model import gelu_dropout as fused
from lra.model.dropout import Dropout, reference_keep

needs_kernel = pytest.mark.skipif(not fused.fits(torch.zeros(1), 0.5),
                                  reason="the C kernels do not build here (no C compiler)")


def close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, tol: float = 1e-6) -> bool:
    """|got - want| <= tol max(1, |x|) elementwise (GELU's error grows with |x|)."""
    return bool(((got.double() - want.double()).abs() <= tol * x.double().abs().clamp(min=1.0)).all())


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 4097, 8 * 1024 * 128 + 3])
@pytest.mark.parametrize("p, seed", [(0.0, 0), (0.1, 12345), (0.5, 2**62 + 11)])
def test_forward_is_the_exact_gelu_under_the_dropout_mask(n: int, p: float, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4
    y = fused.gelu_dropout_op(x, p, torch.tensor(seed))
    assert close(y, fused.reference(x, p, seed), x)
    if p > 0:
        keep = reference_keep(n, p, seed)
        assert bool((y[~keep] == 0).all())
    else:
        assert close(y, F.gelu(x), x, 2e-6)  # and torch's nn.GELU, to its own float rounding


@needs_kernel
@pytest.mark.parametrize("p, seed", [(0.0, 0), (0.3, 77)])
def test_gradient_equals_float64_autograd(p: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(5, 333, generator=gen) * 3, torch.randn(5, 333, generator=gen)
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(fused.reference(x64, p, seed), x64, grad.double())
    got = fused.gelu_dropout_backward(grad, x, p, torch.tensor(seed))
    assert close(got, want, x)


@needs_kernel
def test_the_same_draws_and_mask_as_the_two_modules() -> None:
    # within +-3 no GELU value is 0 (below, torch's underflows to 0 where the erfc form does not)
    x = (torch.randn(4, 100, 32) * 2).clamp(-3, 3)
    torch.manual_seed(5)
    ours = fused.gelu_dropout(x, 0.2)
    after_ours = torch.rand(1)
    torch.manual_seed(5)
    modules = Dropout(0.2)(F.gelu(x))
    assert torch.equal(torch.rand(1), after_ours)  # one draw each
    assert torch.equal(ours == 0, modules == 0) and close(ours, modules, x, 2e-6)


@needs_kernel
def test_the_eager_function_is_the_operator() -> None:
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(3, 50, 64, generator=gen), torch.randn(3, 50, 64, generator=gen)
    assert same_both_ways(lambda t: fused.GELUDropoutFunction.apply(t, 0.1, 4242),
                          lambda t: fused.gelu_dropout_op(t, 0.1, torch.tensor(4242)), x, grad)


def test_torchs_gelu_and_the_dropout_where_the_kernel_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 16, 8)
    # evaluation: GELU alone, no draw from the generator
    state = torch.get_rng_state()
    assert close(fused.gelu_dropout(x, 0.3, training=False), F.gelu(x), x, 2e-6)
    assert torch.equal(torch.get_rng_state(), state)
    # another dtype: torch's GELU and dropout, draw for draw
    half = x.to(torch.bfloat16)
    torch.manual_seed(3)
    ours = fused.gelu_dropout(half, 0.4)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(F.gelu(half), 0.4))
    # no C compiler: the same
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    torch.manual_seed(3)
    ours = fused.gelu_dropout(x, 0.4)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(F.gelu(x), 0.4))


@needs_kernel
def test_the_block_runs_its_ffn_through_it() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, dim=16, num_heads=2, ffn_dim=32, dropout=0.1)
    block = LRAModel(cfg, "full", {}, vocab_size=10, num_classes=3, max_len=32).encoder.blocks[0]
    x = torch.randn(2, 20, 16)
    torch.manual_seed(9)
    got = block(x, None)
    # the same step with the FFN's modules in turn: the same draws, the same mask, GELU to rounding
    torch.manual_seed(9)
    mixed = block.attn(*block.qkv(block.norm1(x)).view(2, 20, 3, 2, 8).permute(2, 0, 3, 1, 4).contiguous(), mask=None)
    h = x + block.drop(block.proj(mixed.transpose(1, 2).reshape(2, 20, 16)))
    want = h + block.ffn(block.norm2(h))
    assert torch.allclose(got, want, atol=1e-5)
