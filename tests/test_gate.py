"""The model's output gate (model.gate): a fourth view g of the input projection, the attention output
times SiLU(g) before the output projection; off, the encoder is the plain one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lra.config import ModelConfig
from lra.model import LRAModel
from lra.model.encoder import Block


def block(gate: bool, attn: str = "full") -> Block:
    torch.manual_seed(0)
    return Block(ModelConfig(dim=16, num_heads=2, ffn_dim=32, dropout=0.0, gate=gate), attn, {}, 64).eval()


def test_off_the_block_has_the_plain_parameters_and_output() -> None:
    plain = block(False)
    assert plain.qkv.weight.shape == (48, 16)
    torch.manual_seed(0)
    default = Block(ModelConfig(dim=16, num_heads=2, ffn_dim=32, dropout=0.0), "full", {}, 64).eval()
    x = torch.randn(2, 64, 16)
    assert torch.equal(plain(x, None), default(x, None))
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in default.state_dict().items()}


def test_on_the_attention_output_is_multiplied_by_silu_of_the_fourth_view() -> None:
    gated = block(True)
    assert gated.qkv.weight.shape == (64, 16)
    x = torch.randn(2, 64, 16)
    # by hand: q, k, v, g from one projection; heads of 8; softmax attention; gate; projection
    views = gated.qkv(gated.norm1(x))
    q, k, v, g = views.split(16, dim=-1)
    heads = lambda t: t.view(2, 64, 2, 8).transpose(1, 2)  # noqa: E731
    att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(2, 64, 16)
    h = x + gated.proj(att * F.silu(g))
    expected = h + gated.ffn(gated.norm2(h))
    assert torch.allclose(gated(x, None), expected, atol=1e-5)
    # g is a trained view: its weights receive a gradient
    gated(x, None).sum().backward()
    assert gated.qkv.weight.grad[48:].abs().sum() > 0


@pytest.mark.parametrize("attn", ["full", "linear", "mita"])
def test_gated_model_ignores_padding(attn: str) -> None:
    torch.manual_seed(0)
    model = LRAModel(ModelConfig(dim=16, num_heads=2, ffn_dim=32, dropout=0.0, gate=True), attn, {}, 20, 5, 64).eval()
    tokens = torch.randint(1, 20, (2, 64))
    lengths = torch.tensor([64, 37])
    changed = tokens.clone()
    changed[1, 37:] = torch.randint(0, 20, (27,))
    batch = model(tokens, lengths)
    assert torch.allclose(batch, model(changed, lengths), atol=1e-5)
    assert torch.allclose(batch[1], model(tokens[1:, :37], torch.tensor([37]))[0], atol=1e-5)
