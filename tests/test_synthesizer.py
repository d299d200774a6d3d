"""Synthesizer (random, factorized random, with and without the dot product) against a per-head loop,
outputs and gradients; its degenerate forms; its fixed length; its YAML modes per task."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from attentions import AttentionError, build_attention
from attentions.backends.synthesizer import reference
from attentions.check import Battery, Sizes

B, H, N, D = 2, 2, 64, 16
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max().detach() / ref.abs().max().detach().clamp_min(1e-30))


def make_qkv(n: int, dtype: torch.dtype, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def make_mask(n: int, lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], rows: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Gradients of a fixed random projection of ``out`` over the real ``rows`` [B, N]; unused inputs give zeros."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if rows is not None:
        weight = weight * rows[:, None, :, None]
    got = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, got)]


def build(**options) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention("synthesizer", num_heads=H, head_dim=D, max_len=N, **options)


MODES = [
    pytest.param({"dot_product": False}, id="random"),
    pytest.param({"mode": "factorized_random", "k": 8, "dot_product": False}, id="factorized-k8"),
    pytest.param({}, id="random+dot"),
    pytest.param({"mode": "factorized_random", "k": 8}, id="factorized-k8+dot"),
]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")])
@pytest.mark.parametrize("masked", [pytest.param(False, id="full"), pytest.param(True, id="masked")])
@pytest.mark.parametrize("options", MODES)
def test_matches_the_per_head_loop(options: dict, masked: bool, dtype: torch.dtype) -> None:
    # N = 48 < max_len = 64: the leading 48 x 48 block of R
    attn = build(**options).to(dtype)
    q, k, v = make_qkv(48, dtype)
    mask = make_mask(48, [48, 29]) if masked else None
    params = list(attn.parameters())
    out = attn(q, k, v, mask)
    ref = reference(attn.logits(48), q, k, v, mask, attn.cfg.dot_product)
    got, want = [out] + grads(out, [q, k, v, *params], mask), [ref] + grads(ref, [q, k, v, *params], mask)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < TOL[dtype], f"tensor {i}: relative error {rel_err(a, b):.2e}"
    # q and k reach the output only through the dot product
    assert bool(got[1].abs().max() > 0) == attn.cfg.dot_product


def test_zero_logits_with_the_dot_product_are_full_attention() -> None:
    attn = build().double()
    with torch.no_grad():
        attn.R.zero_()
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64))
    mask = make_mask(N, [N, 29])
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    assert rel_err(attn(q, k, v, mask), full) < 1e-12


def test_factorized_is_random_with_the_product_as_its_matrix() -> None:
    factorized = build(mode="factorized_random", k=8, dot_product=False).double()
    random = build(dot_product=False).double()
    with torch.no_grad():
        random.R.copy_(factorized.R1 @ factorized.R2)
    q, k, v = (x.detach() for x in make_qkv(N, torch.float64))
    mask = make_mask(N, [N, 29])
    assert rel_err(factorized(q, k, v, mask), random(q, k, v, mask)) < 1e-12


def test_padded_keys_take_no_weight_without_the_dot_product() -> None:
    """The JAX code drops the mask in this mode; here padded values never reach a real row."""
    attn = build(dot_product=False)
    q, k, v = (x.detach() for x in make_qkv(N, torch.float32))
    mask = make_mask(N, [N, 29])
    noisy = torch.where(mask[:, None, :, None], v, 1e3 * torch.randn_like(v))
    real = mask[:, None, :, None]
    assert rel_err(attn(q, k, noisy, mask) * real, attn(q, k, v, mask) * real) < 1e-6
    # a row with no real token stays finite
    assert attn(q, k, v, make_mask(N, [N, 0])).isfinite().all()


@pytest.mark.parametrize("mode", ["random", "factorized_random"])
def test_the_contract_battery_passes_without_the_dot_product(mode: str) -> None:
    """lra-check-attn's padding checks (attentions/check.py) on the modes q and k take no part in."""
    overrides = {"mode": mode, "k": 8, "dot_product": False}
    battery = Battery("synthesizer", Sizes(batch=3, heads=H, length=N, head_dim=D), seed=0, overrides=overrides)
    battery.pick_dtype()
    for check in (battery.shapes_and_dtype, battery.finite, battery.padding_invariance, battery.padding_gradient,
                  battery.padded_vs_alone):
        check()


def test_a_sequence_longer_than_max_len_is_refused() -> None:
    attn = build_attention("synthesizer", num_heads=H, head_dim=D, max_len=32)
    with pytest.raises(AttentionError, match=r"max_len=32.*N=64"):
        attn(*(x.detach() for x in make_qkv(N, torch.float32)))


@pytest.mark.parametrize("options, shapes", [
    pytest.param({}, {"R": (H, N, N)}, id="random"),
    pytest.param({"mode": "factorized_random", "k": 8}, {"R1": (H, N, 8), "R2": (H, 8, N)}, id="factorized"),
])
def test_parameters_are_xavier_uniform_over_the_head_stack(options: dict, shapes: dict) -> None:
    attn = build(**options)
    assert {n: tuple(p.shape) for n, p in attn.named_parameters()} == shapes
    for name, (h, rows, cols) in shapes.items():
        bound = math.sqrt(6 / (h * (rows + cols)))
        assert bound * 0.95 < float(getattr(attn, name).detach().abs().max()) <= bound


def test_fixed_random_is_a_buffer_that_reloads() -> None:
    attn = build(fixed=True)
    assert list(attn.parameters()) == [] and list(attn.state_dict()) == ["R"]
    again = build_attention("synthesizer", num_heads=H, head_dim=D, max_len=N, fixed=True)
    assert not torch.equal(again.R, attn.R)
    again.load_state_dict(attn.state_dict())
    q, k, v = (x.detach() for x in make_qkv(N, torch.float32))
    assert torch.equal(again(q, k, v), attn(q, k, v))


def test_the_yaml_gives_each_task_its_jax_config_mode() -> None:
    from lra.config import resolve

    text = resolve("text", "synthesizer", "paper").attn_options
    listops = resolve("listops", "synthesizer", "paper").attn_options
    assert (text["mode"], text["k"], text["dot_product"]) == ("factorized_random", 32, False)
    assert (listops["mode"], listops["dot_product"]) == ("random", True)


def test_flops_and_errors() -> None:
    attn = build(mode="factorized_random", k=8, dot_product=True)
    assert attn.flops(attn.cfg, 100, 16) == (2e4 * 16 + 2e4 * 8 + 2e4 * 16, 3 * (2e4 * 16 + 2e4 * 8 + 2e4 * 16))
    assert attn.budget().startswith("N ")
    with pytest.raises(AttentionError, match="random, factorized_random"):
        build(mode="dense")
    with pytest.raises(AttentionError, match="k must be >= 1"):
        build(mode="factorized_random", k=0)
