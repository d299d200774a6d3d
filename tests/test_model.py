"""The model: pooling ignores padding, the dual head, no mask derived from token ids."""
from __future__ import annotations

import torch

from lra.config import ModelConfig
from lra.model import LRAModel


def make(pooling: str = "mean", dual: bool = False, padded: bool = True) -> LRAModel:
    torch.manual_seed(0)
    model = LRAModel(ModelConfig(pooling=pooling, dropout=0.0), "full", {}, 20, 5, 48, dual=dual, padded=padded)
    return model.eval()


def test_padding_content_does_not_change_logits() -> None:
    for pooling in ("mean", "cls"):
        model = make(pooling)
        tokens = torch.randint(1, 20, (2, 48))
        lengths = torch.tensor([48, 29])
        changed = tokens.clone()
        changed[1, 29:] = torch.randint(0, 20, (19,))
        assert torch.allclose(model(tokens, lengths), model(changed, lengths), atol=1e-6)


def test_padded_row_equals_the_same_row_alone() -> None:
    model = make()
    tokens = torch.randint(1, 20, (2, 48))
    lengths = torch.tensor([48, 29])
    batch = model(tokens, lengths)
    alone = model(tokens[1:, :29], torch.tensor([29]))
    assert torch.allclose(batch[1], alone[0], atol=1e-5)


def test_unpadded_task_treats_token_zero_as_data() -> None:
    # images: pixel 0 is real, so no mask: changing the zero pixels changes the logits
    model = make(padded=False)
    tokens = torch.randint(1, 20, (1, 48))
    tokens[0, 30:] = 0
    other = tokens.clone()
    other[0, 30:] = 7
    full = torch.tensor([48])
    assert not torch.allclose(model(tokens, full), model(other, full))


def test_dual_head_combines_both_documents() -> None:
    model = make(dual=True)
    tokens = torch.randint(1, 20, (3, 2, 48))
    lengths = torch.tensor([[48, 20], [10, 48], [5, 6]])
    logits = model(tokens, lengths)
    assert logits.shape == (3, 5)
    # each example's logits depend on its own two documents only, and on both of them
    swapped = tokens.clone()
    swapped[1, 1] = torch.randint(1, 20, (48,))
    out = model(swapped, lengths)
    assert torch.allclose(out[0], logits[0], atol=1e-6) and not torch.allclose(out[1], logits[1])
    u = model.encoder(tokens[:, 0], lengths[:, 0])
    v = model.encoder(tokens[:, 1], lengths[:, 1])
    manual = model.head(torch.cat([u, v, u * v, u - v], dim=-1))
    assert torch.allclose(manual, logits, atol=1e-5)
