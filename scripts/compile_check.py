"""Compile the Triton grouped-attention kernels for a GPU without one (ahead of time, sm_90 by default).

Triton's interpreter runs the kernels on the CPU but cannot see what only the GPU compiler does:
typing and layout errors, shared memory past the device's limit, registers spilling to local memory.
This compiles each kernel with the sizes the autograd Function would launch (launch_meta) and
reports its shared memory, registers and spill stack (read from the cubin with Triton's cuobjdump).

    python scripts/compile_check.py                    # bf16 and float32, D = 32, 64, 128
    python scripts/compile_check.py --dtype bf16 --head-dim 64 --arch 90

Needs Triton with its NVIDIA backend (ptxas ships in the wheel); no GPU and no CUDA driver.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the kernels compiled, not interpreted (Triton reads this when it is first imported)
os.environ["TRITON_INTERPRET"] = "0"

from attentions.ops.grouped.triton_op import kernels, launch_meta  # noqa: E402

KERNEL_NAMES = ("grouped_forward", "grouped_backward_dq", "grouped_backward_dkdv")
# sm_90 (H100, H200): most shared memory one block may use, in bytes
MAX_SHARED = {90: 232448, 80: 166912}
DTYPES = {"float32": "fp32", "bf16": "bf16", "float16": "fp16"}


def signature(arg_names: List[str], dtype: str, constexprs: Dict[str, object]) -> Dict[str, str]:
    """Triton's type string of each argument, from the kernels' naming: *_ptr tables in ``dtype``,
    masks uint8, lse, offset and the shared partial gradients float32, the layout int64."""
    types = {}
    for name in arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("lse_ptr", "offset_ptr") or name.startswith("d_shared"):
            types[name] = "*fp32"
        elif name.endswith("ok_ptr"):
            types[name] = "*u8"
        elif name in ("order_ptr", "offsets_ptr") or name.startswith("item_"):
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = f"*{dtype}"
        else:
            types[name] = "fp32" if name == "scale" else "i32"
    return types


def resources(cubin: bytes) -> Dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the one function in a cubin, from cuobjdump --dump-resource-usage."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((row for row in text.splitlines() if "REG:" in row), "")
    return {k: int(v) for k, v in (item.split(":") for item in line.split() if item.split(":")[0] in ("REG", "STACK"))}


def compile_kernels(dtype: str, head_dim: int, keys: int = 64, block_q: int = 64, arch: int = 90) -> List[Dict[str, object]]:
    """Compile the three kernels (masks and shared table on) for ``arch``; one row per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = kernels()
    meta = launch_meta(head_dim, keys, keys, block_q)
    num_warps = meta.pop("num_warps")
    flags = dict(HAS_KEY_OK=True, HAS_SHARED=True, HAS_SHARED_OK=True, HAS_DLSE=True)
    rows = []
    for name in KERNEL_NAMES:
        fn = getattr(module, name)
        constexprs = {k: v for k, v in {**meta, **flags}.items() if k in fn.arg_names}
        source = ASTSource(
            fn=fn,
            signature=signature(fn.arg_names, DTYPES[dtype], constexprs),
            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        row = {"kernel": name, "dtype": dtype, "head_dim": head_dim, "num_warps": num_warps,
               "shared": compiled.metadata.shared, **resources(compiled.asm["cubin"])}
        row["fits"] = row["shared"] <= MAX_SHARED.get(arch, MAX_SHARED[90])
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,float32", help="comma-separated: bf16, float32, float16")
    parser.add_argument("--head-dim", default="32,64,128", help="comma-separated head dims")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    args = parser.parse_args(argv)
    ok = True
    print("| kernel | dtype | D | warps | shared bytes | registers | spill stack | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype.split(","):
        for d in (int(x) for x in args.head_dim.split(",")):
            for r in compile_kernels(dtype, d, arch=args.arch):
                print(f"| {r['kernel']} | {dtype} | {d} | {r['num_warps']} | {r['shared']} | {r.get('REG', '?')} | "
                      f"{r.get('STACK', '?')} | {'yes' if r['fits'] else 'NO'} |", flush=True)
                ok = ok and r["fits"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
