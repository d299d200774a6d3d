"""The commit a record names (lra.machine.git_commit): ``+dirty`` for a change of the code, not for a
record made again over its committed files in results/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lra

ROOT = Path(lra.__file__).resolve().parent.parent


def commit_named(checkout: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.run([sys.executable, "-c", "import lra.machine; print(lra.machine.git_commit())"],
                          cwd=checkout, env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def test_a_record_made_again_leaves_the_commit_clean_and_a_code_change_marks_it_dirty(tmp_path: Path) -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the package does not run from a git checkout")
    checkout = tmp_path / "checkout"
    # the package and one results folder of the checkout's HEAD
    subprocess.run(["git", "clone", "-q", "--shared", "--sparse", str(ROOT), str(checkout)], check=True)
    subprocess.run(["git", "sparse-checkout", "add", "lra", "results/allocator"], cwd=checkout, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert commit_named(checkout) == head
    with open(checkout / "results" / "allocator" / "README.md", "a") as f:
        f.write("\nmade again\n")
    assert commit_named(checkout) == head
    with open(checkout / "lra" / "__init__.py", "a") as f:
        f.write("\n# changed\n")
    assert commit_named(checkout) == head + "+dirty"
