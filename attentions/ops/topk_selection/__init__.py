"""Top-k selection along the last dim, in no order (Top-k attention per query, MiTA per landmark).

reference.py  torch.topk
cpu.py        the C kernel (csrc/topk_select.c) as a torch.library operator
dispatch.py   which form runs, and why the kernel is refused
"""
from .dispatch import refusals, takes, topk_unsorted

__all__ = ["refusals", "takes", "topk_unsorted"]
