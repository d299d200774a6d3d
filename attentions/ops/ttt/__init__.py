"""Test-Time Training's inner loop (Sun et al. 2024): the hidden state is the weights of a small model
f trained on the sequence as it is read, one mini-batch of tokens per gradient step.

common.py     what both forms share: the inner layer norm, the split into mini-batches, the step sizes
reference.py  the primal form, as the paper writes it: per-token gradients at the mini-batch's start
              (autograd), weights per token, read by the queries
dual.py       the dual form: the same outputs from matmuls only, no per-token weights, in PyTorch
cpu.py        the dual form on a C kernel (csrc/ttt_cpu.c) as a torch.library operator, float32 on the CPU
dispatch.py   which dual form runs (the backends' ``kernel`` setting), and why the kernel is refused
"""
from .common import layer_norm, mini_batches, step_sizes
from .dual import dual_form
from .reference import primal_form

__all__ = ["dual_form", "layer_norm", "mini_batches", "primal_form", "step_sizes"]
