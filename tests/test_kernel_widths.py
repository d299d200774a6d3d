"""The C kernels at both vector widths (csrc/vec.h): the machine's own (16 floats with AVX-512, 8
otherwise) is what the rest of the suite tests; the other width is built too (LRA_KERNEL_WIDTH=8 on a
machine with AVX-512, LRA_KERNEL_WIDTH=16 elsewhere, each in its own cache) and the reference-vs-fast
kernel tests run against it, so both widths' code paths are tested wherever the suite runs. So is the
portable form (LRA_KERNEL_WIDTH=portable: no x86 intrinsic, the code an ARM machine builds), whose
selection passes no x86 build runs otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attentions.ops import native

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_ops.py", "tests/test_landmark_cpu.py",
                "tests/test_grouped.py", "tests/test_block_gate.py", "tests/test_mita_cpu.py",
                "tests/test_topk_moba.py", "tests/test_ttt_cpu.py", "tests/test_dropout.py", "tests/test_layer_norm.py",
                "tests/test_gelu_dropout.py"]
needs_kernels = pytest.mark.skipif(native.load("grouped_cpu") is None, reason="the C kernels do not build here")


def has_avx512() -> bool:
    return any(line.startswith("flags") and " avx512f" in line for line in native.cpu_identity().splitlines())


def other_width() -> str:
    """The width that is not the machine's own: 8 where AVX-512 is, else 16."""
    return "8" if has_avx512() else "16"


def width_env(tmp_path: Path, width: str) -> dict:
    return {**os.environ, "LRA_KERNEL_WIDTH": width, "LRA_KERNEL_CACHE": str(tmp_path / "kernels"),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@needs_kernels
def test_the_built_width_follows_the_machine() -> None:
    if os.environ.get("LRA_KERNEL_WIDTH") in ("8", "16"):
        assert native.vector_width("grouped_cpu") == int(os.environ["LRA_KERNEL_WIDTH"])
    else:
        assert native.vector_width("grouped_cpu") == (16 if has_avx512() else 8)
    assert {native.vector_width(name) for name in ("landmark_cpu", "mita_layer_cpu", "sparse_rows", "block_gate",
                                                   "topk_select", "topk_attention", "ttt_cpu", "dropout_cpu",
                                                   "layer_norm_cpu", "gelu_dropout_cpu")} == {
        native.vector_width("grouped_cpu")}


@needs_kernels
def test_an_unknown_width_is_refused_with_the_widths_there_are(tmp_path: Path) -> None:
    env = width_env(tmp_path, "12")
    code = "from attentions.ops import native; print(native.load('grouped_cpu'), native.why_not('grouped_cpu'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ("None LRA_KERNEL_WIDTH='12' is not a width the kernels build at: use 8, 16, "
                                  "portable or native")


def passes_the_kernel_tests(tmp_path: Path, form: str, width: str) -> None:
    """The libraries built as LRA_KERNEL_WIDTH=form are ``width`` floats wide and pass KERNEL_TESTS."""
    env = width_env(tmp_path, form)
    built = subprocess.run([sys.executable, "-c", "from attentions.ops import native; "
                            "print(native.vector_width('grouped_cpu'))"], env=env, capture_output=True, text=True,
                           cwd=ROOT, check=True)
    assert built.stdout.strip() == width
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@needs_kernels
def test_the_other_width_passes_the_kernel_tests(tmp_path: Path) -> None:
    passes_the_kernel_tests(tmp_path, other_width(), other_width())


@needs_kernels
def test_the_portable_form_passes_the_kernel_tests(tmp_path: Path) -> None:
    passes_the_kernel_tests(tmp_path, "portable", "8")


def test_x86_builds_ask_for_the_full_width_in_plain_loops_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # the compilers' default preference on x86 is 8-float vectors for the loops they vectorise themselves
    monkeypatch.delenv("LRA_KERNEL_WIDTH", raising=False)
    x86 = native.platform.machine().lower() in ("x86_64", "amd64")
    assert ("-mprefer-vector-width=512" in native.width_flags()) == x86
    monkeypatch.setenv("LRA_KERNEL_WIDTH", "8")
    assert native.width_flags() == ["-DLRA_NARROW"]
    monkeypatch.setenv("LRA_KERNEL_WIDTH", "16")
    assert native.width_flags()[0] == "-DLRA_WIDE"
    monkeypatch.setenv("LRA_KERNEL_WIDTH", "portable")
    assert native.width_flags() == ["-DLRA_PORTABLE"]
