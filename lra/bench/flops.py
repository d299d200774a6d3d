"""Analytical FLOP counts, to say how much of the machine's matmul rate an implementation reaches.

A multiply-add counts 2 FLOPs. Per head, for sequence length N, head dim D:

full   forward 4 N^2 D (Q K^T and P V); backward 2x forward, so train = 3x forward.
mita   (m landmarks, k keys per expert, one expert per query, shared expert on; attentions/mita.py)
       landmark scores  L K^T           2 m N D   (under no_grad: no backward)
       shared expert    softmax(L K^T) V  4 m N D
       per query: gate q L^T 2 N m D, routed logits 2 N k D, mixing of the m shared values
       2 N m D and of the k routed values 2 N k D: together 4 N (m + k) D
       train = forward + 2x (forward - landmark scores).
model  per token and layer: QKV 6 C^2, output projection 2 C^2, FFN 4 C F, plus the attention;
       train = 3x forward (the optimizer step is negligible).
Pooling, softmax, top-k selection, gathers and sorting are not counted: they are memory-bound.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from attentions import build_config

COUNTED = ("full", "mita")


def attention_flops(backend: str, n: int, d: int, options: Dict[str, Any]) -> Optional[Tuple[float, float]]:
    """(forward, train) FLOPs of one head of ``backend`` at length n, or None if not counted."""
    if backend == "full":
        forward = 4.0 * n * n * d
        return forward, 3.0 * forward
    if backend == "mita":
        cfg = build_config("mita", options)
        m = min(cfg.landmarks, n)
        k = min(cfg.experts_per_query * (cfg.topk // cfg.experts_per_query), n)
        scores = 2.0 * m * n * d
        forward = scores + 4.0 * m * n * d + 4.0 * n * (m + k) * d
        return forward, forward + 2.0 * (forward - scores)
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
    per_head = attention_flops(point["backend"], point["length"], width // heads, options)
    if per_head is None:
        return None
    tokens = point["batch"] * point["length"]
    dense = tokens * (8.0 * width * width + 4.0 * width * ffn)
    forward = settings["layers"] * (dense + point["batch"] * heads * per_head[0])
    train = settings["layers"] * (3.0 * dense + point["batch"] * heads * per_head[1])
    return forward, train


def efficiency(record: Dict[str, Any]) -> Dict[str, Any]:
    """For each counted point: achieved FLOP/s and its fraction of the measured GEMM rate."""
    gemm = record.get("gemm") or {}
    rate = gemm.get("flops_per_s") if gemm.get("status") == "ok" else None
    rows = []
    for point in record["points"]:
        flops = point_flops(record, point) if point["backend"] in COUNTED else None
        if flops is None or point["status"] not in ("ok", "estimated"):
            continue
        row = {"backend": point["backend"], "length": point["length"], "estimated": point["estimated"]}
        for mode, count in zip(("forward", "train"), flops):
            achieved = count / point[mode]["median_s"]
            row[f"{mode}_flops"] = count
            row[f"{mode}_flops_per_s"] = achieved
            row[f"{mode}_fraction"] = achieved / rate if rate else None
        rows.append(row)
    return {"gemm_flops_per_s": rate, "points": rows}
