"""scripts/authors_pairs.py and authors_ab.py: each baseline against its authors' PyTorch code (the
[authors] extra) computes the same outputs and input gradients where the pair says it does, and the
timing script writes its record."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import authors_pairs  # noqa: E402
from authors_ab import NEEDS  # noqa: E402

# (pair, its index in PAIRS, N): lengths the authors' code takes (Longformer: a multiple of its
# 512-key window; BigBird: more than 11 blocks of 64; Nystromformer: a multiple of 128 landmarks)
CASES = [("performer", 0, 256), ("reformer", 0, 512), ("local", 0, 256), ("longformer", 0, 1024),
         ("bigbird", 0, 1024), ("nystromformer", 0, 512), ("nystromformer", 1, 512)]


def installed(name: str) -> bool:
    return importlib.util.find_spec(NEEDS[name]) is not None


@pytest.mark.parametrize("name,index,n", CASES, ids=[f"{c[0]}-{c[1]}-N{c[2]}" for c in CASES])
def test_each_pair_computes_what_it_says(name: str, index: int, n: int) -> None:
    if not installed(name):
        pytest.skip(f"{NEEDS[name]} is not installed (pip install -e '.[authors]')")
    torch.manual_seed(0)
    pair = authors_pairs.PAIRS[name][index](1, 2, n, 16, torch.Generator().manual_seed(0))
    verdict = authors_pairs.check(pair)
    if pair.tolerance is None:
        # a pair that differs says how, and still differs by little (the same mechanism)
        assert verdict.startswith("differ (") and pair.differs in verdict
    else:
        assert verdict.startswith("same:"), verdict


def test_the_script_writes_its_record_and_table(tmp_path: Path) -> None:
    if not installed("performer"):
        pytest.skip("performer-pytorch is not installed (pip install -e '.[authors]')")
    out, table = tmp_path / "ab.json", tmp_path / "ab.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "authors_ab.py"), "--attn", "performer", "--lengths",
                           "128,256", "--batch", "1", "--heads", "2", "--head-dim", "16", "--rounds", "2",
                           "--threads", "1", "--json", str(out), "--markdown", str(table)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert [(r["baseline"], r["length"]) for r in record["rows"]] == [("performer", 128), ("performer", 256)]
    row = record["rows"][0]
    assert len(row["ours_times_s"]) == len(row["theirs_times_s"]) == 2 and row["results"].startswith("same:")
    assert row["ratio"] == pytest.approx(row["ours_s"] / row["theirs_s"])
    assert record["load_average"]["start"] and record["machine"] and "performer_pytorch" in record["packages"]
    assert "Largest ours / theirs" in table.read_text()


def test_the_script_refuses_an_unknown_pair() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "authors_ab.py"), "--attn", "mita"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no pair for mita" in done.stderr
