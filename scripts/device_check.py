"""Every backend on an accelerator against the same module on the CPU in float32.

The CPU tests check each backend's fast path against its plain reference; this checks that the
paths an accelerator takes (CUDA kernels, SDPA's fused backends, bf16 autocast as the trainer uses
it) compute the same thing. For each registered backend, with one set of weights:

  fp32    the module on the device in float32 vs on the CPU: outputs and q/k/v gradients
  bf16    the module on the device under bf16 autocast (the trainer's mixed precision) vs the CPU
          float32 result
  padding under bf16 autocast, each padded row's output vs the same sequence run alone

Errors are per query row: |got - ref|_max / |ref|_max over the row. Dense backends must keep every
row within tolerance. Routing backends (top-k, MoBA, MiTA) may pick a different key, block or
expert when rounding reorders two nearly equal scores, so for them the check reports the share of
rows within tolerance and fails when fewer than MIN_AGREEING are or the median row is off.

    python scripts/device_check.py --out results/device-check   # default device: cuda

Backends with a ``kernel`` option (MiTA, MoBA) get one row per kernel, ``mita[torch]`` and
``mita[triton]``, ``mita[cpu]``, each against the CPU float32 result of the PyTorch kernel. On the CPU the Triton
rows run only under Triton's interpreter (TRITON_INTERPRET=1, set before Python starts) and are
skipped otherwise; the ``cpu`` rows (the C kernel) run on the CPU only.

On CUDA with flash-attn installed, full attention's flash-attn varlen path (the one the trainer
takes for padded batches) is checked against float64 masked math at --flash-length; the record says
why it was skipped elsewhere.

``--device cpu`` runs the same comparison on the CPU, which is how the test suite exercises this
script without an accelerator. CPU autocast keeps softmax, exp, sum and the other reductions in
bf16 where CUDA autocast computes them in float32, so on the CPU the check adds CUDA's float32 rule
(CudaAutocastRules): the mixed-dtype mistakes that only CUDA would show (a bf16 tensor scattered
with a float32 softmax, say) fail on the CPU too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attentions import build_attention, get_attention, list_attentions  # noqa: E402
from attentions.ops.grouped import KERNELS  # noqa: E402
from attentions.registry import config_fields  # noqa: E402
from attentions.check import Sizes, padding_mask, real_lengths  # noqa: E402
from lra.machine import hardware, versions  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
# routing backends: share of rows that must agree, and the median row error they must keep (the rest
# picked a different key, block or expert under rounding; measured on the CPU at the defaults, N=256:
# 90% of top-k rows and 95% of MiTA's outputs agree in bf16, 81% of MiTA's k/v gradient rows)
MIN_AGREEING = 0.75
MAX_MEDIAN = {"fp32": 1e-5, "bf16": 2e-2}


# ops that CUDA autocast runs in float32 (torch.amp docs, "CUDA Ops that can autocast to float32")
CUDA_FP32_OPS = {
    "softmax", "log_softmax", "softmin", "exp", "expm1", "log", "log1p", "sum", "prod", "cumsum", "cumprod",
    "pow", "__pow__", "norm", "normalize", "layer_norm", "group_norm", "rsqrt", "reciprocal", "softplus",
    "cross_entropy", "nll_loss",
}


class CudaAutocastRules(TorchFunctionMode):
    """On the CPU under bf16 autocast: give the ops CUDA autocast runs in float32 float32 results."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # as CUDA autocast: only where autocast is on (a region may turn it off)
        if not torch.is_autocast_enabled("cpu"):
            return out
        if getattr(func, "__name__", "") in CUDA_FP32_OPS and isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16:
            return out.float()
        return out


