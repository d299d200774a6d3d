"""Attention backends behind one contract; knows nothing of LRA.

    from attentions import build_attention, list_attentions
    attn = build_attention("mita", num_heads=H, head_dim=D, max_len=N, landmarks=64, topk=64)
    out = attn(q, k, v, mask=None)   # q, k, v, out: [B, H, N, D]; mask: [B, N] bool, True = real
"""
from . import moved
from .base import Attention, AttentionError, AttnDims, NoConfig, Taxonomy, check_inputs
from .registry import (
    build_attention,
    build_config,
    config_fields,
    get_attention,
    is_timing_reference,
    list_attentions,
    load_attention_module,
    origin,
    register,
    scaling_of,
)

# attentions.mita, attentions.full, ...: the backends' former root paths resolve to attentions.backends
moved.install()

__all__ = [
    "Attention",
    "AttentionError",
    "AttnDims",
    "NoConfig",
    "Taxonomy",
    "build_attention",
    "build_config",
    "check_inputs",
    "config_fields",
    "get_attention",
    "is_timing_reference",
    "list_attentions",
    "load_attention_module",
    "origin",
    "register",
    "scaling_of",
]
