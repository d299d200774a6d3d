"""The LRA model: token embedding, encoder blocks around any attention backend, pooling and the
classifier heads, and the dropout, layer norm and GELU they use.

    encoder.py   Block, Encoder, LRAModel (the Q/K/V/output projections live here, once)
    heads.py     the projections' split into heads
    dropout.py   dropout as a C kernel on the CPU (the operator lra::dropout)
    layer_norm.py   layer norm as a C kernel on the CPU (the operator lra::layer_norm)
    gelu_dropout.py the FFN's GELU and dropout as one C kernel on the CPU (lra::gelu_dropout)
"""
from .encoder import Block, Encoder, LRAModel

__all__ = ["Block", "Encoder", "LRAModel"]
