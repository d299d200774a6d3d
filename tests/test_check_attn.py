"""lra-check-attn: the example backend passes, broken backends fail the right check, bad input exits 2;
and the example trains through lra-run --attn-module."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest

from lra.cli.check_attn import main
from lra.cli import guarded
from lra.run.record import validate_record

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_attention.py"

HEADER = '''
from typing import Optional
import torch
import torch.nn.functional as F
from attentions import Attention, Taxonomy, register

@register("{name}")
class Broken(Attention):
    paper = "nobody 2026, a broken backend"
    cost = "O(N^2 D)"
    supports_mask = {supports_mask}
    taxonomy = Taxonomy("none", "1", "raw KV", "none", "dense")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        attn_mask = None if mask is None else mask[:, None, None, :]
'''
SDPA = "F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)"
# forward bodies of broken backends, the check each one must fail, and words the reason must hold
BROKEN: Dict[str, tuple] = {
    "ignores-mask": ("        return F.scaled_dot_product_attention(q, k, v)\n",
                     "padding invariance: FAIL: output at real positions changed", "the backend seems to ignore the mask"),
    "pools-padded-queries": (f"        return {SDPA} + q.mean(2, keepdim=True)\n",
                             "padding invariance: FAIL", "when padded queries changed"),
    "drops-to-float32": (f"        return {SDPA}.float()\n",
                         "shapes and dtype kept: FAIL", "output is float32"),
    "wrong-shape": (f"        return {SDPA}[:, :, 1:]\n",
                    "shapes and dtype kept: FAIL", "output shape (3, 2, 63, 16), expected [B, H, N, D] = (3, 2, 64, 16)"),
    "not-a-tensor": (f"        return ({SDPA},)\n", "shapes and dtype kept: FAIL", "forward returned tuple, not a tensor"),
    "nan-padded-rows": ("        real = torch.ones_like(q[:, 0, :, 0], dtype=torch.bool) if mask is None else mask\n"
                        f"        return {SDPA} * torch.where(real[:, None, :, None], 1.0, float('nan'))\n",
                        "forward and backward finite: FAIL", "at padded rows"),
    # adds exactly zero, so every output is right, but the gradient of each real output reaches every key
    "gradient-into-padding": (f"        return {SDPA} + (k - k.detach()).mean(2, keepdim=True)\n",
                              "padding gets no gradient: FAIL", "the real outputs send gradient to padded keys"),
}


# backends a test loads from a file are forgotten after it
pytestmark = pytest.mark.usefixtures("isolated_registry")


def backend_file(folder: Path, name: str, body: str, supports_mask: bool = True) -> Path:
    path = folder / f"{name.replace('-', '_')}.py"
    path.write_text(HEADER.format(name=name, supports_mask=supports_mask) + body)
    return path


def test_example_passes_every_check(capsys: pytest.CaptureFixture) -> None:
    assert main([str(EXAMPLE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("myattn (") and "float64" in lines[0]
    checks = [line.strip() for line in lines[1:-1]]
    assert len(checks) == 9 and all(": PASS" in line for line in checks), checks
    assert any(line.startswith("padding invariance: PASS") for line in checks)
    assert any(line.startswith("padded batch vs unpadded runs: PASS") for line in checks)


@pytest.mark.parametrize("body, check, why", BROKEN.values(), ids=BROKEN.keys())
def test_broken_backend_fails_the_right_check(tmp_path: Path, capsys: pytest.CaptureFixture, request: pytest.FixtureRequest,
                                              body: str, check: str, why: str) -> None:
    assert main([str(backend_file(tmp_path, request.node.callspec.id, body))]) == 1
    out = capsys.readouterr().out
    failed = [line.strip() for line in out.splitlines() if ": FAIL" in line]
    assert failed and failed[0].startswith(check) and why in failed[0], out


def test_backend_without_mask_support_skips_the_mask_checks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = backend_file(tmp_path, "nomask", "        return F.scaled_dot_product_attention(q, k, v)\n", supports_mask=False)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    for check in ("padding invariance", "padded batch vs unpadded runs"):
        assert f"{check}: SKIP: not supported" in out
    assert "forward and backward finite: PASS: without a mask" in out


def test_built_in_name_is_checked(capsys: pytest.CaptureFixture) -> None:
    assert main(["--name", "full"]) == 0
    assert capsys.readouterr().out.startswith("full (built-in): float64")


def test_set_options_and_a_tasks_own_options_reach_the_battery(capsys: pytest.CaptureFixture) -> None:
    # --set builds the backend with the option: MiTA's depth-wise convolution is on
    assert main(["--name", "mita", "--set", "dwc=true", "attn.dwc_kernel=5"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("mita (built-in): float64, B=3 H=2 N=64 D=16, dwc=True dwc_kernel=5")
    # with --task, the options of the run that task and preset resolve to: Linformer's 16 rows on MQAR
    assert main(["--name", "linformer", "--task", "mqar", "--preset", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "k=16" in out.splitlines()[0] and "budget: PASS: 'k = 16'" in out


BAD = {
    "not-python": ("notes.txt", "x = 1\n", [], "is not a Python file"),
    "missing-file": ("absent.py", None, [], "is not a Python file"),
    "import-error": ("imports.py", "import no_such_module_here\n", [], "could not import"),
    "syntax-error": ("syntax.py", "def broken(:\n", [], "SyntaxError"),
    "registers-nothing": ("nothing.py", "x = 1\n", [], "registers no new backend"),
    "unknown-name": (None, None, ["--name", "nosuch"], "unknown --name 'nosuch'; known: full"),
    "timing-reference": (None, None, ["--name", "none"], "'none' is a timing reference (the model without attention), "
                         "not a backend to check; known: full"),
    "no-arguments": (None, None, [], "give the Python file"),
    "unknown-option": (None, None, ["--name", "mita", "--set", "nope=1"], "unknown option 'nope' for attention 'mita'"),
    "not-an-option": (None, None, ["--name", "mita", "--set", "train.lr=1"], "must be a backend option KEY=VALUE"),
}


@pytest.mark.parametrize("file, text, extra, message", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, file: str, text: str, extra: list,
                                      message: str) -> None:
    args = list(extra)
    if file is not None:
        if text is not None:
            (tmp_path / file).write_text(text)
        args.insert(0, str(tmp_path / file))
    assert guarded("lra-check-attn", lambda: main(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lra-check-attn: error:") and message in err[0], err


def test_example_trains_through_lra_run(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, listops_data: Path) -> None:
    # on the session's smoke ListOps set (generation into a data folder: tests/test_cli.py's smoke run;
    # ./data as the default folder: tests/test_cache.py's run on a changed cache)
    monkeypatch.chdir(tmp_path)
    proc = cli("lra-run", "--attn-module", EXAMPLE, "--attn", "myattn", "--task", "listops", "--preset", "smoke",
               "--data-dir", listops_data, "--set", "train.steps=2", "train.eval_every=1", "--out", "runs", "--quiet")
    assert proc.code == 0, proc.err
    [path] = list((tmp_path / "runs").glob("*/record.json"))
    record = json.loads(path.read_text())
    validate_record(record)
    assert record["status"] == "completed" and record["attn"] == "myattn" and record["steps"] == 2
    assert record["attn_budget"] == "N" and 0.0 <= record["test_acc"] <= 1.0


def test_a_backend_without_taxonomy_fails_alone_in_its_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # two backends in one file; the second declares no taxonomy: it fails its own check, the first still passes
    body = f"        return {SDPA}\n"
    second = (HEADER.format(name="untaxed", supports_mask=True).replace("class Broken", "class Untaxed")
              .replace('    taxonomy = Taxonomy("none", "1", "raw KV", "none", "dense")\n', "") + body)
    path = tmp_path / "two.py"
    path.write_text(HEADER.format(name="taxed", supports_mask=True) + body + second)
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "taxonomy: FAIL" in out and out.count(": FAIL") == 1
    assert "taxed (" in out and "untaxed (" in out
