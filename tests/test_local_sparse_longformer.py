"""Local attention, the Sparse Transformer's fixed pattern and Longformer: the fast paths and their
gathered references against a restatement of the authors' dense-mask computation (outputs and q/k/v
gradients), the keys each query reaches found by perturbing every key, the settings that equal full
attention, padding invariance, and the absence of any N x N tensor."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Set

import numpy as np
import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import local, longformer, sparse_transformer
from conftest import lengths_mask, rel_err

B, H, N, D = 2, 2, 64, 16


@pytest.fixture(autouse=True)
def one_thread() -> None:
    """Tensors this small run fastest on one thread (conftest gives torch its setting back after)."""
    torch.set_num_threads(1)


# The authors' patterns restated as dense [N, N] masks (True = query i may attend to key j), as the
# LRA JAX code builds them, without its causal triangle (sparse) and with contiguous blocks (local).
def local_mask(n: int, block_size: int) -> torch.Tensor:
    i = torch.arange(n)
    return i[:, None] // block_size == i[None, :] // block_size


def sparse_mask(n: int, block_size: int, summary: int) -> torch.Tensor:
    i = torch.arange(n)
    fixed1 = i[:, None] // block_size == i[None, :] // block_size
    fixed2 = (i[None, :] % block_size >= block_size - summary).expand(n, n)
    return fixed1 | fixed2


def longformer_mask(n: int, window: int, global_tokens: List[int]) -> torch.Tensor:
    """JAX _build_sliding_window_mask: window - window // 2 diagonals at and below, window // 2 above,
    or'd with the global rows and columns."""
    right = window // 2
    left = window - right
    band = sum(np.eye(n, k=-i) for i in range(left)) + sum((np.eye(n, k=i) for i in range(1, right + 1)), np.zeros((n, n)))
    glob = torch.zeros(n, dtype=torch.bool)
    glob[[g for g in global_tokens if g < n]] = True
    return torch.from_numpy(band > 0) | glob[:, None] | glob[None, :]


def dense(q, k, v, mask: Optional[torch.Tensor], allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the allowed real keys; padded rows zero. Disallowed scores get a
    large finite bias (as the JAX code's -1e10), so a padded row with no real key stays finite."""
    ok = allowed[None, None] & (torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if mask is None else mask)[:, None, None, :]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~ok, torch.finfo(q.dtype).min)
    out = scores.softmax(-1) @ v
    return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0.0)


PATTERNS: Dict[str, Callable[[dict, int], torch.Tensor]] = {
    "local": lambda cfg, n: local_mask(n, cfg["block_size"]),
    "sparse_transformer": lambda cfg, n: sparse_mask(n, cfg["block_size"], cfg["summary"]),
    "longformer": lambda cfg, n: longformer_mask(n, cfg["window"], list(cfg["global_tokens"])),
}
REFERENCES = {
    "local": lambda q, k, v, m, cfg: local.reference(q, k, v, m, cfg["block_size"]),
    "sparse_transformer": lambda q, k, v, m, cfg: sparse_transformer.reference(q, k, v, m, cfg["block_size"], cfg["summary"]),
    "longformer": lambda q, k, v, m, cfg: longformer.reference(q, k, v, m, cfg["window"], tuple(cfg["global_tokens"])),
}
CASES = [
    pytest.param("local", {"block_size": 10}, 64, None, id="local-bs10-N64-nomask"),
    pytest.param("local", {"block_size": 16}, 61, [61, 29], id="local-bs16-N61-masked"),
    pytest.param("local", {"block_size": 7}, 40, [40, 3], id="local-bs7-N40-masked-short"),
    pytest.param("sparse_transformer", {"block_size": 16, "summary": 4}, 64, None, id="sparse-l16-c4-N64-nomask"),
    pytest.param("sparse_transformer", {"block_size": 12, "summary": 5, "chunk_size": 24}, 61, [61, 29],
                 id="sparse-l12-c5-N61-masked-chunks"),
    pytest.param("sparse_transformer", {"block_size": 8, "summary": 0}, 40, [40, 17], id="sparse-l8-c0-N40-masked"),
    pytest.param("longformer", {"window": 9, "global_tokens": [0]}, 64, None, id="longformer-w9-g0-N64-nomask"),
    pytest.param("longformer", {"window": 16, "global_tokens": [0, 5, 50]}, 61, [61, 29],
                 id="longformer-w16-g0,5,50-N61-masked"),
    pytest.param("longformer", {"window": 300, "global_tokens": []}, 40, [40, 11], id="longformer-w300-noglobal-N40-masked"),
]


