"""The full backend against a plain softmax reference: outputs and gradients, with and without masks."""
from __future__ import annotations

import pytest
import torch

from attentions import build_attention
from attentions.backends.full import flash_attn_varlen_func, reference
from conftest import lengths_mask, rel_err

CASES = {
    "B2-N64-H2-D16-nomask": (2, 2, 64, 16, None),
    "B2-N64-H2-D16-masked": (2, 2, 64, 16, [64, 29]),
    "B3-N37-H1-D8-masked": (3, 1, 37, 8, [1, 20, 37]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_full_matches_reference_outputs_and_grads(case: tuple) -> None:
    b, h, n, d, lengths = case
    torch.manual_seed(0)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention("full", num_heads=h, head_dim=d, max_len=n)
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    out = attn(*inputs, mask=mask)
    ref = reference(*inputs, mask=mask)
    real = slice(None) if mask is None else mask[:, None, :, None].expand_as(out)
    assert rel_err(out[real], ref[real]) < 1e-10
    weight = torch.randn_like(out) * (1 if mask is None else mask[:, None, :, None])
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-10


def test_full_ignores_padded_keys() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    mask = lengths_mask([6], 10)
    out = build_attention("full", num_heads=2, head_dim=4, max_len=10)(q, k, v, mask)
    alone = reference(q[:, :, :6], k[:, :, :6], v[:, :, :6])
    assert rel_err(out[:, :, :6], alone) < 1e-6
    assert torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available() or flash_attn_varlen_func is None, reason="needs CUDA and flash-attn")
def test_flash_varlen_matches_reference_on_gpu() -> None:
    torch.manual_seed(0)
    b, h, n, d = 3, 2, 128, 32
    mask = lengths_mask([128, 50, 7], n).cuda()
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = build_attention("full", num_heads=h, head_dim=d, max_len=n)(q, k, v, mask)
    ref = reference(q.float(), k.float(), v.float(), mask)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_err(out.float()[real], ref[real]) < 2e-2
    g = torch.autograd.grad(out.float()[real].sum(), q)[0].float()
    gr = torch.autograd.grad(ref[real].sum(), q)[0]
    assert rel_err(g, gr) < 5e-2
