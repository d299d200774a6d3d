"""TTT's inner learner alone on associative recall: what one mini-batch of gradient steps stores, read
back by queries equal to the keys, with no outer training (the authors' initialisation, W ~ N(0, 0.02^2)).

P pairs (keys of norm |k|, values N(0, 1)) fill the first P places of a mini-batch of 16, each key's step
size base_lr sigmoid(0) / D (the other places take none); each key is then asked once in the next
mini-batch, which reads the weights the pairs left (attentions/ops/ttt/dual.py computes the same read).
A query is recalled when f(q) lies nearest its own value among the P. Printed per setting: recall of
TTT-Linear, of TTT-MLP, and of TTT-MLP whose inner biases take no step (a diagnostic, not a backend
option); and the mean norm of the three parts of TTT-MLP's second-layer read at a query, before its
layer norm:

    initial   gelu(q W1' + b1') W2 + b2        the initial weights (W1' the stepped first layer)
    keys      -sum_s e_s (x2(q) . x2(k_s)) G_s  what tells the keys apart: the hidden features' products
    bias      -sum_s e_s G_s                    the bias's step: the same for every query

    python scripts/ttt_recall_probe.py [--dim 16] [--pairs 8] [--trials 512]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch

if importlib.util.find_spec("attentions") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attentions.ops.ttt.common import layer_norm  # noqa: E402
from attentions.ops.ttt.dual import gelu, gelu_grad, ln_l2_grad  # noqa: E402

EPS = 1e-6
# the authors' W0 (ttt.py: torch.normal(0, 0.02)), hidden width 4D, mini-batch 16 (its 1/t at t = 16)
INIT_STD, WIDTH, MINI_BATCH = 0.02, 4, 16


def pairs(trials: int, p: int, d: int, norm: float, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, P, D] of norm ``norm`` and values [T, P, D]."""
    keys = torch.randn(trials, p, d, generator=gen, dtype=torch.float64)
    return keys / keys.norm(dim=-1, keepdim=True) * norm, torch.randn(trials, p, d, generator=gen, dtype=torch.float64)


def initial_weights(d: int, hidden: int, gen: torch.Generator) -> List[torch.Tensor]:
    """W1 [D, hidden], b1, W2 [hidden, D], b2 (hidden 0: W [D, D], b)."""
    shapes = [(d, d), (1, d)] if hidden == 0 else [(d, hidden), (1, hidden), (hidden, d), (1, d)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64) * INIT_STD if s[0] > 1 else
            torch.zeros(*s, dtype=torch.float64) for s in shapes]


def read(weights: List[torch.Tensor], keys: torch.Tensor, values: torch.Tensor, step: float,
         bias_steps: bool = True) -> Tuple[torch.Tensor, Dict[str, float]]:
    """f(q) [T, P, D] for q = each key, after one mini-batch of steps (``step`` per key, times 1/16)
    on the pairs; and, for the MLP, the mean norms of its second-layer read's parts."""
    d = keys.shape[-1]
    ln = (torch.ones(d, dtype=keys.dtype), torch.zeros(d, dtype=keys.dtype))
    e = torch.full(keys.shape[:-1] + (1,), step / MINI_BATCH, dtype=keys.dtype)  # [T, P, 1]
    keep = 1.0 if bias_steps else 0.0
    target = values - keys
    if len(weights) == 2:
        w, b = weights
        g = ln_l2_grad(keys @ w + b, target, *ln, EPS)
        w, b = w - (e * keys).transpose(-1, -2) @ g, b - keep * (e * g).sum(-2, keepdim=True)
        return keys + layer_norm(keys @ w + b, *ln, EPS), {}
    w1, b1, w2, b2 = weights
    z1 = keys @ w1 + b1
    x2 = gelu(z1)
    g2 = ln_l2_grad(x2 @ w2 + b2, target, *ln, EPS)
    g1 = (g2 @ w2.transpose(-1, -2)) * gelu_grad(z1)
    w1, b1 = w1 - (e * keys).transpose(-1, -2) @ g1, b1 - keep * (e * g1).sum(-2, keepdim=True)
    x2q = gelu(keys @ w1 + b1)
    parts = {
        "initial": x2q @ w2 + b2,
        "keys": -(x2q @ x2.transpose(-1, -2) * e.transpose(-1, -2)) @ g2,
        "bias": -keep * (e * g2).sum(-2, keepdim=True).expand(x2q.shape[:-1] + (d,)),
    }
    z = parts["initial"] + parts["keys"] + parts["bias"]
    return keys + layer_norm(z, *ln, EPS), {name: float(x.norm(dim=-1).mean()) for name, x in parts.items()}


def recall(out: torch.Tensor, values: torch.Tensor) -> float:
    """The share of queries whose read lies nearest their own value."""
    nearest = torch.cdist(out, values).argmin(dim=-1)  # [T, P]
    return float((nearest == torch.arange(values.shape[1])).double().mean())


def probe(d: int, p: int, trials: int, norm: float, base_lr: float, seed: int = 0) -> Dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    keys, values = pairs(trials, p, d, norm, gen)
    step = base_lr * 0.5 / d
    linear, _ = read(initial_weights(d, 0, gen), keys, values, step)
    weights = initial_weights(d, WIDTH * d, gen)
    mlp, parts = read(weights, keys, values, step)
    no_bias, _ = read(weights, keys, values, step, bias_steps=False)
    return {"linear": recall(linear, values), "mlp": recall(mlp, values), "mlp_no_bias_steps": recall(no_bias, values),
            **parts}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=16, help="head dim D (MQAR's cpu preset: 16)")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--trials", type=int, default=512)
    args = parser.parse_args(argv)
    print(f"D = {args.dim}, {args.pairs} pairs, {args.trials} trials; chance {1 / args.pairs:.3f}")
    print("| base_lr | key norm | recall: linear | MLP | MLP, no bias steps | MLP read: initial | keys | bias |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for base_lr in (0.1, 1.0):
        for norm in (2.0, 4.0):
            r = probe(args.dim, args.pairs, args.trials, norm, base_lr)
            print(f"| {base_lr} | {norm:g} | {r['linear']:.3f} | {r['mlp']:.3f} | {r['mlp_no_bias_steps']:.3f} | "
                  f"{r['initial']:.2e} | {r['keys']:.2e} | {r['bias']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
