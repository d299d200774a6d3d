"""The Triton grouped-attention kernels (attentions/ops/grouped/triton_op.py) on the CPU under Triton's
interpreter: outputs and gradients against the PyTorch path (ops/grouped/reference.grouped_attention) and, through
MiTA and MoBA with kernel="triton", against their references; the kernel option's errors; and an
ahead-of-time compile for sm_90, which needs no GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from attentions import AttentionError, build_attention
from attentions.backends import mita, moba
from attentions.ops.grouped import dispatch as grouped_dispatch, pick_grouped
from attentions.ops.grouped.reference import grouped_attention
from attentions.ops.grouped.triton_op import grouped_attention_triton, interpreting
from conftest import lengths_mask, rel_err

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not interpreting(),
    reason="needs Triton (pip install triton) and TRITON_INTERPRET=1 (tests/conftest.py sets it unless told 0)",
)


def routed_pairs(p: int, x: int, seed: int) -> torch.Tensor:
    """[P] experts in [0, X]: expert 1 empty, expert 3 with one pair, some pairs with no expert (X)."""
    expert = torch.randint(0, x + 1, (p,), generator=torch.Generator().manual_seed(seed))
    expert[expert == 1] = 2
    expert[expert == 3] = 4
    expert[0] = 3
    return expert


# (P pairs, X experts, S keys, D, M shared keys (0: none), group, masked, with_lse)
GROUPED_CASES = {
    "P67-X5-S16-D16-lse": (67, 5, 16, 16, 0, 1, False, True),
    "P67-X5-S16-D16-masked": (67, 5, 16, 16, 0, 1, True, False),
    "P200-X12-S20-D16-M10-group4-masked-lse": (200, 12, 20, 16, 10, 4, True, True),
    # S and M past one key block (64), D not a power of two
    "P130-X6-S70-D24-M72-group3-lse": (130, 6, 70, 24, 72, 3, False, True),
    "P130-X6-S70-D24-M72-group3-masked": (130, 6, 70, 24, 72, 3, True, False),
    # D below the smallest tile (16)
    "P40-X4-S8-D8-M8-group2-masked-lse": (40, 4, 8, 8, 8, 2, True, True),
    "P1000-X16-S64-D32-M64-group8-lse": (1000, 16, 64, 32, 64, 8, False, True),
    # D and S and M not multiples of 8 (the C kernel's register tiles)
    "P90-X6-S13-D12-M5-group2-masked-lse": (90, 6, 13, 12, 5, 2, True, True),
}


def grouped_inputs(case: tuple, dtype: torch.dtype, seed: int = 0, rounded: bool = False):
    """q, keys, values (and shared keys, values) in ``dtype``, rounded through bf16 first if ``rounded``;
    the experts, the key mask, the shared tuple."""
    p, x, s, d, m, group, masked, _ = case
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen)
        return (x.bfloat16() if rounded else x).to(dtype).requires_grad_()

    tensors = [randn(p, d), randn(x, s, d), randn(x, s, d)]
    key_ok = shared = None
    if masked:
        key_ok = torch.rand(x, s, generator=gen) > 0.3
        # every expert keeps a real key
        key_ok[:, 0] = True
    if m:
        tensors += [randn(x // group, m, d), randn(x // group, m, d)]
        shared_ok = (torch.rand(x // group, m, generator=gen) > 0.3) if masked else None
        shared = (tensors[3], tensors[4], shared_ok, group)
    return tensors, routed_pairs(p, x, seed), key_ok, shared


def run_grouped(fn, case: tuple, dtype: torch.dtype, rounded: bool = False):
    """out, lse and the gradients of a loss that uses both (the lse if the case asks for it), for each input."""
    with_lse = case[-1]
    tensors, expert, key_ok, shared = grouped_inputs(case, dtype, rounded=rounded)
    out, lse = fn(tensors[0], expert, tensors[1], tensors[2], key_ok, 0.3, with_lse, shared)
    gen = torch.Generator().manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
    if with_lse:
        loss = loss + (torch.where(lse.isfinite(), lse, 0).float() * torch.randn(lse.shape, generator=gen)).sum()
    return out, lse, torch.autograd.grad(loss, tensors)


def check_grouped_against_torch_path(fn, case: tuple) -> None:
    """A grouped kernel ``fn`` against the PyTorch path in float32: out, lse and every gradient."""
    out, lse, grads = run_grouped(fn, case, torch.float32)
    ref_out, ref_lse, ref_grads = run_grouped(grouped_attention, case, torch.float32)
    assert rel_err(out, ref_out) < 1e-5
    if case[-1]:
        assert torch.equal(lse.isinf(), ref_lse.isinf())
        assert rel_err(lse.nan_to_num(neginf=0), ref_lse.nan_to_num(neginf=0)) < 1e-5
    for name, g, r in zip(["q", "keys", "values", "shared keys", "shared values"], grads, ref_grads):
        assert rel_err(g, r) < 1e-5, f"d({name}) differs"


@needs_triton
@pytest.mark.parametrize("case", GROUPED_CASES.values(), ids=GROUPED_CASES.keys())
def test_matches_torch_path_float32(case: tuple) -> None:
    check_grouped_against_torch_path(grouped_attention_triton, case)


BF16_CASES = ["P200-X12-S20-D16-M10-group4-masked-lse", "P130-X6-S70-D24-M72-group3-lse"]


@needs_triton
@pytest.mark.parametrize("case", [GROUPED_CASES[c] for c in BF16_CASES], ids=BF16_CASES)
def test_bf16_is_as_close_to_exact_as_the_torch_path(case: tuple) -> None:
    # the kernels accumulate in float32: in bf16 they should be no further from the float64 result
    # (on the same bf16-rounded inputs) than the PyTorch path in bf16
    exact_out, _, exact_grads = run_grouped(grouped_attention, case, torch.float64, rounded=True)
    out, _, grads = run_grouped(grouped_attention_triton, case, torch.bfloat16)
    torch_out, _, torch_grads = run_grouped(grouped_attention, case, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert rel_err(out.double(), exact_out) < max(2 * rel_err(torch_out.double(), exact_out), 1e-2)
    for name, g, t, r in zip(["q", "keys", "values", "shared keys", "shared values"], grads, torch_grads, exact_grads):
        assert rel_err(g.double(), r) < max(2 * rel_err(t.double(), r), 1e-2), f"d({name})"


def check_all_masked_expert(fn) -> None:
    """An expert whose keys are all masked gives its pairs out 0, lse -inf and finite gradients."""
    tensors, expert, key_ok, shared = grouped_inputs(GROUPED_CASES["P67-X5-S16-D16-masked"], torch.float32)
    key_ok[2] = False
    out, lse = fn(tensors[0], expert, tensors[1], tensors[2], key_ok, 0.3, True)
    (out.sum() + lse[lse.isfinite()].sum()).backward()
    assert torch.equal(out[expert == 2], torch.zeros_like(out[expert == 2]))
    assert bool((lse[expert == 2] == float("-inf")).all())
    assert all(bool(t.grad.isfinite().all()) for t in tensors)


@needs_triton
def test_an_expert_with_every_key_masked_gives_zeros_not_nan() -> None:
    check_all_masked_expert(grouped_attention_triton)


# (B, H, N, D, real lengths or None, Config overrides)
MITA_CASES = {
    "B2-N67-H2-D16-m8-k8-masked": (2, 2, 67, 16, [67, 30], {"landmarks": 8, "topk": 8}),
    "B2-N64-H2-D16-m8-k8-E2-masked": (2, 2, 64, 16, [64, 23], {"landmarks": 8, "topk": 8, "experts_per_query": 2}),
    "B2-N50-H2-D16-m8-k8-routed-only-masked": (
        2, 2, 50, 16, [50, 23], {"landmarks": 8, "topk": 8, "shared_expert": False}
    ),
    "B1-N6-H2-D8-m8-k8-fewer-tokens-than-landmarks": (1, 2, 6, 8, None, {"landmarks": 8, "topk": 8}),
    "B1-N300-H2-D32-m16-k64-nomask": (1, 2, 300, 32, None, {"landmarks": 16, "topk": 64}),
}
MOBA_CASES = {
    "B2-N61-H2-D16-bs8-top3-masked": (2, 2, 61, 16, [61, 29], {"block_size": 8, "topk": 3}),
    "B2-N64-H2-D16-bs16-top2-nomask": (2, 2, 64, 16, None, {"block_size": 16, "topk": 2}),
    "B2-N50-H2-D16-bs8-top2-no-own-block-masked": (
        2, 2, 50, 16, [50, 23], {"block_size": 8, "topk": 2, "include_own_block": False}
    ),
    "B1-N200-H2-D32-bs64-top2-defaults": (1, 2, 200, 32, None, {}),
}


def mita_ref(cfg, q, k, v, mask):
    return mita.reference(q, k, v, mask, cfg.landmarks, cfg.topk, cfg.shared_expert, cfg.experts_per_query)


def moba_ref(cfg, q, k, v, mask):
    return moba.reference(q, k, v, mask, cfg.block_size, cfg.topk, cfg.include_own_block)


def outputs_and_grads(name: str, case: tuple, kernel: str, dtype: torch.dtype) -> Dict[str, List[torch.Tensor]]:
    """The backend's output at real rows and d(q, k, v), for kernel "triton" and "torch" and the reference."""
    b, h, n, d, lengths, overrides = case
    torch.manual_seed(0)
    mask = None if lengths is None else lengths_mask(lengths, n)
    attn = build_attention(name, num_heads=h, head_dim=d, max_len=max(n, 64), kernel=kernel, **overrides)
    inputs = [torch.randn(b, h, n, d).to(dtype).requires_grad_() for _ in range(3)]
    # the loss ignores padded rows, whose outputs the contract leaves free
    weight = torch.randn(b, h, n, d) * (1 if mask is None else mask[:, None, :, None])
    ref = {"mita": mita_ref, "moba": moba_ref}[name]
    results = {}
    for label, fn in [(kernel, attn), ("reference", lambda q, k, v, mask: ref(attn.cfg, q, k, v, mask))]:
        out = fn(*inputs, mask).float()
        results[label] = [out * (weight != 0), *torch.autograd.grad((out * weight).sum(), inputs)]
    return results


