"""scripts/ttt_recall_probe.py: its read is the dual form's, and what it measures at the authors'
initialisation (TTT-MLP's read dominated by the bias's step, recall at chance; without the bias steps,
recall well above it)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from attentions.ops.ttt import dual_form

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ttt_recall_probe.py"
spec = importlib.util.spec_from_file_location("ttt_recall_probe", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


@pytest.mark.parametrize("hidden", [pytest.param(0, id="linear"), pytest.param(4, id="mlp")])
def test_the_probes_read_is_the_dual_forms(hidden: int) -> None:
    """Pairs in the first places of mini-batch 0, each key asked in mini-batch 1 (no steps there):
    the dual form's outputs at the queries are the probe's read."""
    d, p, trials, step = 8, 5, 3, 0.3
    gen = torch.Generator().manual_seed(0)
    keys, values = probe.pairs(trials, p, d, 2.0, gen)
    weights = probe.initial_weights(d, hidden * d, gen)
    want, _ = probe.read(weights, keys, values, step)
    q, k, v = (torch.zeros(trials, 1, 32, d, dtype=torch.float64) for _ in range(3))
    k[:, 0, :p], v[:, 0, :p], q[:, 0, 16:16 + p] = keys, values, keys
    lr = torch.zeros(trials, 1, 32, dtype=torch.float64)
    lr[:, 0, :p] = step
    scale = 1.0 / torch.arange(1, 17, dtype=torch.float64)
    ln = torch.ones(1, 1, d, dtype=torch.float64), torch.zeros(1, 1, d, dtype=torch.float64)
    out = dual_form(q, k, v, [w[None] for w in weights], *ln, lr, scale, probe.EPS)
    assert torch.allclose(out[:, 0, 16:16 + p], want, rtol=0, atol=1e-12)


def test_at_the_authors_init_the_mlp_reads_the_bias_step() -> None:
    r = probe.probe(d=16, p=8, trials=256, norm=2.0, base_lr=0.1)
    assert r["bias"] > 10 * r["keys"]
    assert r["mlp"] < 0.25 < 0.5 < r["mlp_no_bias_steps"]
    assert r["linear"] > 0.4
