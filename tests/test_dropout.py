"""The model's dropout (lra/model/dropout.py): on the CPU a C kernel whose mask is a hash of (seed, index).
Keep rate and scaling as torch's, no pattern between neighbours or calls, the same mask for the
gradient, repeatable under torch.manual_seed and for any thread count, and torch's own dropout
wherever the kernel does not apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attentions.ops import native
from conftest import same_both_ways
from lra.model import dropout as lra_dropout
from lra.config import ModelConfig
from lra.model.dropout import Dropout, dropout
from lra.model import LRAModel

needs_kernel = pytest.mark.skipif(not lra_dropout.fits(torch.zeros(1), 0.5),
                                  reason="the C kernels do not build here (no C compiler)")


@needs_kernel
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale_are_torchs(p: float) -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 1001, 67) + 0.5  # no zeros of its own; a size that is no multiple of 8
    y = dropout(x, p)
    kept = y != 0
    rate = kept.double().mean().item()
    # 201,201 draws: the keep rate is 1 - p within 5 standard deviations
    assert abs(rate - (1 - p)) < 5 * ((p * (1 - p)) / x.numel()) ** 0.5
    assert torch.allclose(y[kept], x[kept] / (1 - p))


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 17, 16383, 16385, 40001])
@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7, 2**63 - 25])
def test_mask_is_the_reference_hash(n: int, seed: int) -> None:
    # the kernel's mask, element by element, is the hash of dropout.reference_keep (whatever the vector
    # width, the threads' blocks or a tail shorter than a vector); kept elements scaled by 1 / (1 - p)
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5  # no zeros of its own
    for p in (0.1, 0.5):
        y = lra_dropout.dropout_op(x, p, torch.tensor(seed))
        keep = lra_dropout.reference_keep(n, p, seed)
        assert torch.equal(y != 0, keep)
        assert torch.equal(y[keep], x[keep] * torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))


@needs_kernel
def test_no_pattern_between_neighbours_positions_or_calls() -> None:
    torch.manual_seed(0)
    x = torch.ones(4, 512, 64)
    a, b = (dropout(x, 0.5) != 0 for _ in range(2))
    flat = a.flatten().double()
    for lag in (1, 8, 64):
        corr = torch.corrcoef(torch.stack([flat[:-lag], flat[lag:]]))[0, 1].item()
        assert abs(corr) < 0.01, f"lag {lag}"
    per_column = a.double().mean(dim=(0, 1))  # 2,048 draws per column
    assert (per_column - 0.5).abs().max() < 5 * (0.25 / 2048) ** 0.5
    assert abs((a & b).double().mean().item() - 0.25) < 0.01  # two calls: independent masks


@needs_kernel
def test_the_eager_function_is_the_operator() -> None:
    # eager calls take the kernel through DropoutFunction, torch.compile through lra::dropout: the same
    # mask and gradient for the same seed
    x = torch.randn(3, 100, 64)
    grad = torch.randn(3, 100, 64)
    assert same_both_ways(lambda t: lra_dropout.DropoutFunction.apply(t, 0.2, 987654321),
                          lambda t: lra_dropout.dropout_op(t, 0.2, torch.tensor(987654321)), x, grad)


@needs_kernel
def test_gradient_takes_the_forwards_mask() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 300, 64, requires_grad=True)
    y = dropout(x, 0.3)
    grad = torch.randn_like(y)
    y.backward(grad)
    kept = y != 0
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], grad[kept] / 0.7)


@needs_kernel
def test_repeatable_under_manual_seed_and_for_any_thread_count() -> None:
    x = torch.randn(2, 2048, 64)
    threads, masks = torch.get_num_threads(), []
    try:
        for count in (1, 2, 2):
            torch.set_num_threads(count)
            torch.manual_seed(7)
            masks.append(dropout(x, 0.1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[1], masks[2])
    torch.manual_seed(8)
    assert not torch.equal(dropout(x, 0.1), masks[0])


def test_eval_p0_p1_and_other_dtypes_match_torch() -> None:
    x = torch.randn(4, 16, 8)
    module = Dropout(0.2)
    module.eval()
    assert module(x) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    half = x.to(torch.bfloat16)
    torch.manual_seed(3)
    ours = dropout(half, 0.4)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(half, 0.4))  # not float32: torch's dropout, draw for draw


def test_without_the_kernel_it_is_torchs_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_why_not", {})
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not lra_dropout.fits(torch.zeros(1), 0.4)
    x = torch.randn(4, 16, 8)
    torch.manual_seed(3)
    ours = dropout(x, 0.4)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(x, 0.4))


def test_the_model_uses_it() -> None:
    cfg = ModelConfig(num_layers=1, dim=16, num_heads=2, ffn_dim=32, dropout=0.1)
    model = LRAModel(cfg, "full", {}, vocab_size=10, num_classes=3, max_len=32)
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(isinstance(m, Dropout) for m in drops)