def row_errors(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per-row relative error over the real rows: the row's largest deviation over the larger of its own
    scale and the median row's (a row far smaller than the others, such as the last token's value
    gradient under a causal mechanism, moves by bf16 rounding of the inputs as much as a typical row
    does). [B, H, N, D] x 2, rows [B, N] -> [R]."""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    diff = (got - ref).abs().amax(dim=-1)  # [B, H, N]
    own = ref.abs().amax(dim=-1)  # [B, H, N]
    scale = torch.maximum(own, own.transpose(1, 2)[rows].median()).clamp_min(1e-6)  # [B, H, N]
    err = diff / scale
    err[~torch.isfinite(got).all(dim=-1)] = float("inf")  # never within tolerance
    return err.transpose(1, 2)[rows].flatten()  # [R*H]


def run(attn: torch.nn.Module, qkv: List[torch.Tensor], mask: Optional[torch.Tensor], device: torch.device,
        autocast: bool) -> Dict[str, torch.Tensor]:
    """Output and q/k/v gradients of sum(out * w) for a fixed random w, on ``device``.

    Under autocast q, k, v arrive in bf16, as the model's projections give them in training."""
    dtype = torch.bfloat16 if autocast else torch.float32
    q, k, v = (x.detach().to(device, dtype).requires_grad_() for x in qkv)
    m = None if mask is None else mask.to(device)
    rules = CudaAutocastRules() if autocast and device.type == "cpu" else contextlib.nullcontext()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), rules:
        out = attn(q, k, v, m)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (out.float() * w).sum().backward()
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def verdict(name: str, errs: Dict[str, torch.Tensor], tol: float, max_median: float) -> Dict[str, object]:
    """PASS/FAIL from per-row errors: every row for dense backends, MIN_AGREEING for routing ones."""
    summary: Dict[str, object] = {}
    ok = True
    for key, err in errs.items():
        agreeing = float((err <= tol).float().mean())
        summary[key] = {"max_row_err": float(err.max()), "median_row_err": float(err.median()), "agreeing": agreeing}
        if get_attention(name).routes():
            ok = ok and agreeing >= MIN_AGREEING and float(err.median()) <= max_median
        else:
            ok = ok and agreeing == 1.0
    summary["status"] = "PASS" if ok else "FAIL"
    return summary


def rows_to_check(names: List[str], kernels: List[str]) -> List[Dict[str, Optional[str]]]:
    """One row per backend, or per (backend, kernel) for a backend with a ``kernel`` option."""
    rows = []
    for name in names:
        if "kernel" in config_fields(name):
            rows += [{"backend": name, "kernel": k, "row": f"{name}[{k}]"} for k in kernels]
        else:
            rows.append({"backend": name, "kernel": None, "row": name})
    return rows


def skip_reason(kernel: Optional[str], device: torch.device) -> Optional[str]:
    """Why a row cannot run here, or None."""
    if kernel == "cpu":
        from attentions.ops.grouped import cpu as grouped_cpu

        if device.type != "cpu":
            return "the C kernel runs on CPU tensors"
        reasons = grouped_cpu.refusals(torch.empty(0))
        return f"C kernel not built: {reasons[0]}" if reasons else None
    if kernel != "triton":
        return None
    from attentions.ops.grouped.triton_op import interpreting, triton_installed

    if not triton_installed():
        return "Triton not installed (pip install triton)"
    if device.type != "cuda" and not interpreting():
        return "Triton on the CPU needs TRITON_INTERPRET=1"
    return None


def check_backend(name: str, device: torch.device, n: int, seed: int, kernel: Optional[str] = None) -> Dict[str, object]:
    b, h, d = 3, 2, 32
    # the CPU float32 reference runs the PyTorch kernel; the module checked runs the row's kernel,
    # with the same weights (same seed)
    options = {} if kernel is None else {"kernel": kernel}
    torch.manual_seed(seed)
    cpu_attn = build_attention(name, num_heads=h, head_dim=d, max_len=n, **({} if kernel is None else {"kernel": "torch"}))
    torch.manual_seed(seed)
    dev_attn = build_attention(name, num_heads=h, head_dim=d, max_len=n, **options).to(device)
    cpu_attn.eval(), dev_attn.eval()
    sizes = Sizes(batch=b, heads=h, length=n, head_dim=d)
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(b, h, n, d, generator=gen) for _ in range(3)]
    supports_mask = get_attention(name).supports_mask
    # the contract battery's padded batch: a full row, one a little under half, one very short
    lengths = real_lengths(sizes)
    mask = padding_mask(sizes) if supports_mask else None
    rows = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    ref = run(cpu_attn, qkv, mask, torch.device("cpu"), autocast=False)
    result: Dict[str, object] = {"backend": name if kernel is None else f"{name}[{kernel}]", "masked": supports_mask}
    if kernel is not None:
        result["kernel"] = kernel
    outs = {}
    for label, autocast in (("fp32", False), ("bf16", True)):
        got = run(dev_attn, qkv, mask, device, autocast)
        outs[label] = got["out"]
        errs = {"out": row_errors(got["out"], ref["out"], rows)}
        for g in ("dq", "dk", "dv"):
            # gradient rows: every real position of q / k / v
            errs[g] = row_errors(got[g], ref[g], rows)
        result[label] = verdict(name, errs, TOLERANCE[label], MAX_MEDIAN[label])
    if supports_mask:
        # each padded row alone, unpadded, on the device under autocast: the padding must not leak
        padded = outs["bf16"]
        worst = 0.0
        for i, length in enumerate(lengths[1:], start=1):
            alone = [x[i : i + 1, :, :length] for x in qkv]
            out = run(dev_attn, alone, None, device, autocast=True)["out"]
            err = row_errors(padded[i : i + 1, :, :length], out, torch.ones(1, length, dtype=torch.bool))
            worst = max(worst, float(err.median()) if get_attention(name).routes() else float(err.max()))
        result["padding"] = {"worst_row_err": worst, "status": "PASS" if worst <= TOLERANCE["bf16"] else "FAIL"}
    return result


