"""MoBA's fast path keeps memory linear in N: no temporary grows faster than N, and the gate loop
keeps nothing alive from one chunk of queries to the next.

The second property is what the throughput sweep caught: the loop kept each chunk's small results
(block indices) alive between the gate-sized temporaries, which fragmented the C heap; the resident
memory grew by about one gate per chunk, O(N^2 / block_size), reaching 2 GB at 64K tokens and
running out of 17.7 GiB at 256K. Whether glibc fragments depends on where the heap lands (address
randomization), so it is checked here on the pattern that causes it, which is deterministic.
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attentions import build_attention
from attentions.backends import moba
from attentions.ops import tuning
from conftest import lengths_mask


class AllocationLog(TorchDispatchMode):
    """Every tensor an op makes afresh (no view, no in-place or out= result), in order.

    ``on_alloc(shape)`` runs before each fresh tensor is logged, so it can look at what is alive.
    """

    def __init__(self, on_alloc: Callable[[torch.Size], None] = lambda shape: None) -> None:
        super().__init__()
        self.made: List[Tuple[weakref.ref, int]] = []
        self.on_alloc = on_alloc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for returned, tensor in zip(func._schema.returns, outs):
            if returned.alias_info is None and isinstance(tensor, torch.Tensor):
                self.on_alloc(tensor.shape)
                self.made.append((weakref.ref(tensor), tensor.numel()))
        return out

    def alive_since(self, first: int) -> int:
        """How many tensors logged from position ``first`` on are still alive."""
        return sum(ref() is not None for ref, _ in self.made[first:])


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "masked-empty-block"])
def test_moba_gate_loop_keeps_nothing_between_chunks(masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    b, h, n, d, size = 1, 2, 1024, 8, 16
    blocks = n // size
    # 32 queries gated at once: 32 chunks of a [1, 2, 32, 64] gate
    monkeypatch.setattr(tuning, "GATE_ELEMENTS", b * h * blocks * 32)
    gate_shape = (b, h, 32, blocks)
    torch.manual_seed(0)
    q, k = (torch.randn(b, h, n, d) for _ in range(2))
    # 1000 real tokens: the last block of 16 is all padding
    mask = lengths_mask([1000], n) if masked else None

    loop_start: List[int] = []
    alive_at_gate: List[int] = []

    def on_alloc(shape: torch.Size) -> None:
        if tuple(shape) != gate_shape:
            return
        if not loop_start:
            loop_start.append(len(log.made))
        alive_at_gate.append(log.alive_since(loop_start[0]))

    with AllocationLog(on_alloc) as log:
        chosen, ok = moba.choose_blocks(q, k, mask, size, 2, True)
    assert chosen.shape == (b, h, n, 2) and ok.shape == (b, h, n, 2)
    # one gate per chunk (and its view); when a gate is made, only the previous chunk's temporaries
    # may still be alive, never the results of all earlier chunks
    assert len(alive_at_gate) >= 32
    assert max(alive_at_gate[-8:]) <= max(alive_at_gate[2:8]), f"live tensors pile up: {alive_at_gate}"


def largest_made(n: int) -> int:
    """Elements of the largest tensor that MoBA's forward and backward make at length n."""
    torch.manual_seed(0)
    attn = build_attention("moba", num_heads=2, head_dim=8, max_len=n, block_size=16, topk=2)
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    with AllocationLog() as log:
        attn(q, k, v).sum().backward()
    return max(numel for _, numel in log.made)


def test_moba_temporaries_grow_linearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # a fixed gate chunk (as at long lengths), so only the O(N) parts can grow
    monkeypatch.setattr(tuning, "GATE_ELEMENTS", 1 << 13)
    small, large = largest_made(512), largest_made(2048)
    # the whole [1, 2, N, N / 16] gate or an N x N mask would grow 16 times
    assert large <= 4.5 * small, f"largest tensor: {small} elements at N=512, {large} at N=2048"
    assert large < 2 * 2048 * (2048 // 16)
