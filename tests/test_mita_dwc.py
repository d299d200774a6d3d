"""MiTA's dwc option (the paper's MiTA + DWC): off it is base MiTA exactly; on, the depth-wise convolution
of the values (1-D along the sequence, or 2-D over the grid as the authors' code) is added to the
output, and padding never reaches a real position through it."""
from __future__ import annotations

from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from attentions import AttentionError, build_attention
from attentions.backends.mita import reference
from attentions.check import Battery, Sizes

B, H, N, D = 2, 2, 64, 16
LENGTHS = [N, 29]


def make_qkv(n: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def build(n: int = N, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention("mita", num_heads=H, head_dim=D, max_len=n, landmarks=8, topk=8, **options)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def conv_along_sequence(
    v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """y[b, h, i, d] = bias[c] + sum_t w[c, t] v[b, h, i + t - r, d] over real positions, c = h D + d."""
    if mask is not None:
        v = v * mask[:, None, :, None]
    taps = weight.shape[-1]
    r = taps // 2
    w = weight.view(H, D, taps)  # [H, D, taps]
    out = bias.view(1, H, 1, D).expand_as(v).clone()
    n = v.shape[2]
    for t in range(taps):
        shift = t - r
        lo, hi = max(0, -shift), min(n, n - shift)
        out[:, :, lo:hi] = out[:, :, lo:hi] + w[None, :, None, :, t] * v[:, :, lo + shift : hi + shift]
    return out


def authors_dwc(v: torch.Tensor, conv: torch.nn.Conv2d, side: int) -> torch.Tensor:
    """QishuaiWen/MiTA MiTA-DeiT/mita/mita_attention_conv.py, restated: the values without the first
    (class) token laid out [B, C, s, s] (channels head-major), a 3 x 3 depth-wise conv, the class
    token's row padded with zeros; returned as [B, H, N, D]."""
    b, h, n, d = v.shape
    c = h * d
    grid = v[:, :, 1:, :].transpose(1, 2).reshape(b, side, side, c).permute(0, 3, 1, 2)
    x_ = F.conv2d(grid, conv.weight, conv.bias, padding=1, groups=c).permute(0, 2, 3, 1).reshape(b, n - 1, c)
    x_ = F.pad(x_, (0, 0, 1, 0))  # [B, N, C]
    return x_.view(b, n, h, d).transpose(1, 2)


def test_off_is_base_mita_exactly() -> None:
    """No parameter, no buffer, no draw from the global generator (so a model's other weights are
    initialised as before), and the output of steps 1-5 unchanged."""
    state = torch.get_rng_state()
    off = build_attention("mita", num_heads=H, head_dim=D, max_len=N, landmarks=8, topk=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert list(off.state_dict()) == [] and off.dwc is None
    q, k, v = make_qkv(N)
    mask = make_mask(N, LENGTHS)
    out = off(q, k, v, mask)
    assert torch.equal(out, off.mix(q, k, v, mask))
    ref = reference(q, k, v, mask, landmarks=8, topk=8)
    real = mask[:, None, :, None]
    assert rel_err(out * real, ref * real) < 1e-10
    # on, with a zero kernel and bias, adds exactly nothing to the same computation
    on = build(dwc=True).double()
    with torch.no_grad():
        on.dwc.weight.zero_()
        on.dwc.bias.zero_()
    assert torch.equal(on(q, k, v, mask), out)


@pytest.mark.parametrize("taps", [3, 5], ids=["k3", "k5"])
def test_one_d_term_matches_the_tap_loop(taps: int) -> None:
    attn = build(dwc=True, dwc_kernel=taps).double()
    assert tuple(attn.dwc.weight.shape) == (H * D, 1, taps) and tuple(attn.dwc.bias.shape) == (H * D,)
    q, k, v = make_qkv(N)
    mask = make_mask(N, LENGTHS)
    out = attn(q, k, v, mask)
    ref = attn.mix(q, k, v, mask) + conv_along_sequence(v, attn.dwc.weight, attn.dwc.bias, mask)
    inputs = [q, k, v, attn.dwc.weight, attn.dwc.bias]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    weight = weight * mask[:, None, :, None]
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    real = mask[:, None, :, None]
    assert rel_err(out * real, ref * real) < 1e-10
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-10, f"gradient {i}"


def test_grid_with_a_cls_token_matches_the_authors() -> None:
    """dwc_grid = 8 on N = 65: a cls token then an 8 x 8 grid, as DeiT's tokens in the authors' code."""
    attn = build(65, dwc=True, dwc_grid=8).double()
    assert tuple(attn.dwc.weight.shape) == (H * D, 1, 3, 3)
    q, k, v = make_qkv(65)
    out = attn(q, k, v)
    ref = attn.mix(q, k, v) + authors_dwc(v, attn.dwc, 8)
    assert rel_err(out, ref) < 1e-10
    # the cls token's output is base MiTA's, and a grid of N = 64 needs no cls token
    assert torch.equal(out[:, :, 0], attn.mix(q, k, v)[:, :, 0])
    plain = build(64, dwc=True, dwc_grid=8).double()
    q64, k64, v64 = (x[:, :, 1:] for x in (q, k, v))
    assert rel_err(plain(q64, k64, v64) - plain.mix(q64, k64, v64), authors_dwc(v, plain.dwc, 8)[:, :, 1:]) < 1e-10


@pytest.mark.parametrize("n, options", [
    pytest.param(N, {}, id="1d"),
    pytest.param(65, {"dwc_grid": 8}, id="grid8-cls"),
])
def test_padded_values_never_reach_real_outputs(n: int, options: dict) -> None:
    attn = build(n, dwc=True, **options).double()
    q, k, v = (x.detach() for x in make_qkv(n))
    mask = make_mask(n, [n, 29])
    real = mask[:, None, :, None]
    noisy = torch.where(real, v, 1e3 * torch.randn_like(v))
    assert rel_err(attn(q, k, noisy, mask) * real, attn(q, k, v, mask) * real) < 1e-10


def test_one_d_padded_row_equals_the_row_alone() -> None:
    attn = build(dwc=True).double()
    q, k, v = (x.detach() for x in make_qkv(N))
    out = attn(q, k, v, make_mask(N, LENGTHS))
    alone = attn(q[1:, :, :29], k[1:, :, :29], v[1:, :, :29])
    assert rel_err(out[1:, :, :29], alone) < 1e-10


def test_the_contract_battery_passes_with_dwc_on() -> None:
    """lra-check-attn's checks (attentions/check.py) on MiTA + DWC, 5 taps, at a small size."""
    overrides = {"dwc": True, "dwc_kernel": 5, "landmarks": 4, "topk": 4}
    battery = Battery("mita", Sizes(batch=3, heads=H, length=32, head_dim=8), seed=0, overrides=overrides)
    battery.pick_dtype()
    # (padding invariance of the values is the perturbation test above; of q and k, base MiTA's own)
    for check in (battery.finite, battery.padding_gradient, battery.padded_vs_alone, battery.budget):
        check()


def test_errors_name_the_setting() -> None:
    with pytest.raises(AttentionError, match="dwc_kernel must be a positive odd integer"):
        build(dwc=True, dwc_kernel=4)
    attn = build(dwc=True, dwc_grid=7)
    with pytest.raises(AttentionError, match=r"N must be 49 \(or 50 with a cls token\); got N=64"):
        attn(*(x.detach().float() for x in make_qkv(N)))


def test_off_in_every_task_and_on_with_a_set() -> None:
    from lra.config import resolve

    for task in ("listops", "text", "retrieval", "image", "pathfinder", "mqar"):
        assert "dwc" not in resolve(task, "mita", "paper").attn_options
    on = resolve("image", "mita", "paper", sets=["attn.dwc=true", "attn.dwc_grid=32"]).attn_options
    assert on["dwc"] is True and on["dwc_grid"] == 32
    flops = build_attention("mita", num_heads=1, head_dim=D, max_len=N).flops
    base = flops(build(dwc=False).cfg, 1024, 32)[0]
    assert flops(build(dwc=True).cfg, 1024, 32)[0] == base + 2 * 1024 * 32 * 3
