"""Analytical FLOP counts, to say how much of the machine's matmul rate an implementation reaches.

A multiply-add counts 2 FLOPs. Per head, for sequence length N, head dim D:

attention  each backend's own count (``Attention.flops``: full 4 N^2 D forward, 3x that to train;
           MiTA's landmark, shared and routed matmuls in attentions/backends/mita.py); backends that do
           not count theirs get no FLOP rate.
model      per token and layer: QKV 6 C^2, output projection 2 C^2, FFN 4 C F, plus the attention;
       train = 3x forward (the optimizer step is negligible).
Pooling, softmax, top-k selection, gathers and sorting are not counted: they are memory-bound.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from attentions import AttentionError, build_config, get_attention


def attention_flops(backend: str, n: int, d: int, options: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """(forward, train) FLOPs of one head of ``backend`` at length n, or None if not counted (or the
    backend is not registered in this process: a sweep record of a plugin read without its file)."""
    try:
        return get_attention(backend).flops(build_config(backend, options), n, d)
    except AttentionError:
        return None


def point_flops(record: Dict[str, Any], point: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """(forward, train) FLOPs of a whole point (batch, heads, layers), or None if not counted."""
    settings = record["settings"]
    heads = settings["heads"]
    options = settings["attn_options"].get(point["backend"], {})
    if record["level"] == "attention":
        per_head = attention_flops(point["backend"], point["length"], settings["head_dim"], options)
        if per_head is None:
            return None
        scale = point["batch"] * heads
        return per_head[0] * scale, per_head[1] * scale
    width, ffn = settings["width"], settings["ffn_dim"]
    # the attention width W (a task's model.qkv_dim; else the model's width): QKV 6 C W, output 2 W C
    attn_width = (settings.get("model") or {}).get("qkv_dim") or width
    per_head = attention_flops(point["backend"], point["length"], attn_width // heads, options)
    if per_head is None:
        return None
    tokens = point["batch"] * point["length"]
    dense = tokens * (8.0 * width * attn_width + 4.0 * width * ffn)
    forward = settings["layers"] * (dense + point["batch"] * heads * per_head[0])
    train = settings["layers"] * (3.0 * dense + point["batch"] * heads * per_head[1])
    return forward, train


def efficiency(record: Dict[str, Any]) -> Dict[str, Any]:
    """For each counted point: achieved FLOP/s and its fraction of the measured GEMM rate."""
    gemm = record.get("gemm") or {}
    rate = gemm.get("flops_per_s") if gemm.get("status") == "ok" else None
    rows = []
    for point in record["points"]:
        flops = point_flops(record, point)
        if flops is None or point["status"] not in ("ok", "estimated"):
            continue
        row = {"backend": point["backend"], "length": point["length"], "estimated": point["estimated"]}
        for mode, count in zip(("forward", "train"), flops):
            if mode not in point:  # an interleaved sweep times the training step alone
                continue
            achieved = count / point[mode]["median_s"]
            row[f"{mode}_flops"] = count
            row[f"{mode}_flops_per_s"] = achieved
            row[f"{mode}_fraction"] = achieved / rate if rate else None
        rows.append(row)
    return {"gemm_flops_per_s": rate, "points": rows}
