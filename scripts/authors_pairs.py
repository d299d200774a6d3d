"""The pairs scripts/authors_ab.py times: each baseline beside its authors' PyTorch code, built with the
same settings and the same weights, random features, rotations or random blocks where they have them.

A pair is two functions of the same inputs, ours and theirs, and how far their results may differ:
- performer: performer-pytorch ``FastAttention`` on q, k, v, with our random features as its
  projection matrix;
- reformer: transformers ``LSHSelfAttention`` (hidden states -> its query_key and value projections
  -> LSH attention) against the same projections and our chunked form (``form="chunked"``, HF's form),
  with HF's rotations (``hash_seed``) copied into ours;
- local: local-attention ``LocalAttention`` on q, k, v, own window only (look_backward 0,
  look_forward 0), blocks of 64;
- longformer: transformers ``LongformerSelfAttention`` (window 512 = 256 keys each side, token 0
  global, its global projections set to its local ones) against its projections and ours (window
  513: the same keys);
- bigbird: transformers ``BigBirdBlockSparseAttention`` against its projections and ours (blocks of
  64, 3 random blocks; the random blocks differ: HF draws them with numpy, ours are a seeded buffer);
- nystromformer: transformers ``NystromformerSelfAttention`` (set to its per-matrix pseudo-inverse
  start, the paper's and ours, which its config cannot reach) against its projections and ours, and
  nystrom-attention ``NystromAttention`` (its pseudo-inverse start is the largest column sum over
  the whole batch, so the two differ by the iteration's remaining error) against its projections and
  ours.

Ours is the backend at its LRA settings (``lra/configs/attn``) but where a pair names another value
to match theirs. Their packages are the ``[authors]`` extra; none is a dependency of the suite."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from attentions import build_attention

Fn = Callable[[List[torch.Tensor]], torch.Tensor]


@dataclass
class Pair:
    """Ours and theirs as functions of the same inputs (requiring grad), the largest relative difference
    their outputs may have (None: they compute different things, ``differs`` says how)."""

    name: str
    theirs_name: str
    ours: Fn
    theirs: Fn
    inputs: List[torch.Tensor]
    tolerance: Optional[float]
    differs: str = ""


def heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, N, H D] -> [B, H, N, D]."""
    b, n, _ = x.shape
    return x.view(b, n, h, -1).transpose(1, 2)


