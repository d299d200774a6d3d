"""The ceiling beside every ratio: the ``none`` backend (the model without attention) is a timing
reference that lra-bench and scripts/step_compare.py time and nothing trains or lists; each backend's
share of the ceiling; scripts/op_rates.py's operator rates."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from attentions import build_attention, get_attention, is_timing_reference, list_attentions
from conftest import ROOT, load_script
from lra.bench.cli import main as bench_main, parse_backends
from lra.cli import call
from lra.cli.run import main as run_main
from lra.sweep.cli import main as sweep_main
from lra.tables.throughput import speedup_table, throughput_table

REFUSAL = ("none is a timing reference (the model without attention), not a backend to train; "
           "lra-bench and scripts/step_compare.py time it")


def test_none_returns_the_values_exactly_and_takes_a_mask() -> None:
    attn = build_attention("none", num_heads=2, head_dim=16, max_len=64)
    q, k, v = torch.randn(3, 2, 2, 64, 16).unbind(0)  # [B, H, N, D] each
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, 40:] = False
    assert torch.equal(attn(q, k, v), v) and torch.equal(attn(q, k, v, mask=mask), v)
    # the contract's shape checks still apply: a mask of the wrong shape is refused
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        attn(q, k, v, mask=mask[:, :32])
    v.requires_grad_()
    attn(q, k, v).sum().backward()
    assert torch.equal(v.grad, torch.ones_like(v))


def test_none_is_listed_only_when_timing_references_are_asked_for() -> None:
    assert "none" not in list_attentions() and "full" in list_attentions()
    assert list_attentions(timing=True) == ["none", *list_attentions()]
    assert is_timing_reference("none") and not is_timing_reference("full") and not is_timing_reference("nosuch")
    assert get_attention("none").timing_only and not get_attention("mita").timing_only
    # lra-bench takes it when named, and leaves it out of "every backend"
    assert parse_backends("full,none") == ["full", "none"] and "none" not in parse_backends(None)


def test_lra_run_refuses_none_in_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert call("lra-run", run_main, ["--task", "listops", "--attn", "none", "--preset", "cpu", "--out", "runs"]) == 2
    err = capsys.readouterr().err
    assert err == f"lra-run: error: {REFUSAL}\n"
    assert list(tmp_path.iterdir()) == []


def test_lra_sweep_refuses_a_grid_with_none_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep"
    argv = ["run", "--task", "listops", "--attn", "full,none", "--preset", "cpu", "--out", str(out)]
    assert call("lra-sweep", sweep_main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lra-sweep: error: ") and REFUSAL in err
    assert not out.exists()


def test_step_compare_prints_the_ceiling_and_each_share(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "step_compare.py"), "--attn", "mita", "--lengths", "64", "--batch", "2",
         "--rounds", "1", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    header, _, row = proc.stdout.splitlines()[:3]
    # full and none are timed though only mita was named
    assert header == ("| batch | N | full step | mita step | none step | full/mita | ceiling full/none | mita share |")
    # at N = 64 full may time below none: the share is then n/a
    assert re.fullmatch(r"\| 2 \| 64 \|( \d+ ms \|){3} [\d.]+x \| [\d.]+x \| (-?\d+%|n/a) \|", row), row
    assert "share = (full step - backend step) / (full step - none step)" in proc.stdout
    record = json.loads(out.read_text())
    (only,) = record["rows"]
    med = only["median_s"]
    assert set(med) == {"full", "mita", "none"} and all(t > 0 for t in med.values())
    assert only["ceiling"] == pytest.approx(med["full"] / med["none"])
    assert only["ratio"]["mita"] == pytest.approx(med["full"] / med["mita"])
    if med["full"] > med["none"]:
        assert only["share"]["mita"] == pytest.approx((med["full"] - med["mita"]) / (med["full"] - med["none"]))
    assert record["machine"] and record["torch_threads"] == 1 and record["commit"]
    assert len(record["load_average"]["start"]) == 3 and len(record["load_average"]["end"]) == 3


def test_step_compare_summary_is_the_share_of_the_attention_time() -> None:
    module = load_script("step_compare")
    # full 10 s, none 2 s: the attention costs 8 s; a 4 s backend removes 6 of them
    got = module.summary({"full": 10.0, "mita": 4.0, "none": 2.0})
    assert got == {"mita": {"ratio": 2.5, "share": 0.75}}
    assert module.timed_backends(["mita", "floor"], False) == ["full", "mita", "none"]
    assert module.timed_backends(["full", "moba"], True) == ["full", "moba", "full+compiled", "moba+compiled", "none"]


def model_sweep(tmp_path: Path) -> Dict[str, Any]:
    argv = ["model", "--attn", "full,linear,none", "--lengths", "64", "--batch", "2", "--layers", "1", "--width", "16",
            "--heads", "2", "--ffn-dim", "16", "--gemm-size", "0", "--budget-s", "60", "--threads", "1", "--warmup", "1",
            "--repeats", "2", "--quiet", "--no-plot", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    return json.loads((tmp_path / "record.json").read_text())


def test_lra_bench_labels_none_as_the_ceiling_and_lra_table_leaves_it_out(tmp_path: Path) -> None:
    record = model_sweep(tmp_path)
    assert [p["backend"] for p in record["points"]] == ["full", "linear", "none"]
    assert all(p["status"] == "ok" for p in record["points"])
    table = (tmp_path / "table.md").read_text()
    assert "| none (without attention: the ceiling) |" in table and "| none (without attention) |" in table
    t = {p["backend"]: p["train"]["median_s"] / p["batch"] for p in record["points"]}
    # at N = 64 full may time below none: the share is then n/a
    share = f"{(t['full'] - t['linear']) / (t['full'] - t['none']):.0%}" if t["full"] > t["none"] else "n/a"
    section = table.split("**Train share of the ceiling**")[1].split("**")[0]
    assert f"| linear | {share} |" in section and "none" not in section and "| full |" not in section
    # lra-table's throughput tables are of backends: the timing reference is not one of their rows
    rows = throughput_table(tmp_path / "record.json", record).rows
    assert [r[0] for r in rows] == ["full", "linear"]
    speed = speedup_table(tmp_path / "record.json", record, {})
    assert speed is not None and {r[0] for r in speed.rows} == {"linear"}


@pytest.mark.skipif(bool(__import__("attentions.ops.grouped.cpu", fromlist=["refusals"]).refusals(torch.ones(1))),
                    reason="the C kernels are not built on this machine")
def test_op_rates_writes_consistent_rates_at_tiny_sizes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    module = load_script("op_rates")
    argv = ["--lengths", "256", "--heads", "2", "--head-dim", "16", "--gemm-size", "64", "--warmup", "0",
            "--repeats", "1", "--threads", "1", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "op_rates.json").read_text())
    table = (tmp_path / "op_rates.md").read_text()
    assert table in capsys.readouterr().out
    rate = record["gemm"]["flops_per_s"]
    assert rate > 0 and record["gemm"]["size"] == 64
    ops = {(r["backend"], r["op"]): r for r in record["rows"]}
    for name in ("lra::mita_prepare", "lra::grouped_forward", "lra::mita_backward"):
        assert ("mita", name) in ops, sorted(ops)
    assert ("moba", "lra::block_gate") in ops and ("topk", "lra::topk_attention") in ops and ("topk", "lra::mix_rows") in ops
    for row in record["rows"]:
        assert row["calls"] >= 1 and row["seconds"] > 0 and row["elements"] > 0 and row["length"] == 256
        assert row["elements_per_s"] == pytest.approx(row["elements"] / row["seconds"])
        if row["flops"] is None:
            assert row["flops_per_s"] is None and row["gemm_fraction"] is None
        else:
            assert row["flops"] > 0 and row["flops_per_s"] == pytest.approx(row["flops"] / row["seconds"])
            assert row["gemm_fraction"] == pytest.approx(row["flops_per_s"] / rate)
        assert f"| {row['backend']} | {row['op']} | 256 | {row['calls']} |" in table
    # by hand: MiTA's grouped forward, each of B H N = 2 x 256 queries over 64 routed + 64 shared keys, 4 D FLOPs a key
    assert ops[("mita", "lra::grouped_forward")]["flops"] == 4.0 * 2 * 256 * (64 + 64) * 16
    # the preparation: the landmark pass (4 m N D a head: 2 heads, m = 64, N = 256) and the routing (each
    # of the 2 x 256 queries scored against the 64 landmarks, 2 D FLOPs a score); pooling, selection
    # and the grouping count none
    landmark = 4.0 * 2 * 64 * 256 * 16
    assert ops[("mita", "lra::mita_prepare")]["flops"] == landmark + 2.0 * 2 * 256 * 64 * 16
    assert ops[("mita", "lra::mita_prepare")]["elements"] == 2 * 256 * 16
    # the layer's backward: the grouped backward (twice the forward) and the landmark pass's (twice its forward)
    assert ops[("mita", "lra::mita_backward")]["flops"] == 2 * (ops[("mita", "lra::grouped_forward")]["flops"]
                                                              + landmark)


def test_lra_bench_share_of_the_ceiling_is_per_sequence() -> None:
    from lra.bench.report import ceiling_share

    def point(backend: str, batch: int, seconds: float, estimated: bool = False) -> Dict[str, Any]:
        return {"backend": backend, "length": 1024, "batch": batch, "status": "estimated" if estimated else "ok",
                "estimated": estimated, "train": {"median_s": seconds}}

    # per sequence: full 10 s, none 2 s, mita 4 s (its batch of 2 took 8 s): 6 of the 8 attention seconds removed
    index = {(p["backend"], 1024): p for p in (point("full", 1, 10.0, estimated=True), point("none", 1, 2.0),
                                               point("mita", 2, 8.0))}
    assert ceiling_share("train")(index[("mita", 1024)], index) == "~75%"
    del index[("none", 1024)]
    assert ceiling_share("train")(point("mita", 2, 8.0), index) == "n/a"
