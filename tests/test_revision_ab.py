"""scripts/revision_ab.py: a revision's whole package against the working tree's, one worker process each."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attentions.ops import native

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "revision_ab.py"
sys.path.insert(0, str(ROOT / "scripts"))
import revision_ab  # noqa: E402
from lra.errors import UserError  # noqa: E402

needs_kernels = pytest.mark.skipif(native.load("grouped_cpu") is None, reason="the C kernels do not build here")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


@needs_kernels
def test_head_against_the_working_tree_times_both_and_compares_their_bits(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = run("--base", "HEAD", "--attn", "mita,full", "--lengths", "96", "--batch", "2", "--rounds", "2",
               "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["kind"] == "revision_ab" and record["rounds"] == 2
    assert [(row["backend"], row["length"]) for row in record["rows"]] == [("mita", 96), ("full", 96)]
    # the working tree's code is HEAD's where nothing the layers run is changed
    committed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "attentions", "lra"], cwd=ROOT).returncode == 0
    for row in record["rows"]:
        low, mid, high = row["ratio_quartiles"]
        assert 0 < low <= mid <= high and row["median_s"]["base"] > 0 and row["median_s"]["tree"] > 0
        if committed:
            assert row["results"] == "same bits"
    assert "| mita | 96 |" in done.stdout and "one worker process per tree" in done.stdout


def test_a_base_that_is_not_a_commit_is_one_line_and_exit_2() -> None:
    # the other options are kernel_ab.py's (kernel_ab.settings), whose refusals tests/test_kernel_ab.py covers
    done = run("--base", "no-such-revision", "--attn", "mita")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "is not a commit of this repository" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_that_stops_is_reported_with_its_last_line(tmp_path: Path) -> None:
    # a tree whose package does not import: the worker stops before its first step
    tree = tmp_path / "tree"
    (tree / "attentions").mkdir(parents=True)
    (tree / "attentions" / "__init__.py").write_text("raise RuntimeError('this tree does not import')\n")
    with pytest.raises(UserError, match=r"^the base 1234567's worker stopped: RuntimeError: this tree does not "
                                        r"import$"):
        revision_ab.Worker(tree, "base 1234567", ["mita", "96", "2", "2", "32", "0", "1"], tmp_path / "w.log")
