"""The contract battery for one registered backend, as library code (``lra-check-attn`` prints it).

Each check answers PASS, FAIL with the reason, or SKIP (a mask check on a backend that declares
``supports_mask = False``). Sizes are small (B=3, H=2, N=64, D=16), the seed fixed, and the checks
run in float64 when the backend runs in it (float32 otherwise), with relative tolerance 1e-9
(float64) or 1e-5 (float32). The padded batch holds one full row and two shorter ones. The tests
run the same checks on the built-in backends, some with options other than their defaults.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .base import SCALING_STRATEGIES, Attention, Taxonomy
from .registry import build_attention, get_attention

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NO_MASK = "not supported (supports_mask=False; the builder refuses padded tasks)"


class CheckFailed(Exception):
    """A broken contract; the message says what was seen and what the contract asks for."""


@dataclass(frozen=True)
class Sizes:
    batch: int = 3
    heads: int = 2
    length: int = 64
    head_dim: int = 16


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.check}: {self.status}" + (f": {self.detail}" if self.detail else "")


@dataclass
class Report:
    """Every check's result for one backend, and the dtype the checks ran in."""

    name: str
    dtype: str
    dtype_note: str = ""
    results: List[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.status != FAIL for r in self.results)


def real_lengths(sizes: Sizes) -> List[int]:
    """Real lengths of the padded batch: a full row, one a little under half, one very short."""
    n = sizes.length
    pattern = [n, max(1, 29 * n // 64), max(1, 7 * n // 64)]
    return [pattern[b % 3] for b in range(sizes.batch)]


def padding_mask(sizes: Sizes) -> torch.Tensor:
    lengths = torch.tensor(real_lengths(sizes))
    return torch.arange(sizes.length)[None, :] < lengths[:, None]  # [B, N]


def make_qkv(sizes: Sizes, dtype: torch.dtype, seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (sizes.batch, sizes.heads, sizes.length, sizes.head_dim)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|; infinite when ``got`` is not finite."""
    got, ref = got.detach(), ref.detach()
    if not bool(got.isfinite().all()):
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def describe(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def output_problem(
    out: object, q: torch.Tensor, mask: Optional[torch.Tensor] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None, finite: bool = True,
) -> str:
    """What in ``out``, a backend's output for ``q`` [B, H, N, D] and ``mask`` [B, N], breaks the contract
    ("" when nothing does): not a tensor, another shape, a dtype not in ``dtypes`` (default: q's), or
    (when ``finite``) a non-finite value. The battery below and lra-run's first call both ask it."""
    if not isinstance(out, torch.Tensor):
        return f"forward returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != tuple(q.shape):
        return f"output shape {tuple(out.shape)}, expected [B, H, N, D] = {tuple(q.shape)}"
    if out.dtype not in (dtypes or (q.dtype,)):
        return f"output is {dtype_name(out.dtype)}; the output must keep the inputs' dtype ({dtype_name(q.dtype)})"
    if finite and not bool(out.isfinite().all()):
        real = torch.ones_like(out, dtype=torch.bool) if mask is None else mask[:, None, :, None].expand_as(out)
        if not bool(out[real].isfinite().all()):
            return "non-finite output at real positions"
        return "non-finite output at padded rows (they must be finite; zeros are fine)"
    return ""


class Battery:
    """The checks of one backend, built with its defaults or with ``overrides`` of its Config; each
    method raises CheckFailed with the reason. ``build(dtype)`` gives a fresh module with the same
    weights each time."""

    def __init__(self, name: str, sizes: Sizes, seed: int, overrides: Optional[Dict[str, Any]] = None) -> None:
        self.name = name
        self.cls = get_attention(name)
        self.sizes = sizes
        self.seed = seed
        self.overrides = dict(overrides or {})
        self.mask = padding_mask(sizes)
        self.dtype = torch.float32

    def build(self, dtype: torch.dtype) -> Attention:
        torch.manual_seed(self.seed)
        s = self.sizes
        attn = build_attention(self.name, num_heads=s.heads, head_dim=s.head_dim, max_len=s.length, **self.overrides)
        return attn.to(dtype).eval()

    def builds(self) -> str:
        attn = self.build(torch.float32)
        s = self.sizes
        # an option past the battery's length is clamped, and the checks run on the clamped backend
        return "; ".join([f"num_heads={s.heads}, head_dim={s.head_dim}, max_len={s.length}", *attn.notices])

    def pick_dtype(self) -> str:
        """Use float64 when a forward runs in it; return why not otherwise."""
        try:
            self.build(torch.float64)(*make_qkv(self.sizes, torch.float64, self.seed))
        except Exception as err:
            return f"float64 not supported ({describe(err)}); checked in float32"
        self.dtype = torch.float64
        return ""

    def shapes_and_dtype(self) -> str:
        s = self.sizes
        masks = [None, self.mask] if self.cls.supports_mask else [None]
        dtypes = sorted({torch.float32, self.dtype}, key=str)
        for dtype in dtypes:
            for mask in masks:
                q, k, v = make_qkv(s, dtype, self.seed)
                problem = output_problem(self.build(dtype)(q, k, v, mask), q, mask, finite=False)
                if problem:
                    case = f"{dtype_name(dtype)} inputs {'with' if mask is not None else 'without'} a mask"
                    raise CheckFailed(f"{case}: {problem}")
        masks_text = "with and without a mask" if len(masks) == 2 else "without a mask"
        return f"{' and '.join(dtype_name(d) for d in dtypes)}, {masks_text}"

    def finite(self) -> str:
        attn = self.build(self.dtype)
        q, k, v = (x.requires_grad_() for x in make_qkv(self.sizes, self.dtype, self.seed))
        mask = self.mask if self.cls.supports_mask else None
        out = attn(q, k, v, mask)
        problem = output_problem(out, q, mask)
        if problem:
            raise CheckFailed(problem)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(self.seed + 1), dtype=torch.float64)
        (out * weight.to(out.dtype)).sum().backward()
        if v.grad is None:
            raise CheckFailed("no gradient reached v; the output must be computed from v")
        for label, tensor in [("q", q), ("k", k), ("v", v)] + list(attn.named_parameters()):
            if tensor.grad is not None and not bool(tensor.grad.isfinite().all()):
                raise CheckFailed(f"non-finite gradient of {label}")
        return "padded batch" if mask is not None else "without a mask (supports_mask=False)"

    def padding_invariance(self) -> str:
        attn = self.build(self.dtype)
        qkv = make_qkv(self.sizes, self.dtype, self.seed)
        noise = make_qkv(self.sizes, self.dtype, self.seed + 2)
        real = self.mask[:, None, :, None]  # [B, 1, N, 1]
        base = attn(*qkv, self.mask)
        changes = []
        for index, label in [(1, "keys"), (2, "values"), (0, "queries")]:
            moved = list(qkv)
            moved[index] = torch.where(real, qkv[index], 10 * noise[index])
            err = rel_err(attn(*moved, self.mask) * real, base * real)
            if err > TOLERANCE[self.dtype]:
                changes.append((label, err))
        if changes:
            what = ", ".join(f"by {err:.2g} when padded {label} changed" for label, err in changes)
            hint = (
                "the backend seems to ignore the mask"
                if any(label != "queries" for label, _ in changes)
                else "real outputs must not depend on padded queries (pool or route over real tokens only)"
            )
            raise CheckFailed(f"output at real positions changed {what}; {hint}")
        return "padded queries, keys and values replaced by large noise"

    def padding_gradient(self) -> str:
        attn = self.build(self.dtype)
        q, k, v = (x.requires_grad_() for x in make_qkv(self.sizes, self.dtype, self.seed))
        real = self.mask[:, None, :, None]  # [B, 1, N, 1]
        out = attn(q, k, v, self.mask)
        # a random loss over the real outputs only: the contract leaves padded rows' outputs free
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(self.seed + 3), dtype=torch.float64)
        grads = torch.autograd.grad((out * weight.to(out.dtype) * real).sum(), (q, k, v), allow_unused=True)
        leaks = []
        for label, grad in zip(("queries", "keys", "values"), grads):
            if grad is None:
                continue
            leaked = float(torch.where(real, 0.0, grad).abs().max() / grad.abs().max().clamp_min(1e-30))
            # a non-finite gradient at padding counts as a leak
            if not leaked <= TOLERANCE[self.dtype]:
                leaks.append((label, leaked))
        if leaks:
            what = ", ".join(f"padded {label} ({leaked:.2g} of the largest gradient)" for label, leaked in leaks)
            raise CheckFailed(f"the real outputs send gradient to {what}; padded positions must take no part in "
                              "computing them, not even through a term worth zero")
        return "the real outputs send none to padded queries, keys or values"

    def padded_vs_alone(self) -> str:
        attn = self.build(self.dtype)
        q, k, v = make_qkv(self.sizes, self.dtype, self.seed)
        out = attn(q, k, v, self.mask)
        n = self.sizes.length
        worst: Tuple[float, int, int] = (0.0, 0, n)
        for b, length in enumerate(real_lengths(self.sizes)):
            alone = attn(q[b : b + 1, :, :length], k[b : b + 1, :, :length], v[b : b + 1, :, :length])
            worst = max(worst, (rel_err(out[b : b + 1, :, :length], alone), b, length))
        err, b, length = worst
        if err > TOLERANCE[self.dtype]:
            raise CheckFailed(
                f"row {b} ({length} real tokens of {n}) differs from the same sequence run alone without a mask "
                f"by {err:.2g} (relative; tolerance {TOLERANCE[self.dtype]:g})"
            )
        return f"lengths {', '.join(map(str, real_lengths(self.sizes)))} of {n}"

    def taxonomy(self) -> str:
        tax = getattr(self.cls, "taxonomy", None)
        if not isinstance(tax, Taxonomy):
            raise CheckFailed(
                "taxonomy must be an attentions.Taxonomy(scaling, expert_count, expert_type, construction, routing)"
            )
        if tax.scaling not in SCALING_STRATEGIES:
            raise CheckFailed(f"taxonomy scaling {tax.scaling!r} is not one of {', '.join(SCALING_STRATEGIES)}")
        for f in dataclasses.fields(tax):
            value = getattr(tax, f.name)
            if not isinstance(value, str) or not value.strip():
                raise CheckFailed(f"taxonomy.{f.name} must be a non-empty string, got {value!r}")
        return f"scaling={tax.scaling}"

    def paper_and_cost(self) -> str:
        for attr, example in [("paper", '"Author et al. YEAR, Title"'), ("cost", '"O(N^2 D)"')]:
            value = getattr(self.cls, attr, "")
            if not isinstance(value, str) or not value.strip():
                raise CheckFailed(f"{attr} is empty; set it on the class, e.g. {attr} = {example}")
        return self.cls.cost

    def budget(self) -> str:
        text = self.build(torch.float32).budget()
        if not isinstance(text, str) or not text.strip():
            raise CheckFailed(f"budget() must return a short text such as \"k = 64\", got {text!r}")
        return repr(text)


def run_check(check: str, body: Callable[[], str]) -> CheckResult:
    """PASS with ``body``'s note, or FAIL with the broken contract or the exception the backend raised."""
    try:
        return CheckResult(check, PASS, body())
    except CheckFailed as err:
        return CheckResult(check, FAIL, str(err))
    except Exception as err:
        return CheckResult(check, FAIL, f"raised {describe(err)}")


def check_backend(name: str, sizes: Optional[Sizes] = None, seed: int = 0,
                  overrides: Optional[Dict[str, Any]] = None) -> Report:
    """Run the whole battery on backend ``name`` built with ``overrides`` (its own hyperparameters);
    the caller's random state is left unchanged."""
    sizes = sizes or Sizes()
    battery = Battery(name, sizes, seed, overrides)
    with torch.random.fork_rng(devices=[]):
        built = run_check("builds with its defaults" if not overrides else "builds with these options", battery.builds)
        report = Report(name, dtype_name(torch.float32), results=[built])
        # (check, body, needs a padding mask)
        module_checks = [
            ("shapes and dtype kept", battery.shapes_and_dtype, False),
            ("forward and backward finite", battery.finite, False),
            ("padding invariance", battery.padding_invariance, True),
            ("padding gets no gradient", battery.padding_gradient, True),
            ("padded batch vs unpadded runs", battery.padded_vs_alone, True),
            ("budget", battery.budget, False),
        ]
        if built.status == PASS:
            report.dtype_note = battery.pick_dtype()
            report.dtype = dtype_name(battery.dtype)
        for check, body, needs_mask in module_checks:
            if built.status != PASS:
                report.results.append(CheckResult(check, SKIP, "the backend could not be built"))
            elif needs_mask and not battery.cls.supports_mask:
                report.results.append(CheckResult(check, SKIP, NO_MASK))
            else:
                report.results.append(run_check(check, body))
        report.results.append(run_check("taxonomy", battery.taxonomy))
        report.results.append(run_check("paper and cost", battery.paper_and_cost))
    return report
