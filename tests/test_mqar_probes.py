"""scripts/mqar_probes.py: which MQAR cells the failure rule names, and a retrained run found again
instead of trained twice."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Callable, Dict

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mqar_probes", ROOT / "scripts" / "mqar_probes.py")
probes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probes)


def cell(*accs: float) -> list:
    return [{"test_acc": a / 100, "seed": i} for i, a in enumerate(accs)]


def test_the_rule_names_cells_near_the_guess_level_or_split_by_seed() -> None:
    found = {
        ("local", 16): cell(0.8, 0.8, 0.8),        # under 200/16 = 12.5%
        ("linformer", 32): cell(6.0),              # 6.0 <= 200/32 = 6.25%
        ("agent", 32): cell(37.0, 36.0, 38.0),     # above it, seeds together
        ("linear", 8): cell(97.7, 56.8, 95.7),     # seeds 40.9 points apart
        ("moba", 16): cell(78.0, 80.0, 60.0),      # 20 points apart: kept
    }
    assert probes.failing(found) == [("linear", 8), ("linformer", 32), ("local", 16)]


def test_a_run_that_repeats_the_record_is_found_not_trained_again(cli: Callable, tmp_path: Path) -> None:
    ran = cli("lra-run", "--task", "mqar", "--attn", "full", "--preset", "smoke", "--out", tmp_path / "runs", "--quiet",
              "--no-estimate", "--set", "model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "train.steps=4",
              "train.eval_every=2")
    assert ran.code == 0, ran.err
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    record: Dict = json.loads((run / "record.json").read_text())
    assert probes.same(json.loads((run / "config.json").read_text()), record["config"])
    assert probes.train_again(record, tmp_path / "runs") == run
    other = dict(record["config"], train=dict(record["config"]["train"], lr=record["config"]["train"]["lr"] * 3))
    assert not probes.same(json.loads((run / "config.json").read_text()), other)
