"""One battery for every registered backend: shapes, finiteness, padding, mixed lengths, registry errors.

The backends are whatever ``list_attentions()`` returns, each built with its defaults at max_len=64, so
a new backend is covered the moment it registers. Backends whose ``supports_mask`` is False skip the
mask tests. The padding checks are lra-check-attn's own (attentions/check.py), not rewritten here.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, List, Optional, Sequence, Tuple

import pytest
import torch

from attentions import Attention, AttentionError, Taxonomy, build_attention, get_attention, list_attentions, register
from attentions.base import SCALING_STRATEGIES
from attentions.check import Battery, Sizes, real_lengths

B, H, N, D = 2, 2, 64, 16
NAMES = list_attentions()
# real lengths of the padded rows: a full row, one past a block boundary, one shorter than most budgets
LENGTHS = (N, 29, 7)


def build(name: str) -> Attention:
    torch.manual_seed(0)
    return build_attention(name, num_heads=H, head_dim=D, max_len=N)


def make_qkv(batch: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, N, D, generator=gen, dtype=dtype) for _ in range(3)]


def make_mask(lengths: Sequence[int]) -> torch.Tensor:
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]  # [B, N]


def skip_without_mask(name: str) -> None:
    if not get_attention(name).supports_mask:
        pytest.skip(f"{name} declares supports_mask=False, so the builder never pairs it with padding")


def cases(suffix: str = "", batch: int = B) -> List[Any]:
    return [pytest.param(name, id=f"{name}-B{batch}-N{N}{suffix}") for name in NAMES]


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", cases())
def test_shape_and_dtype_kept(name: str, dtype: torch.dtype, masked: bool) -> None:
    if masked:
        skip_without_mask(name)
    attn = build(name).to(dtype)
    q, k, v = make_qkv(B, dtype)
    try:
        out = attn(q, k, v, make_mask(LENGTHS[:B]) if masked else None)
    except AttentionError as err:
        if dtype is torch.float32:
            raise
        pytest.skip(f"{name} does not run in float64: {err}")
    assert out.shape == (B, H, N, D)
    assert out.dtype == dtype


@pytest.mark.parametrize("name", cases("-masked"))
def test_forward_backward_finite(name: str) -> None:
    skip_without_mask(name)
    attn = build(name)
    q, k, v = (x.requires_grad_() for x in make_qkv(B))
    out = attn(q, k, v, make_mask(LENGTHS[:B]))
    # padded rows included: they must be finite, not NaN from an all-masked softmax
    assert bool(out.isfinite().all()), "non-finite output rows"
    out.square().sum().backward()
    for label, tensor in [("q", q), ("k", k), ("v", v)] + list(attn.named_parameters()):
        assert tensor.grad is not None and bool(tensor.grad.isfinite().all()), f"non-finite gradient of {label}"


def padded_battery(name: str) -> Battery:
    """lra-check-attn's battery (attentions/check.py) for ``name`` on the padded batch of real lengths
    LENGTHS, in float64 where the backend runs in it."""
    battery = Battery(name, Sizes(batch=len(LENGTHS), heads=H, length=N, head_dim=D), seed=0)
    assert real_lengths(battery.sizes) == list(LENGTHS)
    battery.pick_dtype()
    return battery


PADDED = cases("-lengths" + "-".join(map(str, LENGTHS)), batch=len(LENGTHS))


@pytest.mark.parametrize("name", PADDED)
def test_padding_is_invisible(name: str) -> None:
    skip_without_mask(name)
    battery = padded_battery(name)
    # large noise at padded positions of q, k and v changes no real output
    battery.padding_invariance()
    # and to first order: the real outputs send no gradient to padded positions
    battery.padding_gradient()


@pytest.mark.parametrize("name", PADDED)
def test_mixed_lengths_match_each_alone(name: str) -> None:
    skip_without_mask(name)
    padded_battery(name).padded_vs_alone()


@pytest.mark.parametrize("name", NAMES)
def test_backend_describes_itself(name: str) -> None:
    cls = get_attention(name)
    assert isinstance(cls.taxonomy, Taxonomy) and cls.taxonomy.scaling in SCALING_STRATEGIES
    for field in dataclasses.fields(cls.taxonomy):
        assert getattr(cls.taxonomy, field.name).strip(), f"empty taxonomy.{field.name}"
    assert cls.paper.strip() and cls.cost.strip()
    budget = build(name).budget()
    assert isinstance(budget, str) and budget.strip()
    # every hyperparameter has a default, so build_attention(name) works with no overrides
    for field in dataclasses.fields(cls.Config):
        assert field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(AttentionError) as err:
        build_attention("no-such-attention", num_heads=H, head_dim=D, max_len=N)
    message = str(err.value)
    assert "no-such-attention" in message
    assert all(name in message for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_override_names_key_and_valid_ones(name: str) -> None:
    with pytest.raises(AttentionError) as err:
        build_attention(name, num_heads=H, head_dim=D, max_len=N, no_such_option=1)
    message = str(err.value)
    assert "no_such_option" in message
    valid = [f.name for f in dataclasses.fields(get_attention(name).Config)]
    assert all(field in message for field in valid) if valid else "(none)" in message


def wrong_value(kind: Any) -> Optional[Any]:
    """A value of the wrong type for a field annotated ``kind``; None where the type is not checked."""
    if typing.get_origin(kind) is typing.Union:
        kind = next(option for option in typing.get_args(kind) if option is not type(None))
    if kind in (int, float, bool):
        return "not-a-number"
    if kind is str:
        return 3
    return None


def wrong_values(name: str) -> List[Tuple[str, Any]]:
    """(field, a value of the wrong type) for each type-checked hyperparameter of backend ``name``."""
    hints = typing.get_type_hints(get_attention(name).Config)
    return [(field, wrong_value(kind)) for field, kind in hints.items() if wrong_value(kind) is not None]


# the backends with int/float/bool/str hyperparameters (full has none: its overrides are all unknown keys)
TYPED = [name for name in NAMES if wrong_values(name)]


def test_a_backend_left_out_of_the_wrong_type_cases_has_no_hyperparameters() -> None:
    assert [name for name in NAMES if name not in TYPED and dataclasses.fields(get_attention(name).Config)] == []


@pytest.mark.parametrize("name", TYPED)
def test_wrong_override_type_is_named(name: str) -> None:
    for field, value in wrong_values(name):
        with pytest.raises(AttentionError, match=field):
            build_attention(name, num_heads=H, head_dim=D, max_len=N, **{field: value})


def test_duplicate_registration_rejected() -> None:
    original = get_attention(NAMES[0])

    class Impostor(Attention):
        paper = "nobody"
        cost = "O(1)"
        taxonomy = Taxonomy("none", "1", "none", "none", "none")

    with pytest.raises(AttentionError, match=f"takes the name of the built-in backend '{NAMES[0]}'"):
        register(NAMES[0])(Impostor)
    assert get_attention(NAMES[0]) is original


def test_a_plugin_taking_a_built_in_name_is_told_its_file_and_the_way_out(tmp_path, isolated_registry) -> None:
    from attentions import load_attention_module

    plugin = tmp_path / "my_performer.py"
    plugin.write_text("from attentions import register\n"
                      "from attentions.backends.performer import PerformerAttention\n\n\n"
                      "@register('performer')\nclass Mine(PerformerAttention):\n    pass\n")
    with pytest.raises(AttentionError) as err:
        load_attention_module(str(plugin))
    assert str(err.value) == (
        f"{plugin}: @register('performer') takes the name of the built-in backend 'performer' "
        "(attentions/backends/performer.py); register it under a name of its own, e.g. @register('performer_mine') "
        "(a wrapper of a built-in subclasses it and takes a new name: docs/backends.md, 'Adding a backend')")
    # the way out works: the wrapper under a name of its own
    plugin.write_text(plugin.read_text().replace("@register('performer')", "@register('performer_mine')"))
    assert load_attention_module(str(plugin)) == ["performer_mine"]
