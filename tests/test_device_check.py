"""scripts/device_check.py on the CPU (bf16 autocast on the CPU stands in for an accelerator), and
every backend under autocast with float32 inputs, the case that broke the grouped kernel of MoBA
and MiTA before its Function ran in one dtype."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attentions import build_attention, list_attentions
from attentions.registry import config_fields
from conftest import load_script



def test_every_backend_passes_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the Triton rows are left to the next test: under the interpreter they take a minute at this length
    assert load_script("device_check").main(["--device", "cpu", "--length", "128", "--kernels", "torch", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "check.json").read_text())
    rows = [f"{name}[torch]" if "kernel" in config_fields(name) else name for name in list_attentions()]
    assert [b["backend"] for b in record["backends"]] == rows
    # the result rows are printed once, under the header
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| backend |") and sum(line.startswith("| backend |") for line in printed) == 1
    for name in rows:
        assert sum(line.startswith(f"| {name} |") for line in printed) == 1, name
    assert {"mita[torch]", "moba[torch]"} <= set(rows)
    for backend in record["backends"]:
        assert backend["fp32"]["status"] == "PASS" and backend["bf16"]["status"] == "PASS", backend["backend"]
        # the same module on the same device in float32 is exact; bf16 is not
        assert backend["fp32"]["out"]["max_row_err"] < 1e-5
        assert backend["bf16"]["out"]["median_row_err"] > 0
    assert "| mita[torch] |" in (tmp_path / "check.md").read_text()
    # flash-attn's varlen path runs on CUDA only: the record and the table say why it did not run
    from attentions.backends import full

    why = "flash-attn runs on CUDA only" if full.flash_attn_varlen_func is not None else \
        "flash-attn is not installed (pip install flash-attn)"
    assert record["flash_varlen"] == {"status": "SKIP", "why": why}
    assert f"flash-attn varlen (full attention, padded batch): skipped: {why}" in (tmp_path / "check.md").read_text()


def test_triton_rows_run_under_the_interpreter_and_are_skipped_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from attentions.ops.grouped.triton_op import interpreting

    if not interpreting():
        pytest.skip("TRITON_INTERPRET=1 is off (tests/conftest.py sets it unless told 0)")
    script = load_script("device_check")
    assert script.main(["--device", "cpu", "--attn", "moba", "--length", "64", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "check.json").read_text())
    assert [b["backend"] for b in record["backends"]][:2] == ["moba[torch]", "moba[triton]"]
    assert record["backends"][1]["fp32"]["out"]["max_row_err"] < 1e-5
    # the C kernel's row, where it builds, runs on the CPU whatever Triton does
    rows = {b["backend"]: b for b in record["backends"]}
    assert "moba[cpu]" in rows and ("skipped" in rows["moba[cpu]"] or rows["moba[cpu]"]["fp32"]["status"] == "PASS")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert script.main(["--device", "cpu", "--attn", "moba", "--length", "64"]) == 0
    assert "| moba[triton] | skipped: Triton on the CPU needs TRITON_INTERPRET=1 |" in capsys.readouterr().out


def test_verdict_fails_a_dense_backend_off_by_one_row() -> None:
    script = load_script("device_check")
    errs = {"out": torch.tensor([1e-3] * 99 + [0.2])}
    assert script.verdict("full", errs, 5e-2, 2e-2)["status"] == "FAIL"
    assert script.verdict("topk", errs, 5e-2, 2e-2)["status"] == "PASS"
    assert script.verdict("topk", {"out": torch.full((10,), 0.1)}, 5e-2, 2e-2)["status"] == "FAIL"


def test_unknown_backend_is_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert load_script("device_check").main(["--device", "cpu", "--attn", "nope"]) == 2
    assert "unknown backend(s) nope; valid:" in capsys.readouterr().err


@pytest.mark.parametrize("name", list_attentions())
def test_float32_inputs_under_autocast(name: str) -> None:
    torch.manual_seed(0)
    attn = build_attention(name, num_heads=2, head_dim=16, max_len=64)
    q, k, v = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(3))
    mask = torch.arange(64)[None, :] < torch.tensor([64, 30])[:, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v, mask if attn.supports_mask else None)
    out.float().sum().backward()
    assert out.shape == (2, 2, 64, 16) and bool(out.isfinite().all())
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))
