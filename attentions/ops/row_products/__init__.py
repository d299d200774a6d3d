"""Products with k table rows chosen per query (Top-k attention's forward and backward after the
selection): weighted sums of the rows, their dot products with a vector, and outer products added
into the rows of a gradient.

reference.py  indexed torch expressions
cpu.py        the C kernels (csrc/sparse_rows.c) as torch.library operators
dispatch.py   whether the kernels take an input, and why not
"""
from .dispatch import refusals, takes

__all__ = ["refusals", "takes"]