def sdpa_flash_check(device: torch.device, n: int) -> Dict[str, object]:
    """The benchmarks' FlashAttention baseline (full attention, flash=True: flash-attn, else SDPA
    restricted to its flash kernel) in bf16 vs float64 math."""
    from attentions.backends.full import reference

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 32, generator=gen) for _ in range(3))
    flash = build_attention("full", num_heads=4, head_dim=32, max_len=n, flash=True)
    out = flash(*(x.to(device, torch.bfloat16) for x in (q, k, v)))
    ref = reference(q.double(), k.double(), v.double()).float()
    err = row_errors(out, ref, torch.ones(1, n, dtype=torch.bool))
    return {"kernel": flash.implementation(flash.cfg, device), "length": n, "max_row_err": float(err.max()),
            "status": "PASS" if float(err.max()) <= TOLERANCE["bf16"] else "FAIL"}


def flash_varlen_check(device: torch.device, n: int) -> Dict[str, object]:
    """Full attention's flash-attn varlen path (a padded batch unpadded into one packed sequence, as
    the trainer runs ``full`` on a GPU when flash-attn is installed) in bf16 vs float64 masked
    math: outputs and q/k/v gradients of every real row. Skipped, with why, where it cannot run."""
    from attentions.backends import full

    if full.flash_attn_varlen_func is None:
        return {"status": "SKIP", "why": "flash-attn is not installed (pip install flash-attn)"}
    if device.type != "cuda":
        return {"status": "SKIP", "why": "flash-attn runs on CUDA only"}
    sizes = Sizes(batch=3, heads=4, length=n, head_dim=32)
    mask = padding_mask(sizes)
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(3, 4, n, 32, generator=gen, dtype=torch.float64) for _ in range(3)]
    w = torch.randn(3, 4, n, 32, generator=gen, dtype=torch.float64) * mask[:, None, :, None]
    got_in = [x.to(device, torch.bfloat16).requires_grad_() for x in qkv]
    got = full.flash_varlen(*got_in, mask.to(device))
    (got.float() * w.to(device).float()).sum().backward()
    ref_in = [x.clone().requires_grad_() for x in qkv]
    ref = full.reference(*ref_in, mask)
    (ref * w).sum().backward()
    errs = {"out": row_errors(got, ref, mask)}
    for name, g, r in zip(("dq", "dk", "dv"), got_in, ref_in):
        errs[name] = row_errors(g.grad, r.grad, mask)
    worst = {name: float(e.max()) for name, e in errs.items()}
    import flash_attn

    return {"kernel": f"flash-attn {flash_attn.__version__} varlen", "length": n, "real_lengths": real_lengths(sizes),
            "max_row_err": worst, "status": "PASS" if max(worst.values()) <= TOLERANCE["bf16"] else "FAIL"}