def merged(x: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [B, N, H D]."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def qkv(b: int, h: int, n: int, d: int, gen: torch.Generator) -> List[torch.Tensor]:
    return [torch.randn(b, h, n, d, generator=gen).requires_grad_() for _ in range(3)]


def hidden(b: int, n: int, width: int, gen: torch.Generator) -> List[torch.Tensor]:
    return [torch.randn(b, n, width, generator=gen).requires_grad_()]


def performer(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from performer_pytorch import FastAttention

    ours = build_attention("performer", num_heads=h, head_dim=d, max_len=n, features=128)
    theirs = FastAttention(dim_heads=d, nb_features=128)
    with torch.no_grad():
        theirs.projection_matrix.copy_(ours.features)
    return Pair("performer", "performer-pytorch FastAttention", lambda x: ours(*x), lambda x: theirs(*x),
                qkv(b, h, n, d, gen), 1e-4)


def reformer(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention

    ours = build_attention("reformer", num_heads=h, head_dim=d, max_len=n, n_hashes=2, chunk_size=64, form="chunked")
    config = ReformerConfig(attention_head_size=d, num_attention_heads=h, hidden_size=h * d, num_hashes=2,
                            num_buckets=ours.factors[0] if len(ours.factors) == 1 else list(ours.factors),
                            lsh_attn_chunk_length=64, lsh_num_chunks_before=1, lsh_num_chunks_after=0, hash_seed=0,
                            is_decoder=False, lsh_attention_probs_dropout_prob=0.0, max_position_embeddings=n,
                            attn_layers=["lsh"])
    theirs = LSHSelfAttention(config)
    with torch.no_grad(), torch.random.fork_rng():
        # HF draws its rotations [H, D, n_hashes, buckets / 2] after torch.manual_seed(hash_seed)
        torch.manual_seed(0)
        ours.rotations.copy_(torch.randn(ours.rotations.shape))

    def our_side(x: List[torch.Tensor]) -> torch.Tensor:
        qk, v = heads(theirs.query_key(x[0]), h), heads(theirs.value(x[0]), h)
        return merged(ours(qk, qk, v))

    return Pair("reformer", "transformers LSHSelfAttention", our_side, lambda x: theirs(x[0]).hidden_states,
                hidden(b, n, h * d, gen), 1e-4)


def local(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from local_attention import LocalAttention

    ours = build_attention("local", num_heads=h, head_dim=d, max_len=n, block_size=64)
    theirs = LocalAttention(window_size=64, causal=False, look_backward=0, look_forward=0, dropout=0.0)
    return Pair("local", "local-attention LocalAttention", lambda x: ours(*x), lambda x: theirs(*x),
                qkv(b, h, n, d, gen), 1e-4)


def longformer(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    ours = build_attention("longformer", num_heads=h, head_dim=d, max_len=n, window=513, global_tokens=(0,))
    config = LongformerConfig(hidden_size=h * d, num_attention_heads=h, attention_window=[512],
                              attention_probs_dropout_prob=0.0)
    theirs = LongformerSelfAttention(config, layer_id=0)
    with torch.no_grad():
        for name in ("query", "key", "value"):
            getattr(theirs, f"{name}_global").load_state_dict(getattr(theirs, name).state_dict())
    # HF's mask: 0 local, > 0 global (token 0), < 0 padding
    marks = torch.zeros(b, n)
    marks[:, 0] = 10000.0

    def their_side(x: List[torch.Tensor]) -> torch.Tensor:
        return theirs(x[0], attention_mask=marks, is_index_masked=marks < 0, is_index_global_attn=marks > 0,
                      is_global_attn=True)[0]

    def our_side(x: List[torch.Tensor]) -> torch.Tensor:
        q, k, v = (heads(getattr(theirs, name)(x[0]), h) for name in ("query", "key", "value"))
        return merged(ours(q, k, v))

    return Pair("longformer", "transformers LongformerSelfAttention", our_side, their_side, hidden(b, n, h * d, gen), 1e-4)


def bigbird(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from transformers import BigBirdConfig, BigBirdModel
    from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

    ours = build_attention("bigbird", num_heads=h, head_dim=d, max_len=n, block_size=64, num_random_blocks=3, seed=0)
    config = BigBirdConfig(hidden_size=h * d, num_attention_heads=h, block_size=64, num_random_blocks=3,
                           attention_type="block_sparse", max_position_embeddings=n, attention_probs_dropout_prob=0.0)
    theirs = BigBirdBlockSparseAttention(config, seed=0)
    # HF draws random blocks in training mode only (in eval every random block is block 0); dropout is 0
    theirs.train()
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(torch.ones(b, n), 64)

    def our_side(x: List[torch.Tensor]) -> torch.Tensor:
        q, k, v = (heads(getattr(theirs, name)(x[0]), h) for name in ("query", "key", "value"))
        return merged(ours(q, k, v))

    def their_side(x: List[torch.Tensor]) -> torch.Tensor:
        return theirs(x[0], band_mask=band, from_mask=from_mask, to_mask=to_mask, from_blocked_mask=blocked,
                      to_blocked_mask=blocked)[0]

    return Pair("bigbird", "transformers BigBirdBlockSparseAttention", our_side, their_side, hidden(b, n, h * d, gen),
                None, "the same pattern of blocks but other random ones: HF's numpy draws, ours a seeded buffer")


def nystromformer(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from transformers import NystromformerConfig
    from transformers.models.nystromformer.modeling_nystromformer import NystromformerSelfAttention

    ours = build_attention("nystromformer", num_heads=h, head_dim=d, max_len=n, landmarks=128, pinv_iterations=6)
    config = NystromformerConfig(hidden_size=h * d, num_attention_heads=h, num_landmarks=128, segment_means_seq_len=n,
                                 attention_probs_dropout_prob=0.0)
    theirs = NystromformerSelfAttention(config)
    # no convolution of the values (ours: conv_kernel 0; newer configs refuse conv_kernel_size None), and
    # the per-matrix start of the pseudo-inverse (the code's else branch: inv_coeff_init_option=True
    # makes it read a config key that does not exist)
    theirs.conv_kernel_size = None
    theirs.init_option = "per matrix"

    def our_side(x: List[torch.Tensor]) -> torch.Tensor:
        q, k, v = (heads(getattr(theirs, name)(x[0]), h) for name in ("query", "key", "value"))
        return merged(ours(q, k, v))

    return Pair("nystromformer", "transformers NystromformerSelfAttention", our_side, lambda x: theirs(x[0])[0],
                hidden(b, n, h * d, gen), 1e-3)


def nystrom_attention(b: int, h: int, n: int, d: int, gen: torch.Generator) -> Pair:
    from nystrom_attention import NystromAttention

    ours = build_attention("nystromformer", num_heads=h, head_dim=d, max_len=n, landmarks=128, pinv_iterations=6)
    theirs = NystromAttention(dim=h * d, dim_head=d, heads=h, num_landmarks=128, pinv_iterations=6, residual=False,
                              dropout=0.0)

    def our_side(x: List[torch.Tensor]) -> torch.Tensor:
        q, k, v = (heads(t, h) for t in theirs.to_qkv(x[0]).chunk(3, dim=-1))
        return theirs.to_out(merged(ours(q, k, v)))

    return Pair("nystromformer", "nystrom-attention NystromAttention", our_side, lambda x: theirs(x[0]),
                hidden(b, n, h * d, gen), None,
                "its pseudo-inverse starts from the largest column sum over the batch (ours: per matrix)")


PAIRS: Dict[str, List[Callable[..., Pair]]] = {
    "performer": [performer], "reformer": [reformer], "local": [local], "longformer": [longformer],
    "bigbird": [bigbird], "nystromformer": [nystromformer, nystrom_attention],
}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(pair: Pair) -> str:
    """How the two sides' outputs and input gradients compare (a random projection of the output)."""
    weight = torch.randn(pair.ours(pair.inputs).shape, generator=torch.Generator().manual_seed(1))
    found = []
    for side in (pair.ours, pair.theirs):
        out = side(pair.inputs)
        found.append([out.detach(), *torch.autograd.grad((out * weight).sum(), pair.inputs)])
    worst = max(relative_difference(x, y) for x, y in zip(*found))
    if pair.tolerance is None:
        return f"differ ({pair.differs}): max rel diff {worst:.1e}"
    verdict = "same" if worst <= pair.tolerance else "DIFFERENT"
    return f"{verdict}: max rel diff {worst:.1e} (output and input gradients)"


def step(fn: Fn, inputs: List[torch.Tensor]) -> Callable[[], None]:
    """Forward and backward to the inputs."""
    def run() -> None:
        out = fn(inputs)
        torch.autograd.grad(out.sum(), inputs)
    return run

