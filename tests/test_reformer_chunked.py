"""Reformer's chunked form (``form="chunked"``, the form of HF's LSHSelfAttention and trax): against
transformers' own layer with the same rotations (outputs and q/v gradients), against its plain [N, N]
restatement with padding, which keys a query reaches, the degenerate setting that is full attention,
the contract battery's padding checks and the budget and form the tables read."""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import reformer
from attentions.check import Battery, Sizes
from test_reformer_informer import D, H, N, assert_full_attention_without_self, assert_same, grads, make_mask, make_qkv


def chunked(n: int = N, **options) -> reformer.ReformerAttention:
    return build_attention("reformer", num_heads=H, head_dim=D, max_len=n, form="chunked", **options).double()


def lsh_bucket(**options) -> reformer.ReformerAttention:
    return build_attention("reformer", num_heads=H, head_dim=D, max_len=N, **options).double()


def transformers_lsh(attn: reformer.ReformerAttention, q: torch.Tensor, v: torch.Tensor, seed: int) -> torch.Tensor:
    """transformers' LSHSelfAttention on q and v [B, H, N, D]: its input is [q | v] per position, its
    query_key and value projections pick the two halves, its rotations are drawn from ``seed`` (and
    ``attn`` is given the same ones)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[authors]')")
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    b, h, n, d = q.shape
    config = transformers.ReformerConfig(
        attention_head_size=d, num_attention_heads=h, hidden_size=2 * h * d, num_hashes=attn.cfg.n_hashes,
        num_buckets=attn.cfg.n_buckets, lsh_attn_chunk_length=attn.cfg.chunk_size, lsh_num_chunks_before=1,
        lsh_num_chunks_after=0, hash_seed=seed, is_decoder=False, lsh_attention_probs_dropout_prob=0.0,
        max_position_embeddings=attn.dims.max_len, attn_layers=["lsh"])
    layer = LSHSelfAttention(config).to(q.dtype)
    eye, zero = torch.eye(h * d, dtype=q.dtype), torch.zeros(h * d, h * d, dtype=q.dtype)
    with torch.no_grad(), torch.random.fork_rng():
        layer.query_key.weight.copy_(torch.cat([eye, zero], 1))
        layer.value.weight.copy_(torch.cat([zero, eye], 1))
        # HF draws its rotations [H, D, n_hashes, buckets / 2] after torch.manual_seed(hash_seed)
        torch.manual_seed(seed)
        attn.rotations.copy_(torch.randn(attn.rotations.shape, dtype=q.dtype))
    hidden = torch.cat([x.transpose(1, 2).reshape(b, n, h * d) for x in (q, v)], dim=-1)  # [B, N, 2 H D]
    with torch.random.fork_rng():
        out = layer(hidden).hidden_states  # [B, N, H D]
    return out.view(b, n, h, d).transpose(1, 2)


HF_CASES = [
    pytest.param(64, dict(chunk_size=8), id="N64-chunk8-2hashes-16buckets"),
    pytest.param(64, dict(chunk_size=8, n_hashes=1, n_buckets=4), id="N64-chunk8-1hash-4buckets"),
    pytest.param(64, dict(chunk_size=16, n_hashes=3, n_buckets=2), id="N64-chunk16-3hashes-2buckets"),
    # HF's bucket rule with two factors (8 x 16 buckets, two rotations)
    pytest.param(256, dict(chunk_size=4), id="N256-chunk4-2hashes-8x16buckets"),
    # the sequence within one chunk: HF's plain attention
    pytest.param(64, dict(chunk_size=64), id="N64-chunk64-one-chunk"),
]


@pytest.mark.parametrize("n,options", HF_CASES)
def test_chunked_matches_transformers_lsh_self_attention(n: int, options) -> None:
    attn = chunked(n, **options)
    q, k, v = make_qkv(n)
    ref = transformers_lsh(attn, q, v, seed=3)
    out = attn(q, k, v)
    assert_same([out, *grads(out, (q, v))], [ref, *grads(ref, (q, v))])


@pytest.mark.parametrize("options", [pytest.param(dict(chunk_size=8), id="chunk8-2hashes"),
                                     pytest.param(dict(chunk_size=5, n_buckets=6, n_hashes=3), id="chunk5-3hashes"),
                                     pytest.param(dict(chunk_size=16, n_hashes=1, n_buckets=4), id="chunk16-1hash")])
@pytest.mark.parametrize("lengths", [(N, N), (N, 37), (23, 1)], ids=["full", "masked", "short"])
def test_chunked_matches_its_plain_reference(options, lengths: Sequence[int]) -> None:
    attn = chunked(**options)
    q, k, v = make_qkv()
    mask = make_mask(lengths)
    out = attn(q, k, v, mask)
    ref = reformer.chunked_reference(q, v, attn.buckets(q, mask), attn.cfg.chunk_size, mask)
    real = mask[:, None, :, None]
    assert_same([out * real, *grads(out, (q, k, v), mask)], [ref * real, *grads(ref, (q, k, v), mask)])


def test_chunked_reaches_every_bucket_of_its_two_chunks() -> None:
    """A key of another bucket in the query's chunk moves it in the chunked form, not in the bucket form."""
    q, k, v = (x.detach() for x in make_qkv())
    attn, paper = chunked(chunk_size=8, n_hashes=1), lsh_bucket(chunk_size=8, n_hashes=1)
    buckets = attn.buckets(q)[0, 0, 0]  # [N]
    slot = reformer.chunked_slots(attn.buckets(q), attn.n_buckets)[0, 0].argsort()  # [N] slot of each token
    # a query and a key of another bucket sorted into the same chunk
    i, j = next((i, j) for i in range(N) for j in range(N) if buckets[j] != buckets[i] and slot[j] // 8 == slot[i] // 8)
    moved = v.clone()
    moved[0, 0, j] += 100.0
    assert (attn(q, k, moved)[0, 0, i] - attn(q, k, v)[0, 0, i]).abs().max() > 1e-3
    assert torch.equal(paper(q, k, moved)[0, 0, i], paper(q, k, v)[0, 0, i])


@pytest.mark.parametrize("n_hashes", [1, 2, 3], ids=["1hash", "2hashes", "3hashes"])
@pytest.mark.parametrize("lengths", [(N, N), (N, 37), (N, 60)], ids=["full", "masked", "masked60"])
@pytest.mark.parametrize("chunk", [N, 2 * N], ids=["chunkN", "chunk2N"])
def test_chunked_within_one_chunk_is_full_attention_without_self(n_hashes: int, lengths: Sequence[int], chunk: int) -> None:
    """A chunk holding the sequence: plain attention over every real key but the token itself (HF's)."""
    assert_full_attention_without_self(chunked(chunk_size=chunk, n_hashes=n_hashes, n_buckets=4), lengths)


@pytest.mark.parametrize("options", [pytest.param(dict(chunk_size=8), id="chunk8"),
                                     pytest.param(dict(chunk_size=6, n_hashes=3), id="chunk6-3hashes")])
def test_chunked_contract_battery_padding(options) -> None:
    """lra-check-attn's padding checks: the real tokens' chunks do not depend on the padded length."""
    battery = Battery("reformer", Sizes(), seed=0, overrides=dict(form="chunked", **options))
    battery.builds()
    battery.pick_dtype()
    for check in (battery.padding_invariance, battery.padding_gradient, battery.padded_vs_alone):
        check()


def test_form_is_checked_and_named_in_budget_and_variant() -> None:
    with pytest.raises(AttentionError, match="form 'sorted' is not one of bucket, chunked"):
        build_attention("reformer", num_heads=H, head_dim=D, max_len=N, form="sorted")
    assert chunked(chunk_size=8).budget() == "n_hashes x 2 chunk_size = 2 x 16 = 32 (every key of both chunks)"
    assert lsh_bucket(chunk_size=8).budget() == "n_hashes x 2 chunk_size = 2 x 16 = 32 (own bucket only)"
    cls = reformer.ReformerAttention
    assert cls.variant({"form": "chunked"}) == "chunked"
    assert cls.variant({"form": "bucket"}) == "" and cls.variant({}) == ""
