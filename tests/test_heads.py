"""split_heads: the projection's output into contiguous q, k, v, bit for bit the strided views."""
import pytest
import torch

from lra.model.heads import split_heads


def views(qkv: torch.Tensor, heads: int):
    b, n, width = qkv.shape
    return qkv.view(b, n, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)


@pytest.mark.parametrize("b,n,heads,d", [(2, 5, 2, 4), (1, 7, 1, 8), (3, 4, 4, 2)])
def test_split_heads_equals_the_views(b, n, heads, d):
    torch.manual_seed(0)
    qkv = torch.randn(b, n, 3 * heads * d, requires_grad=True)
    grads = [torch.randn(b, heads, n, d) for _ in range(3)]
    parts = split_heads(qkv, heads)
    for part, view in zip(parts, views(qkv, heads)):
        assert part.shape == (b, heads, n, d) and part.is_contiguous()
        assert torch.equal(part, view)
    got = torch.autograd.grad(parts, qkv, grads)[0]
    want = torch.autograd.grad(list(views(qkv, heads)), qkv, grads)[0]
    assert torch.equal(got, want)


def test_split_heads_gradient_when_some_parts_unused():
    torch.manual_seed(0)
    qkv = torch.randn(2, 3, 3 * 2 * 4, requires_grad=True)
    q, k, v = split_heads(qkv, 2)
    (v * 2).sum().backward()  # q and k get no gradient
    want = torch.zeros(2, 3, 3, 2, 4)
    want[:, :, 2] = 2.0
    assert torch.equal(qkv.grad, want.view(2, 3, 24))
