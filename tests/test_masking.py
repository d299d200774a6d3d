"""attentions/masking.py: our adaptive pooling against torch's F.adaptive_avg_pool1d (which it
replaces: torch's CUDA kernel fails an internal assertion at 64K tokens), and bins over real tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attentions.masking import adaptive_pool, pool_real


def torch_pool(x: torch.Tensor, bins: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return F.adaptive_avg_pool1d(x.reshape(b * h, n, d).transpose(1, 2), bins).transpose(1, 2).reshape(b, h, bins, d)


@pytest.mark.parametrize("n, bins", [(64, 8), (65, 8), (7, 3), (100, 64), (1000, 7), (5, 5), (6, 4), (3, 1)])
def test_adaptive_pool_is_torchs_bin_rule(n: int, bins: int) -> None:
    x = torch.randn(2, 3, n, 4, dtype=torch.float64, requires_grad=True)
    ours, ref = adaptive_pool(x, bins), torch_pool(x, bins)
    assert ours.shape == (2, 3, bins, 4)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(ref)
    g_ours = torch.autograd.grad((ours * w).sum(), x)[0]
    g_ref = torch.autograd.grad((ref * w).sum(), x)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [4096, 4099])
def test_bf16_pool_keeps_its_dtype_and_accumulates_in_float32(n: int) -> None:
    x = torch.randn(1, 2, n, 8)
    out = adaptive_pool(x.bfloat16(), 16)
    assert out.dtype == torch.bfloat16
    # only the bf16 rounding of the inputs and of the result: a bf16 running sum of 256 values would be far off
    torch.testing.assert_close(out.float(), torch_pool(x.bfloat16().float(), 16), rtol=1e-2, atol=1e-2)


def test_pool_real_lays_bins_over_real_tokens() -> None:
    x = torch.randn(2, 1, 12, 3)
    mask = torch.arange(12)[None, :] < torch.tensor([12, 5])[:, None]
    pooled, bin_mask = pool_real(x, mask, 8)
    assert bin_mask.tolist() == [[True] * 8, [True] * 5 + [False] * 3]
    torch.testing.assert_close(pooled[1:, :, :5], x[1:, :, :5])  # 5 real tokens -> one bin each
    assert bool((pooled[1, :, 5:] == 0).all())
    torch.testing.assert_close(pooled[:1], torch_pool(x[:1], 8))
