"""scripts/profile_step.py on the CPU: the profile of a small point, and its one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attentions.ops.grouped import cpu as grouped_cpu
from conftest import load_script
from lra.cli import call


def native_kernels() -> bool:
    return grouped_cpu.takes(torch.zeros(0))


def test_profiles_each_backend_and_length(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "profile"
    argv = ["--steps", "2", "--top", "4", "--out", str(out), "attention", "--attn", "full,mita",
            "--lengths", "128,256", "--threads", "1"]
    assert call("profile_step.py", load_script("profile_step").main, argv) == 0
    record = json.loads((out / "profile.json").read_text())
    assert [(p["backend"], p["length"]) for p in record["points"]] == [
        ("full", 128), ("full", 256), ("mita", 128), ("mita", 256)]
    for point in record["points"]:
        assert point["wall_ms"] > 0 and 0 < point["busy_ms"] and point["ops_per_step"] > 0
        assert 1 <= len(point["operators"]) <= 4 and point["kernels"] == [] and point["kernels_per_step"] is None
        times = [r["ms"] for r in point["operators"]]
        assert times == sorted(times, reverse=True)
        assert all(r["name"].startswith(("aten::", "lra::")) for r in point["operators"])
    # full attention's step is its fused SDPA kernel on the CPU, and the profile says so
    assert any("scaled_dot_product" in r["name"] for r in record["points"][0]["operators"])
    # MiTA's C kernels are named: they are the operators lra::<name>, no patching needed
    if native_kernels():
        assert any(r["name"].startswith("lra::") for r in record["points"][3]["operators"])
    text = (out / "profile.md").read_text()
    assert "| full | 256 | 1 |" in text and "| mita | 128 | 1 |" in text and "### mita, N = 256, batch 1" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0", "attention", "--lengths", "128"], "--steps and --top must be at least 1"),
    (["model", "--attn", "mita", "--lengths", "1k"], "the model level needs --batch"),
    (["attention", "--attn", "nope", "--lengths", "128"], "unknown attention 'nope'"),
    (["attention", "--lengths", "0"], "is not a length"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture, argv, says) -> None:
    out = tmp_path / "profile"
    assert call("profile_step.py", load_script("profile_step").main, ["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not out.exists()