BACKEND_CASES = [pytest.param("mita", c, id=f"mita-{i}") for i, c in MITA_CASES.items()] + [
    pytest.param("moba", c, id=f"moba-{i}") for i, c in MOBA_CASES.items()
]


def check_backend_kernel(name: str, case: tuple, kernel: str) -> None:
    """The backend on ``kernel`` against its "torch" kernel and its reference: out, dq, dk, dv."""
    run = outputs_and_grads(name, case, kernel, torch.float32)
    torch_run = outputs_and_grads(name, case, "torch", torch.float32)
    for label, got, by_torch, ref in zip(["out", "dq", "dk", "dv"], run[kernel], torch_run["torch"], run["reference"]):
        assert rel_err(got, by_torch) < 1e-5, f"{label}: {kernel} vs torch kernel"
        assert rel_err(got, ref) < 1e-4, f"{label}: {kernel} vs reference"
        assert got.abs().sum() > 0, f"{label} is all zeros"


@needs_triton
@pytest.mark.parametrize("name, case", BACKEND_CASES)
def test_backend_with_triton_kernel_matches_torch_kernel_and_reference(name: str, case: tuple) -> None:
    check_backend_kernel(name, case, "triton")


@needs_triton
@pytest.mark.parametrize("name, case", [
    pytest.param("mita", MITA_CASES["B2-N67-H2-D16-m8-k8-masked"], id="mita-B2-N67-H2-D16-m8-k8-masked-bf16"),
    pytest.param("moba", MOBA_CASES["B2-N61-H2-D16-bs8-top3-masked"], id="moba-B2-N61-H2-D16-bs8-top3-masked-bf16"),
])
def test_backend_in_bf16_matches_torch_kernel(name: str, case: tuple) -> None:
    # same bf16 inputs, so the same routing; the kernels differ only in rounding
    got = outputs_and_grads(name, case, "triton", torch.bfloat16)["triton"]
    ref = outputs_and_grads(name, case, "torch", torch.bfloat16)["torch"]
    for label, g, r in zip(["out", "dq", "dk", "dv"], got, ref):
        assert rel_err(g, r) < 3e-2, label