def inputs(n: int, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def out_and_grads(fn: Callable, qkv: List[torch.Tensor], mask: Optional[torch.Tensor]):
    out = fn(*qkv, mask)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    if mask is not None:
        weight = weight * mask[:, None, :, None]
    return out.detach(), torch.autograd.grad((out * weight).sum(), qkv)


@pytest.mark.parametrize("name, cfg, n, lengths", CASES)
def test_fast_path_and_reference_equal_the_authors_dense_mask(name: str, cfg: dict, n: int, lengths) -> None:
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention(name, num_heads=H, head_dim=D, max_len=n, **cfg)
    qkv = inputs(n)
    want, want_grads = out_and_grads(lambda q, k, v, m: dense(q, k, v, m, PATTERNS[name](cfg, n)), qkv, mask)
    for fn in (attn, lambda q, k, v, m: REFERENCES[name](q, k, v, m, cfg)):
        got, got_grads = out_and_grads(fn, qkv, mask)
        assert rel_err(got, want) < 1e-12
        for label, g, w in zip("qkv", got_grads, want_grads):
            assert rel_err(g, w) < 1e-12, f"d{label} differs"


def reached(attn, n: int, query: int) -> Set[int]:
    """The keys whose perturbation (key and value at that position) moves query ``query``'s output."""
    q, k, v = (x.detach()[:1, :1] for x in inputs(n))
    base = attn(q, k, v)[0, 0, query]
    moved = set()
    for j in range(n):
        k2, v2 = k.clone(), v.clone()
        k2[..., j, :] += 1.0
        v2[..., j, :] += 1.0
        if not torch.equal(attn(q, k2, v2)[0, 0, query], base):
            moved.add(j)
    return moved


REACH = [
    # own contiguous block only: query 23 in blocks of 10 is in block 20..29
    pytest.param("local", {"block_size": 10}, 23, set(range(20, 30)), id="local-bs10-q23"),
    # the last, shorter block: 60..63
    pytest.param("local", {"block_size": 10}, 62, set(range(60, 64)), id="local-bs10-q62-last-block"),
    # own block 0..15, then the last 4 columns of every other block
    pytest.param("sparse_transformer", {"block_size": 16, "summary": 4}, 5,
                 set(range(16)) | {28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63}, id="sparse-l16-c4-q5"),
    # a later block sees the summary columns before it (non-causal) and after it
    pytest.param("sparse_transformer", {"block_size": 16, "summary": 4}, 40,
                 set(range(32, 48)) | {12, 13, 14, 15, 28, 29, 30, 31, 60, 61, 62, 63}, id="sparse-l16-c4-q40"),
    # window 7: 4 keys at or before the query (itself included), 3 after; the global token 0
    pytest.param("longformer", {"window": 7, "global_tokens": [0]}, 30, set(range(27, 34)) | {0}, id="longformer-w7-q30"),
    # an even window 8: itself and 3 before, 4 after
    pytest.param("longformer", {"window": 8, "global_tokens": []}, 30, set(range(27, 35)), id="longformer-w8-q30-noglobal"),
    # a global query sees every key
    pytest.param("longformer", {"window": 7, "global_tokens": [0, 40]}, 40, set(range(64)), id="longformer-w7-global-q40"),
]


@pytest.mark.parametrize("name, cfg, query, expected", REACH)
def test_perturbing_a_key_moves_a_query_exactly_when_the_pattern_reaches_it(name, cfg, query, expected) -> None:
    attn = build_attention(name, num_heads=1, head_dim=D, max_len=N, **cfg)
    assert reached(attn, N, query) == expected


def full_attention(q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return dense(q, k, v, mask, torch.ones(q.shape[2], q.shape[2], dtype=torch.bool))


DEGENERATE = [
    pytest.param("local", {"block_size": 64}, id="local-block-N"),
    pytest.param("local", {"block_size": 500}, id="local-block-beyond-N"),
    pytest.param("sparse_transformer", {"block_size": 64, "summary": 8}, id="sparse-block-N"),
    pytest.param("sparse_transformer", {"block_size": 8, "summary": 8}, id="sparse-every-column-a-summary"),
    pytest.param("longformer", {"window": 128, "global_tokens": []}, id="longformer-window-2N"),
    pytest.param("longformer", {"window": 129, "global_tokens": [0, 3]}, id="longformer-window-2N-globals"),
]


@pytest.mark.parametrize("name, cfg", DEGENERATE)
@pytest.mark.parametrize("lengths", [None, [64, 29]], ids=["nomask", "masked"])
def test_a_pattern_covering_the_sequence_is_full_attention(name: str, cfg: dict, lengths) -> None:
    mask = None if lengths is None else lengths_mask(lengths, N)
    attn = build_attention(name, num_heads=H, head_dim=D, max_len=N, **cfg)
    qkv = inputs(N)
    got, got_grads = out_and_grads(attn, qkv, mask)
    want, want_grads = out_and_grads(full_attention, qkv, mask)
    assert rel_err(got, want) < 1e-12
    assert all(rel_err(g, w) < 1e-12 for g, w in zip(got_grads, want_grads))


PADDED = [
    pytest.param("local", {"block_size": 16}, id="local"),
    # summary columns fall inside the padding
    pytest.param("sparse_transformer", {"block_size": 16, "summary": 4, "chunk_size": 16}, id="sparse"),
    # a global position past the real length is padding, not a global token
    pytest.param("longformer", {"window": 9, "global_tokens": [0, 45]}, id="longformer-global-in-padding"),
]


@pytest.mark.parametrize("name, cfg", PADDED)
def test_padding_with_noise_never_changes_a_real_output(name: str, cfg: dict) -> None:
    """A sequence of 37 tokens alone and padded to 64 with large noise gives the same real outputs."""
    attn = build_attention(name, num_heads=H, head_dim=D, max_len=N, **cfg)
    q, k, v = (x.detach() for x in inputs(N))
    alone = attn(q[:, :, :37], k[:, :, :37], v[:, :, :37])
    noisy = [torch.cat([x[:, :, :37], 1e3 * torch.randn(B, H, N - 37, D, dtype=x.dtype)], 2) for x in (q, k, v)]
    padded = attn(*noisy, lengths_mask([37, 37], N))
    assert rel_err(padded[:, :, :37], alone) < 1e-12
    assert torch.isfinite(padded).all() and padded[:, :, 37:].abs().max() == 0


@pytest.mark.parametrize("name, cfg", [
    pytest.param("local", {"block_size": 50}, id="local"),
    pytest.param("sparse_transformer", {"block_size": 128, "summary": 32, "chunk_size": 512}, id="sparse"),
    pytest.param("longformer", {"window": 512, "global_tokens": [0]}, id="longformer"),
])
def test_no_tensor_grows_as_n_squared(name: str, cfg: dict) -> None:
    """Forward and backward at N = 4096 on the LRA values: no operator reads or writes a tensor of
    N^2 / 4 elements (a dense [N, N] mask or score matrix would be N^2)."""
    n = 4096
    attn = build_attention(name, num_heads=1, head_dim=8, max_len=n, **cfg)
    q, k, v = (torch.randn(1, 1, n, 8, requires_grad=True) for _ in range(3))
    mask = lengths_mask([n - 100], n)
    with torch.profiler.profile(record_shapes=True) as prof:
        attn(q, k, v, mask).sum().backward()
    largest = max(math.prod(s) for e in prof.events() for s in e.input_shapes if s)
    assert largest < n * n / 4, f"a tensor of {largest} elements at N = {n}"


def test_budgets_and_flops() -> None:
    n, d = 4096, 32
    sparse = build_attention("sparse_transformer", num_heads=2, head_dim=d, max_len=n)
    # 128 own keys + 32 columns in each of the 31 other blocks
    assert sparse.budget().endswith("= 1120")
    assert build_attention("local", num_heads=2, head_dim=d, max_len=n).budget() == "block_size = 50"
    assert build_attention("longformer", num_heads=2, head_dim=d, max_len=n).budget().endswith("= 513")
    assert local.LocalAttention.flops(local.LocalConfig(block_size=64), n, d) == (4.0 * n * 64 * d, 12.0 * n * 64 * d)
    forward, _ = sparse_transformer.SparseTransformerAttention.flops(sparse.cfg, n, d)
    assert forward == 4.0 * n * (128 + 32 * 32) * d
    # window 512 runs in blocks of 64 against 4 blocks either side: 576 keys, plus one global column and row
    forward, _ = longformer.LongformerAttention.flops(longformer.LongformerConfig(), n, d)
    assert forward == 4.0 * n * (576 + 1) * d + 4.0 * n * d


@pytest.mark.parametrize("name, overrides, words", [
    pytest.param("local", {"block_size": 0}, "block_size", id="local-block0"),
    pytest.param("sparse_transformer", {"summary": 200}, "summary", id="sparse-summary-over-block"),
    pytest.param("sparse_transformer", {"chunk_size": 0}, "chunk_size", id="sparse-chunk0"),
    pytest.param("longformer", {"window": 0}, "window", id="longformer-window0"),
    pytest.param("longformer", {"global_tokens": [-1]}, "global_tokens", id="longformer-negative-global"),
])
def test_invalid_hyperparameters_raise(name: str, overrides: dict, words: str) -> None:
    with pytest.raises(AttentionError, match=words):
        build_attention(name, num_heads=H, head_dim=D, max_len=N, **overrides)
