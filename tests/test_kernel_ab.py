"""scripts/kernel_ab.py: the kernels of a revision against the working tree's, in one process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attentions.ops import native

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "kernel_ab.py"
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_ab  # noqa: E402
from lra.errors import UserError  # noqa: E402

needs_kernels = pytest.mark.skipif(native.load("grouped_cpu") is None, reason="the C kernels do not build here")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


@needs_kernels
def test_the_same_sources_time_alike_and_give_the_same_bits(tmp_path: Path) -> None:
    # HEAD's kernel sources against the working tree's: the same where the tree's csrc is committed
    out = tmp_path / "ab.json"
    done = run("--base", "HEAD", "--attn", "mita,topk", "--lengths", "96", "--batch", "2", "--rounds", "4",
               "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert [(row["backend"], row["length"]) for row in record["rows"]] == [("mita", 96), ("topk", 96)]
    committed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "attentions/csrc"], cwd=ROOT).returncode == 0
    for row in record["rows"]:
        low, mid, high = row["ratio_quartiles"]
        assert 0 < low <= mid <= high
        if committed:
            assert row["results"] == "same bits"
    assert "| mita | 96 |" in done.stdout and record["vector_width"] in (8, 16)


@pytest.mark.parametrize("args, says", [
    (["--base", "no-such-revision"], "is not a commit of this repository"),
    (["--base", "HEAD", "--attn", "mitaa"], "unknown backend(s) mitaa; known:"),
    (["--base", "HEAD", "--lengths", "1k"], "--lengths '1k': give positive whole numbers"),
    (["--base", "HEAD", "--rounds", "0"], "--rounds '0': give positive whole numbers"),
    (["--base", "HEAD", "--json", "/no/such/folder/ab.json"], "its folder does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args, says) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_a_revision_the_python_cannot_drive_is_refused(tmp_path: Path) -> None:
    base, tree = tmp_path / "base", tmp_path / "tree"
    base.mkdir(), tree.mkdir()
    block = "typedef struct {\n    int64_t n;\n    const float *x;\n} Args;\n"
    (tree / "k.c").write_text(block + "int run(const Args *a) { return 0; }\nint more(const Args *a) { return 0; }\n")
    (base / "k.c").write_text(block + "int run(const Args *a) { return 0; }\nstatic int more(void) { return 0; }\n")
    with pytest.raises(UserError, match="lacks more, which the working tree's Python calls"):
        kernel_ab.check_blocks(base, tree, ["k"])
    (base / "k.c").write_text(block.replace("int64_t n;", "int n;") + "int run(const Args *a) { return 0; }\n"
                              "int more(const Args *a) { return 0; }\n")
    with pytest.raises(UserError, match="argument blocks"):
        kernel_ab.check_blocks(base, tree, ["k"])
    # the same fields with other comments and layout are the same block
    (base / "k.c").write_text(block.replace("int64_t n;", "int64_t  n;  /* rows */") + "int run(const Args *a) "
                              "{ return 0; }\nint more(const Args *a) { return 0; }\n")
    kernel_ab.check_blocks(base, tree, ["k"])
    with pytest.raises(UserError, match="the revision has no gone.c"):
        kernel_ab.check_blocks(base, tree, ["gone"])
