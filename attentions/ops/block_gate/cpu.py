"""MoBA's gate on a compiled C kernel for the CPU (csrc/block_gate.c), float32: each query's best key blocks.

The PyTorch form (reference.py) makes the [B, H, chunk, blocks] gate tensor, writes +inf at
each query's own block, masks the empty blocks and runs topk over it; at N = 4K (batch 8) that was
about a tenth of MoBA's training step, for a choice of one block besides the own one at the
defaults. The kernel scores 2 VW queries at a time (VW: the kernels' vector width), one per vector
lane, against the head's block means and keeps a short sorted list per lane instead. Same choice as the PyTorch form (tests/test_block_gate.py); of equal
gates the lower block number wins (torch.topk leaves ties unspecified). The kernel is the
torch.library operator ``lra::block_gate``.
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch.library import custom_op, register_fake

from ...base import AttentionError
from .. import native

LIBRARY = "block_gate"
# the sorted list is per_query long: beyond this many blocks per query the PyTorch topk is kept
MAX_PER_QUERY = 16
_i64, _ptr_t = ctypes.c_int64, ctypes.c_void_p


class Gate(ctypes.Structure):
    """The kernel's argument block (``Gate`` in block_gate.c, field for field)."""

    _fields_ = [(name, _i64) for name in (
        "G", "N", "D", "blocks", "block_size", "per_query", "own", "heads", "threads")] + [
        (name, _ptr_t) for name in ("q", "means", "empty", "chosen", "ok")]


SIGNATURES: native.Signatures = {"block_gate": ([ctypes.POINTER(Gate)], ctypes.c_int)}


def library() -> Optional[ctypes.CDLL]:
    return native.typed(LIBRARY, SIGNATURES)


def refusals(q: torch.Tensor, per_query: int) -> List[str]:
    """Why the kernel does not choose ``per_query`` blocks for queries like ``q`` (float32 CPU tensors,
    a list of at most MAX_PER_QUERY, the kernel built here); [] when it does."""
    reasons = native.refusals(q, LIBRARY)
    if per_query > MAX_PER_QUERY:
        reasons.append(f"{LIBRARY} keeps at most {MAX_PER_QUERY} blocks per query, not {per_query}")
    return reasons


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


@custom_op("lra::block_gate", mutates_args=(), device_types="cpu")
def block_gate(q: torch.Tensor, means: torch.Tensor, empty: Optional[torch.Tensor], block_size: int, per_query: int,
               include_own: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel on contiguous float32 q [B, H, N, D], means [B, H, blocks, D] and empty [B, blocks] uint8
    or None: chosen blocks [B, H, N, per_query] (best first) and whether each holds a real key."""
    b, h, n, d = q.shape
    if not 1 <= per_query <= means.shape[2]:
        raise AttentionError(f"per_query={per_query} blocks per query: the gate keeps 1 to the {means.shape[2]} "
                             f"blocks there are")
    chosen = torch.empty(b, h, n, per_query, dtype=torch.long)
    ok = torch.empty(b, h, n, per_query, dtype=torch.bool)
    args = Gate(G=b * h, N=n, D=d, blocks=means.shape[2], block_size=block_size, per_query=per_query,
                own=int(include_own), heads=h, threads=torch.get_num_threads(), q=_ptr(q), means=_ptr(means),
                empty=_ptr(empty), chosen=_ptr(chosen), ok=_ptr(ok.view(torch.uint8)))
    if library().block_gate(ctypes.byref(args)) != 0:
        raise MemoryError("the MoBA gate CPU kernel could not allocate its per-thread buffers")
    return chosen, ok


@register_fake("lra::block_gate")
def _(q, means, empty, block_size, per_query, include_own):
    shape = (*q.shape[:3], per_query)
    return q.new_empty(shape, dtype=torch.long), q.new_empty(shape, dtype=torch.bool)


@torch.no_grad()
def choose_blocks_cpu(q: torch.Tensor, means: torch.Tensor, empty: Optional[torch.Tensor], block_size: int,
                      per_query: int, include_own: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``per_query`` best blocks [B, H, N, per_query] (best first) and whether each holds
    a real key. q [B, H, N, D], means [B, H, blocks, D] (mean over each block's real keys), empty
    [B, blocks] bool (a block without a real key) or None."""
    empty = None if empty is None else empty.contiguous().view(torch.uint8)
    return block_gate(q.contiguous(), means.contiguous(), empty, block_size, per_query, include_own)
