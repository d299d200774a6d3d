"""lra-analyze recall: each MQAR query placed by its key's distance and its pair's rank, scored right,
and counted in context when it names one of the sequence's values."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from lra.analyze.recall import binned, example
from lra.tasks.base import IGNORE


def test_a_hand_made_sequences_queries_are_placed_and_scored() -> None:
    # one-token form: keys 5, 7, 9 paired at positions 0-2 (values 100, 101, 102), queries at 4, 6, 8
    keys = np.array([5, 7, 9, 0, 9, 0, 5, 0, 7, 0])
    target = np.full(10, IGNORE)
    target[[4, 6, 8]] = [102, 100, 101]
    guess = np.zeros(10, dtype=np.int64)
    guess[[4, 6, 8]] = [102, 101, 3]  # right; a value of the sequence but the wrong one; not a value at all
    correct, in_context, distance, rank, pairs = example(keys, target, guess)
    assert correct.tolist() == [True, False, False]
    assert in_context.tolist() == [True, True, False]
    assert distance.tolist() == [4 - 2, 6 - 0, 8 - 1]
    assert rank.tolist() == [2, 0, 1]
    assert pairs.tolist() == [3, 3, 3]


def test_bins_cover_each_value_once() -> None:
    values = np.array([1, 4, 5, 8, 9, 300])
    got = binned(values, 1, (4, 8, 16, 256))
    assert [label for label, _ in got] == ["1-4", "5-8", "9-16", "> 256"]
    assert sum(int(mask.sum()) for _, mask in got) == len(values)


def test_the_probe_on_a_finished_mqar_run_and_a_refusal_elsewhere(cli: Callable, tmp_path: Path,
                                                                 listops_data: Path) -> None:
    ran = cli("lra-run", "--task", "mqar", "--attn", "full", "--preset", "smoke", "--out", tmp_path / "runs", "--quiet",
              "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "train.steps=4", "train.eval_every=2")
    assert ran.code == 0, ran.err
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    ran = cli("lra-analyze", "recall", run, "--out", tmp_path / "a", "--quiet")
    assert ran.code == 0, ran.err
    text = (tmp_path / "a" / "recall.md").read_text()
    assert "accuracy by distance back to the key" in text and "accuracy by rank of the pair asked for" in text
    ran = cli("lra-run", "--task", "listops", "--attn", "full", "--preset", "smoke", "--out", tmp_path / "lo", "--quiet",
              "--data-dir", listops_data, "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1",
              "train.steps=2", "train.eval_every=2", "data.max_len=64")
    assert ran.code == 0, ran.err
    ran = cli("lra-analyze", "recall", next(p for p in (tmp_path / "lo").iterdir() if p.is_dir()), "--out", tmp_path / "b")
    assert ran.code == 2 and "recall probes MQAR runs" in ran.err and not (tmp_path / "b").exists()