@needs_triton
@pytest.mark.parametrize("name", ["mita", "moba"])
def test_float32_inputs_under_autocast_match_torch_kernel(name: str) -> None:
    # under autocast some tables (MiTA's shared values) come out of bf16 matmuls while q stays float32
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 16) for _ in range(3))
    mask = lengths_mask([40, 17], 40)
    outs = []
    for kernel in ("triton", "torch"):
        attn = build_attention(name, num_heads=2, head_dim=16, max_len=64, kernel=kernel,
                               **({"landmarks": 8, "topk": 8} if name == "mita" else {"block_size": 8}))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(attn(q, k, v, mask).float())
    real = mask[:, None, :, None].expand_as(outs[0])
    assert rel_err(outs[0][real], outs[1][real]) < 1e-5


@pytest.mark.parametrize("name", ["mita", "moba"])
def test_unknown_kernel_names_the_valid_ones(name: str) -> None:
    with pytest.raises(AttentionError, match=rf"{name} kernel='cuda' is not one of auto, torch, triton, cpu"):
        build_attention(name, num_heads=2, head_dim=16, max_len=64, kernel="cuda")


def test_triton_kernel_without_triton_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grouped_dispatch, "triton_installed", lambda: False)
    with pytest.raises(AttentionError, match="pip install triton"):
        build_attention("mita", num_heads=2, head_dim=16, max_len=64, kernel="triton")
    # the PyTorch kernels need nothing
    build_attention("mita", num_heads=2, head_dim=16, max_len=64, kernel="auto")


