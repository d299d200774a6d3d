"""Compiled C kernels for the CPU: built from the .c files of attentions/csrc/ (the attention
operators and the LRA model's dropout) with the system C compiler on first use, cached per source,
compiler flags and CPU, and loaded with ctypes. The operators of ``attentions.ops`` call them inside their torch.library implementations.

No Python build step and no torch headers: ``cc -O3 -march=native -fopenmp -shared`` takes about a second.
A machine without a C compiler (or where the build fails) simply has no native kernels:
``load`` returns None and says why in ``why_not``; ``refusals`` turns that into the reason an
operator's C form is not taken, and the operators then run their PyTorch form.
LRA_KERNEL_CACHE sets the cache folder (default ~/.cache/lra-suite/kernels).

The kernels' vectors are as wide as the CPU (csrc/vec.h: 16 floats with AVX-512, else 8; on x86 the
compiler's own vectorised loops too, ``NATIVE``);
LRA_KERNEL_WIDTH=8 builds the 8-float form on any machine and LRA_KERNEL_WIDTH=16 the 16-float form
(each cached apart), so that both widths are tested on every machine (and both timed on one with
AVX-512); ``vector_width`` says which width a library was built with.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import AttentionError

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
# -march=native: the library is built on, and cached for, the CPU that runs it; -fopenmp: the
# kernels' threads come from the OpenMP runtime torch has loaded (libgomp.so.1 on Linux wheels), so
# they do not fight torch's own spinning worker threads for the cores
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# tried in turn: a compiler that refuses -march=native (some ARM clang builds) or has no OpenMP
# (Apple clang) still builds the kernels, single-threaded without OpenMP
FALLBACK_FLAGS = [
    [f for f in FLAGS if f != "-march=native"],
    [f for f in FLAGS if f not in ("-march=native", "-fopenmp")],
]

# x86 compilers vectorise plain loops (the kernels' e^x and scaling loops) 8 floats wide even where
# AVX-512 is there, their default preference; the native width asks for the full width in those loops
# too (3-7% off MiTA's layer forward + backward at 1K-4K on an AVX-512 Xeon, 20% at 64K, one thread;
# no effect without AVX-512). The flag is x86's own.
NATIVE = ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
# LRA_KERNEL_WIDTH: "native" (or unset) builds the machine's width, "8" the 8-float form (whose plain
# loops keep the compiler's 8-float preference, as on an AVX2 machine), "16" the 16-float form on any
# machine (each 16-float operation as two or four of the machine's own: for the tests, not for speed;
# -Wno-psabi: GCC notes that 64-byte vectors pass differently without AVX-512, which no caller sees),
# "portable" the 8-float form without any x86 intrinsic, the code ARM builds (csrc/vec.h)
WIDTHS = {"": NATIVE, "native": NATIVE, "8": ["-DLRA_NARROW"], "16": ["-DLRA_WIDE", "-Wno-psabi"],
          "portable": ["-DLRA_PORTABLE"]}

# a source's own #include of another kernel's source
INCLUDED_SOURCE = re.compile(r'^#include "([\w.-]+\.c)"', re.M)

_loaded: Dict[str, Optional[ctypes.CDLL]] = {}
_why_not: Dict[str, str] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("LRA_KERNEL_CACHE") or Path.home() / ".cache" / "lra-suite" / "kernels")


def compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc"))


def cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags (Linux), else the platform."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def width_flags() -> Optional[List[str]]:
    """The compiler flags LRA_KERNEL_WIDTH asks for; None for a value it does not take."""
    return WIDTHS.get(os.environ.get("LRA_KERNEL_WIDTH", "").strip())


def _build(source: Path, cc: str, target: Path, extra: List[str]) -> str:
    """Compile ``source`` into ``target`` (atomically: a temporary file renamed); '' or the error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    errors: List[str] = []
    for flags in (FLAGS, *FALLBACK_FLAGS):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, *extra, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
                return ""
            errors.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return "; ".join(errors)


