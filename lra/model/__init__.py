"""The LRA model: token embedding, encoder blocks around any attention backend, pooling and the
classifier heads, and the dropout and layer norm they use.

    encoder.py   Block, Encoder, LRAModel (the Q/K/V/output projections live here, once)
    heads.py     the projections' split into heads
    dropout.py   dropout as a C kernel on the CPU (the operator lra::dropout)
    layer_norm.py   layer norm as a C kernel on the CPU (the operator lra::layer_norm)
"""
from .encoder import Block, Encoder, LRAModel

__all__ = ["Block", "Encoder", "LRAModel"]