@needs_triton
def test_triton_kernel_on_cpu_without_the_interpreter_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    attn = build_attention("moba", num_heads=2, head_dim=16, max_len=64, block_size=16, kernel="triton")
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(AttentionError, match="runs on CUDA tensors.*TRITON_INTERPRET=1"):
        attn(q, q, q)


def test_auto_is_triton_on_cuda_only_and_is_the_yaml_default() -> None:
    from lra.config import resolve

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_grouped("torch", cpu) is grouped_attention and pick_grouped("torch", cuda) is grouped_attention
    assert pick_grouped("auto", cuda) is grouped_attention_triton
    assert pick_grouped("triton", cpu) is grouped_attention_triton
    for name in ("mita", "moba"):
        assert resolve("listops", name).attn_options["kernel"] == "auto"
        assert resolve("listops", name, sets=["attn.kernel=torch"]).attn_options["kernel"] == "torch"


def ptxas_missing() -> Optional[str]:
    """Why the sm_90 compile cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    import triton

    try:
        if Path(triton.knobs.nvidia.ptxas.path).exists():
            return None
    except Exception:  # noqa: BLE001 - any failure to find the tool means no compile
        pass
    return "Triton's NVIDIA backend has no ptxas here"


@pytest.mark.skipif(ptxas_missing() is not None, reason=str(ptxas_missing()))
def test_kernels_compile_for_sm90_in_bf16_at_d32() -> None:
    # typing, layout and shared-memory errors that the interpreter cannot see. Compiled kernels need
    # Triton imported with its interpreter off, so the script runs in its own process; float32
    # (slower to compile) is in a plain `python scripts/compile_check.py`
    script = Path(__file__).resolve().parent.parent / "scripts" / "compile_check.py"
    run = subprocess.run([sys.executable, str(script), "--dtype", "bf16", "--head-dim", "32"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| grouped_")]
    assert len(rows) == 3 and all(row.endswith("| yes |") for row in rows), run.stdout
