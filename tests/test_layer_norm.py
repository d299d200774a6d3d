"""The model's layer norm (lra/model/layer_norm.py): on the CPU a C kernel, equal to torch's layer norm to
float rounding in its output and its three gradients (rows shorter than a vector, tails, many
blocks of the weight gradients' sums), the same bits for any thread count, the same bits through
its operator (what torch.compile traces) and its eager Function, and torch's own layer norm
wherever the kernel does not apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attentions.ops import native
from conftest import rel_err
from lra.config import ModelConfig
from lra.model import LRAModel
from lra.model import layer_norm as lra_layer_norm
from lra.model.layer_norm import LayerNorm

needs_kernel = pytest.mark.skipif(not lra_layer_norm.fits(torch.zeros(1), torch.zeros(1), torch.zeros(1)),
                                  reason="the C kernels do not build here (no C compiler)")


def pair(c: int, seed: int = 0):
    """torch's LayerNorm and ours over c features, with the same random weight and bias."""
    gen = torch.Generator().manual_seed(seed)
    ref, ours = torch.nn.LayerNorm(c), LayerNorm(c)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(c, generator=gen))
        ref.bias.copy_(torch.randn(c, generator=gen))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def forward_backward(module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    return [y.detach(), *torch.autograd.grad(y, [x, module.weight, module.bias], grad)]


@needs_kernel
@pytest.mark.parametrize("shape", [(8, 1024, 64), (3, 7, 33), (1, 1, 5), (2, 300, 128), (700, 17)])
def test_equals_torchs_layer_norm(shape) -> None:
    # 64: the encoder's width; 33, 17, 5: tails past whole vectors; 8 x 1024 and 700 rows: several
    # blocks of the weight and bias gradients' sums
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * 3 + 1
    grad = torch.randn(shape, generator=gen)
    ref, ours = pair(shape[-1])
    for name, got, want in zip(("y", "dx", "d weight", "d bias"), forward_backward(ours, x, grad),
                               forward_backward(ref, x, grad)):
        assert rel_err(got, want) < 1e-5, name


@needs_kernel
def test_same_bits_for_any_thread_count_and_through_the_operator() -> None:
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(4, 700, 64, generator=gen), torch.randn(4, 700, 64, generator=gen)
    _, ours = pair(64)
    threads, results = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(forward_backward(ours, x, grad))
    finally:
        torch.set_num_threads(threads)
    # the operator pair torch.compile traces: the same kernel calls as the eager Function
    y, mean, rstd = lra_layer_norm.layer_norm_op(x, ours.weight.detach(), ours.bias.detach(), ours.eps)
    results.append([y, *lra_layer_norm.layer_norm_backward(grad, x, mean, rstd, ours.weight.detach())])
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@needs_kernel
def test_a_strided_input_is_normalised_as_its_copy() -> None:
    x = torch.randn(64, 30).t()  # [30, 64], not contiguous
    _, ours = pair(64)
    grad = torch.randn(30, 64)
    for a, b in zip(forward_backward(ours, x, grad), forward_backward(ours, x.contiguous(), grad)):
        assert torch.equal(a, b)


def test_torchs_layer_norm_where_the_kernel_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 6, 8)
    # no weight and bias, two normalised dims, another dtype: torch's own, bit for bit
    plain = LayerNorm(8, elementwise_affine=False)
    assert torch.equal(plain(x), F.layer_norm(x, (8,), eps=plain.eps))
    two = LayerNorm((6, 8))
    assert torch.equal(two(x), F.layer_norm(x, (6, 8), two.weight, two.bias, two.eps))
    double = LayerNorm(8).double()
    assert torch.equal(double(x.double()), F.layer_norm(x.double(), (8,), double.weight, double.bias, double.eps))
    # no C compiler: torch's
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    module = LayerNorm(8)
    assert torch.equal(module(x), F.layer_norm(x, (8,), module.weight, module.bias, module.eps))


def test_the_model_uses_it() -> None:
    cfg = ModelConfig(num_layers=2, dim=16, num_heads=2, ffn_dim=32)
    model = LRAModel(cfg, "full", {}, vocab_size=10, num_classes=3, max_len=32)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 5 and all(isinstance(m, LayerNorm) for m in norms)
    # a checkpoint's entries are nn.LayerNorm's
    assert all(set(m.state_dict()) == {"weight", "bias"} for m in norms)