def included(source: Path) -> List[Path]:
    """The files ``source`` may include: every header beside it, and the sources it names in an
    ``#include "<name>.c"`` line (a library compiled from other kernels' sources in one unit)."""
    sources = sorted({source.parent / name for name in INCLUDED_SOURCE.findall(source.read_text())})
    return [*sorted(source.parent.glob("*.h")), *sources]


def load(name: str) -> Optional[ctypes.CDLL]:
    """The library built from ``<name>.c`` in SOURCES, or None when it cannot be built here."""
    if name in _loaded:
        return _loaded[name]
    folder = SOURCES
    source = folder / f"{name}.c"
    cc = compiler()
    lib = None
    extra = width_flags()
    if cc is None:
        _why_not[name] = f"no C compiler found ({os.environ.get('CC', 'cc')!r} is not on PATH; set CC)"
    elif extra is None:
        _why_not[name] = (f"LRA_KERNEL_WIDTH={os.environ['LRA_KERNEL_WIDTH']!r} is not a width the kernels "
                          f"build at: use 8, 16, portable or native")
    else:
        try:
            # the source, the headers and sources it may include, the compiler, the flags and the CPU
            text = b"".join(path.read_bytes() for path in [source, *included(source)])
            key = hashlib.sha256(text + " ".join([cc, *FLAGS, *extra, cpu_identity()]).encode()).hexdigest()[:16]
            target = cache_dir() / f"{name}-{key}.so"
            error = "" if target.exists() else _build(source, cc, target, extra)
            if error:
                _why_not[name] = f"building {source.name} with {cc} failed: {error}"
            else:
                lib = ctypes.CDLL(str(target))
        except OSError as err:
            _why_not[name] = f"building or loading {source.name} failed: {err}"
    _loaded[name] = lib
    return lib


# a library's functions: name -> (argument types, result type) as ctypes takes them
Signatures = Dict[str, Tuple[List[Any], Any]]


def typed(name: str, signatures: Signatures) -> Optional[ctypes.CDLL]:
    """``load(name)`` with the argument and result types of its functions set from ``signatures``
    (once per loaded library); None when it cannot be built here."""
    lib = load(name)
    if lib is not None and getattr(lib, "_signatures", None) is not signatures:
        for fn, (args, result) in signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, result
        lib._signatures = signatures
    return lib


def vector_width(name: str) -> Optional[int]:
    """Floats per vector in the library of ``<name>.c`` (16 or 8), or None when it is not built here."""
    lib = load(name)
    if lib is None or not hasattr(lib, "lra_vector_width"):
        return None
    lib.lra_vector_width.restype = ctypes.c_int
    return int(lib.lra_vector_width())


def why_not(name: str) -> str:
    """Why ``load(name)`` gave None ('' when it loaded or was not tried)."""
    return _why_not.get(name, "")


@torch.compiler.assume_constant_result
def built(name: str) -> bool:
    """Whether the library of ``<name>.c`` builds and loads here (built on the first call; a constant of
    the process, so torch.compile evaluates it once instead of tracing the build)."""
    return load(name) is not None


def refusals(x: torch.Tensor, name: str, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> List[str]:
    """Why the C kernel ``name`` does not take tensors like ``x``, one reason a line (as xformers'
    ``not_supported_reasons``); [] when it does. The device and dtype are checked first, so a GPU
    run never builds the kernel."""
    reasons = []
    if x.device.type != "cpu":
        reasons.append(f"{name} runs on CPU tensors, these are on {x.device.type}")
    if x.dtype not in dtypes:
        reasons.append(f"{name} takes {', '.join(str(d).replace('torch.', '') for d in dtypes)}, "
                       f"not {str(x.dtype).replace('torch.', '')}")
    if not reasons and not built(name):
        reasons.append(why_not(name))
    return reasons


def check_buildable(name: str, backend: str) -> None:
    """For a backend set to ``kernel='cpu'``: raise an AttentionError saying why the C kernel ``name``
    cannot be built here; nothing when it can."""
    # a float32 CPU probe: only the build can refuse it
    reasons = refusals(torch.empty(0), name)
    if reasons:
        raise AttentionError(f"{backend} kernel='cpu' needs the C kernel, which cannot be built here: "
                             f"{reasons[0]}; use kernel='torch'")
