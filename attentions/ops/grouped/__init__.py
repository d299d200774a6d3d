"""Grouped routed attention: (query, expert) pairs, each attending to its expert's short key list
(MiTA's routed experts, MoBA's blocks), grouped by expert so each expert's keys are read once.

reference.py  the PyTorch form (tiles of pairs of one expert; ``merge`` of partial results)
cpu.py        the C kernel (csrc/grouped_cpu.c) as torch.library operators
merged_cpu.py MoBA's parts and their merge on that kernel as one autograd Function
triton_op.py  the Triton form (triton_kernels.py) for CUDA
dispatch.py   which form a backend's ``kernel`` setting runs, and why a form is refused
"""
from .dispatch import KERNELS, check_kernel, kernel_name, pick_grouped, refusals
from .reference import expert_runs, gather_rows, grouped_attention, merge

__all__ = ["KERNELS", "check_kernel", "expert_runs", "gather_rows", "grouped_attention", "kernel_name", "merge",
           "pick_grouped", "refusals"]