def table(results: List[Dict[str, object]]) -> str:
    lines = ["| backend | fp32 out / grads max row err | bf16 out max row err | bf16 rows agreeing (out) | padding | status |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['backend']} | error: {r['error']} | | | | FAIL |")
            continue
        if "skipped" in r:
            lines.append(f"| {r['backend']} | skipped: {r['skipped']} | | | | SKIP |")
            continue
        fp32, bf16 = r["fp32"], r["bf16"]
        grads = max(fp32[g]["max_row_err"] for g in ("dq", "dk", "dv"))
        status = "PASS" if all(x.get("status", "PASS") == "PASS" for x in (fp32, bf16, r.get("padding", {}))) else "FAIL"
        pad = r.get("padding", {}).get("worst_row_err")
        lines.append(
            f"| {r['backend']} | {fp32['out']['max_row_err']:.1e} / {grads:.1e} | {bf16['out']['max_row_err']:.1e} | "
            f"{bf16['out']['agreeing']:.1%} | {'n/a' if pad is None else f'{pad:.1e}'} | {status} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="device to check (default cuda)")
    parser.add_argument("--length", type=int, default=256, help="sequence length of the comparison (default 256)")
    parser.add_argument("--flash-length", type=int, default=4096, help="length of the flash-kernel checks on CUDA: SDPA flash, flash-attn varlen (default 4096)")
    parser.add_argument("--attn", default="", help="comma-separated backends (default: every registered one)")
    parser.add_argument("--kernels", default="torch,triton,cpu",
                        help="kernels of the backends that have a kernel option (default torch,triton,cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for check.json and check.md (default: print only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2
    names = [a for a in args.attn.split(",") if a] or list_attentions()
    unknown = sorted(set(names) - set(list_attentions()))
    if unknown:
        print(f"error: unknown backend(s) {', '.join(unknown)}; valid: {', '.join(list_attentions())}", file=sys.stderr)
        return 2
    kernels = [k for k in args.kernels.split(",") if k]
    if sorted(set(kernels) - set(KERNELS)):
        print(f"error: unknown kernel(s) in {args.kernels!r}; valid: {', '.join(KERNELS)}", file=sys.stderr)
        return 2
    results = []
    # the header, then each row as its check ends: the table is printed once, as it grows
    print("\n".join(table([]).splitlines()[:2]), flush=True)
    for row in rows_to_check(names, kernels):
        reason = skip_reason(row["kernel"], device)
        if reason is not None:
            results.append({"backend": row["row"], "kernel": row["kernel"], "skipped": reason})
        else:
            try:
                results.append(check_backend(row["backend"], device, args.length, args.seed, row["kernel"]))
            except Exception as err:  # noqa: BLE001 - a backend that crashes is a result, the others still run
                message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                results.append({"backend": row["row"], "error": f"{type(err).__name__}: {message}"})
        print(table(results[-1:]).splitlines()[-1], flush=True)
    flash = sdpa_flash_check(device, args.flash_length) if device.type == "cuda" else None
    varlen = flash_varlen_check(device, args.flash_length)
    record = {"hardware": hardware(device), "versions": versions(), "length": args.length,
              "tolerance": TOLERANCE, "min_agreeing_routing": MIN_AGREEING, "backends": results, "sdpa_flash": flash,
              "flash_varlen": varlen}
    flash_lines = [] if flash is None else [f"SDPA flash kernel ({flash['kernel']}), N={flash['length']}, "
                                            f"bf16 vs float64 math: max row err {flash['max_row_err']:.1e}, {flash['status']}"]
    if varlen["status"] == "SKIP":
        flash_lines.append(f"flash-attn varlen (full attention, padded batch): skipped: {varlen['why']}")
    else:
        flash_lines.append(f"{varlen['kernel']} (full attention, padded batch, real lengths {varlen['real_lengths']}), "
                           f"bf16 vs float64 math: max row err out {varlen['max_row_err']['out']:.1e}, grads "
                           f"{max(varlen['max_row_err'][g] for g in ('dq', 'dk', 'dv')):.1e}, {varlen['status']}")
    md = table(results) + "".join(f"\n\n{line}" for line in flash_lines)
    print("".join(f"\n{line}" for line in flash_lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "check.json").write_text(json.dumps(record, indent=1))
        (out / "check.md").write_text(md + "\n")
    failed = [r["backend"] for r in results if "error" in r or "FAIL" in json.dumps(r)]
    return 1 if failed or (flash is not None and flash["status"] == "FAIL") or varlen["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
