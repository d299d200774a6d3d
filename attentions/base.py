"""The attention contract shared by every backend.

A backend is an ``nn.Module`` subclass of :class:`Attention` that mixes values only:

    out = attn(q, k, v, mask=None)
    # q, k, v: [B, H, N, D]   (the layout of torch's scaled_dot_product_attention)
    # mask:    [B, N] bool, True = real token, False = padding; None = no padding
    # out:     [B, H, N, D]; rows at padded positions are finite (zeros are fine)

Each backend declares its hyperparameters as a dataclass (``Config``), its capability flags, the
number of keys one query attends to (``budget``), its cost in N, and where it sits in the MiTA
paper's five-dimensional taxonomy. It also owns the facts the benchmark and the device check need:
whether it routes (``routes``), its FLOP count where one is meaningful (``flops``), whether a slice of
its queries can be timed alone (``independent_queries`` + ``attend``) and which implementation runs
on a device (``implementation``). A timing reference (``timing_only``, the ``none`` backend) is
built and timed like a backend but never trained or listed by default. The registry (``registry.py``) builds backends from names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import nn


class AttentionError(ValueError):
    """A user-facing configuration error: what was wrong and what is valid, in one line."""


SCALING_STRATEGIES = ("routing", "compression", "both", "none")


@dataclass(frozen=True)
class AttnDims:
    """The sizes every backend is built with."""

    num_heads: int
    head_dim: int
    # the longest sequence the backend will see (Linformer sizes its projections with it)
    max_len: int


@dataclass(frozen=True)
class Taxonomy:
    """Where a backend sits in the MiTA paper's taxonomy (Wen et al. 2026, Sec. 3).

    Attention read as a fast-weight MLP: keys are the first layer's weights, values the second's;
    an efficient method changes which "experts" (groups of hidden units) a query reaches.
    """

    # how the method scales to long N: "routing" (sparse choice), "compression", "both", "none"
    scaling: str
    # how many experts there are, e.g. "1", "N/B", "m routed + 1 shared"
    expert_count: str
    # what an expert is made of, e.g. "raw KV", "compressed KV", "kernel state"
    expert_type: str
    # how experts are formed, e.g. "fixed blocks", "top-k by landmark", "learned projection"
    construction: str
    # how queries reach experts, e.g. "dense", "per-query top-k", "per-query argmax"
    routing: str

    def __post_init__(self) -> None:
        if self.scaling not in SCALING_STRATEGIES:
            raise AttentionError(
                f"taxonomy scaling {self.scaling!r} is not one of {', '.join(SCALING_STRATEGIES)}"
            )


@dataclass
class NoConfig:
    """The hyperparameters of a backend that has none."""


class Attention(nn.Module):
    """Base class of every backend. Subclasses set the class attributes and implement forward."""

    # filled in by @register
    name: ClassVar[str] = ""
    # "Author et al. YEAR, Title" of the method's paper
    paper: ClassVar[str] = ""
    # the dataclass of the backend's own hyperparameters (the ``**overrides`` of build_attention)
    Config: ClassVar[type] = NoConfig
    # capability: the backend honours a [B, N] padding mask exactly
    supports_mask: ClassVar[bool] = True
    # the names the mechanism carries in the published LRA tables (../shared/reference, e.g.
    # "Performer", "Favor-256"), so a table can set each published row beside the suite's own number
    published_as: ClassVar[Tuple[str, ...]] = ()
    # cost of one forward in the sequence length, for the backend table of docs/backends.md, e.g. "O(N^2 D)"
    cost: ClassVar[str] = ""
    taxonomy: ClassVar[Taxonomy]
    # every query's output depends on that query and all N keys only, so S queries cost S / N of the
    # whole: the benchmark times a slice through ``attend`` and scales it where the whole is too slow
    independent_queries: ClassVar[bool] = False
    # where the built-ins are listed (registry, tables): full first, MiTA last; a plugin's default
    # puts it after them, in name order
    order: ClassVar[float] = float("inf")
    # a timing reference, not a backend to train (``none``, the model without attention): left out of
    # list_attentions() (battery, tables, sweeps), refused by lra-run, timed by lra-bench when named
    timing_only: ClassVar[bool] = False
    # the options that count tokens (or blocks) of one sequence, with what the backend computes once
    # one covers the whole sequence (``covers``): a value past that is clamped to it when the backend is
    # built (``within_length``, by build_attention), with a one-line notice in ``notices``
    whole_sequence: ClassVar[Dict[str, str]] = {}

    def __init__(self, dims: AttnDims, cfg: object) -> None:
        super().__init__()
        self.dims = dims
        self.cfg = cfg
        # what build_attention clamped, one line each (within_length)
        self.notices: List[str] = []

    @classmethod
    def covers(cls, cfg: Any, option: str, max_len: int) -> int:
        """The value of ``option`` at which it covers a whole sequence of ``max_len`` tokens (a block or
        a bucket of max_len tokens; a backend whose option counts otherwise says so)."""
        return max_len

    @classmethod
    def within_length(cls, cfg: Any, max_len: int) -> Tuple[Any, List[str]]:
        """``cfg`` with every option of ``whole_sequence`` past what a sequence of ``max_len`` tokens holds
        clamped to it (the same output: the backend computes a longer block or window as that), and one
        line per option clamped."""
        changes: Dict[str, int] = {}
        notices: List[str] = []
        if any(isinstance(getattr(cfg, o), int) and getattr(cfg, o) < 1 for o in cls.whole_sequence):
            # a count below 1 covers nothing: the backend refuses it, in its own words
            return cfg, notices
        for option, becomes in cls.whole_sequence.items():
            value = getattr(cfg, option)
            # options are read in order: a later one may count in an earlier one's units (MoBA's blocks)
            reach = cls.covers(dataclasses.replace(cfg, **changes), option, max_len)
            if max_len >= 1 and isinstance(value, int) and value > reach:
                changes[option] = reach
                notices.append(f"{cls.name} {option}={value} reaches past a sequence of {max_len} tokens (max_len): "
                               f"clamped to {reach}, {becomes}")
        return dataclasses.replace(cfg, **changes), notices

    def budget(self) -> str:
        """How many keys one query attends to at these settings, as a short formula with a value."""
        return "N"

    @classmethod
    def variant(cls, options: Dict[str, Any]) -> str:
        """The form that ``options`` choose where it lets a query reach other keys than the backend's
        default form ("" for the default form): tables keep the runs of each form in rows of their
        own ("reformer (chunked)"), where options that only change how the same result is computed
        (a kernel, a dual form) leave the row alone."""
        return ""

    @classmethod
    def routes(cls) -> bool:
        """Whether the backend chooses keys per query from the data (its taxonomy's scaling is routing
        or both): two correct kernels may then disagree on rows where a near-tie flips a choice."""
        return cls.taxonomy.scaling in ("routing", "both")

    @classmethod
    def flops(cls, cfg: Any, n: int, d: int) -> Optional[Tuple[float, float]]:
        """(forward, train) FLOPs of one head at length ``n``, head dim ``d`` (a multiply-add is 2;
        memory-bound work such as softmax, top-k and gathers is not counted), or None where the
        backend does not count them."""
        return None

    @classmethod
    def implementation(cls, cfg: Any, device: torch.device) -> str:
        """Which implementation runs on ``device`` at settings ``cfg`` (benchmark records name it)."""
        return f"attentions.{cls.name}"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries q [B, H, S, D] (any S) over keys k, v [B, H, N, D], no mask: for backends with
        ``independent_queries``, whose slices the benchmark times."""
        raise NotImplementedError(f"attention {self.name!r} has independent_queries = False: no slice of its queries runs alone")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"dims={self.dims}, cfg={self.cfg}"


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    """Raise a clear error when q, k, v or mask break the contract's shapes."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise AttentionError(
            f"q, k, v must all be [B, H, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if mask is not None:
        b, _, n, _ = q.shape
        if mask.dtype != torch.bool or tuple(mask.shape) != (b, n):
            raise AttentionError(
                f"mask must be a bool tensor [B, N] = [{b}, {n}] with True = real token; "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
