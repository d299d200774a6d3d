"""The C kernels on 64-bit ARM: every library of attentions/csrc builds with the aarch64 cross compiler
(aarch64-linux-gnu-gcc; CI installs it) the way attentions/ops/native.py builds it on an ARM machine,
into an aarch64 shared library with no symbol left undefined (an x86 intrinsic that reached the ARM
form would be an undeclared function, then an undefined symbol). tests/test_kernel_widths.py runs the
kernel tests on that form's source built for x86 (LRA_KERNEL_WIDTH=portable), and the last test here
runs those that compare results (all but the opchecks) on aarch64 itself, under qemu
(scripts/arm_check.sh), where its environment has been set up (CI does)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attentions.ops import native

ROOT = Path(__file__).resolve().parent.parent
ARM_DIR = Path(os.environ.get("ARM_CHECK_DIR") or Path.home() / ".cache" / "lra-suite" / "arm")
# the newest torch whose aarch64 wheel on PyPI is a CPU build
TORCH_ON_ARM = "2.7.1"

CROSS = "aarch64-linux-gnu-gcc"
# ELF header: e_machine (2 bytes, little-endian) at offset 18; 183 is EM_AARCH64
EM_AARCH64 = 183
# on top of native.FLAGS (an ARM machine adds no width flag to them): an undeclared function is an
# error, and so is a symbol that no library the kernel links defines
STRICT = ["-Werror=implicit-function-declaration", "-Wl,-z,defs"]

needs_cross = pytest.mark.skipif(shutil.which(CROSS) is None,
                                 reason=f"no {CROSS} here (Debian: apt-get install gcc-aarch64-linux-gnu)")


def libraries() -> list:
    return sorted(native.SOURCES.glob("*.c"))


def test_every_kernel_library_is_listed() -> None:
    names = {path.stem for path in libraries()}
    assert {"grouped_cpu", "landmark_cpu", "mita_layer_cpu", "block_gate", "topk_select", "topk_attention",
            "sparse_rows", "dropout_cpu", "layer_norm_cpu", "gelu_dropout_cpu", "ttt_cpu"} <= names


@needs_cross
@pytest.mark.parametrize("source", libraries(), ids=lambda path: path.stem)
def test_the_kernel_builds_for_aarch64(source: Path, tmp_path: Path) -> None:
    target = tmp_path / f"{source.stem}.so"
    # native._build tries native.FLAGS, then without -march=native (which a cross compiler may refuse)
    error = native._build(source, shutil.which(CROSS), target, STRICT)
    assert error == "", error
    header = target.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64


def arm_environment_missing() -> str:
    """Why the kernel tests cannot run on aarch64 here ('' when they can)."""
    if shutil.which("qemu-aarch64") is None or shutil.which(CROSS) is None:
        return f"no qemu-aarch64 or {CROSS} here (bash scripts/arm_check.sh --setup installs them, as root on Debian)"
    if not (ARM_DIR / "sysroot/usr/bin/python3.11").exists() or not (ARM_DIR / f"site-{TORCH_ON_ARM}/torch").is_dir():
        return f"no aarch64 Python and torch {TORCH_ON_ARM} in {ARM_DIR} (bash scripts/arm_check.sh --setup makes them)"
    return ""


@pytest.mark.skipif(bool(arm_environment_missing()), reason=arm_environment_missing())
def test_the_kernel_tests_pass_on_aarch64() -> None:
    run = subprocess.run(["bash", "scripts/arm_check.sh", TORCH_ON_ARM], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"aarch64 torch {TORCH_ON_ARM}" in run.stdout and "8 floats wide" in run.stdout
    summary = run.stdout.strip().splitlines()[-1]  # pytest's last line: "N passed in S s"
    assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in .*", summary), summary
