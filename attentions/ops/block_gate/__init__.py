"""MoBA's gate: each query's best key blocks by the dot product with the blocks' mean keys.

reference.py  the PyTorch form (the gate in chunks of queries, torch.topk)
cpu.py        the C kernel (csrc/block_gate.c) as a torch.library operator
dispatch.py   which form runs, and why the kernel is refused
"""
from .dispatch import choose_blocks, refusals

__all__ = ["choose_blocks", "refusals"]
