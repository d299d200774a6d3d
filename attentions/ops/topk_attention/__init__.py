"""Top-k attention's forward from scores to output (each query's k best keys, their softmax, the
weighted sum of their values), returning the chosen indices and weights for the backward.

reference.py  the torch form: a score matmul, torch.topk, softmax, a gather
cpu.py        the fused C kernel (csrc/topk_attention.c) as a torch.library operator
dispatch.py   which form runs, and why the kernel is refused
"""
from .dispatch import refusals, takes, topk_attention

__all__ = ["refusals", "takes", "topk_attention"]
