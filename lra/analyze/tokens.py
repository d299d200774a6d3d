"""lra-analyze tokens: which keys MiTA's landmarks select into routed experts, layer by layer.

MiTA's third finding: in deeper layers the selection concentrates on the task-relevant tokens and
many positions are never selected (emergent token pruning). A forward hook on each layer's
attention sees its q, k and mask and asks the backend for its routed experts' keys
(``selected_keys``, computed by the same functions as its forward); per example and head, each
position's count is the number of experts (landmarks) that select it. From the counts: per layer
the fraction of real tokens no expert selects and the share of all selections taken by the 10% most
selected positions; for ListOps the rates by token kind and nesting depth; for images a map over the
pixels (plots.py). Tokens here are the input's: a cls token (model.pooling=cls) is left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from attentions import get_attention, list_attentions

from ..errors import UserError
from ..format import Table
from ..tasks.listops import VOCAB
from .loaded import Loaded, batches

# the share of selections taken by this fraction of the most selected positions measures concentration
TOP_FRACTION = 0.1


@dataclass
class Selections:
    # per layer: how many routed experts select each position, [examples, H, L] int32
    counts: List[torch.Tensor]
    # the examples' tokens [examples, L] and real lengths [examples] (a dual task's two documents are two rows)
    tokens: np.ndarray
    lengths: np.ndarray

    def real(self) -> torch.Tensor:
        """[examples, L] bool, True at a real token."""
        length = self.tokens.shape[1]
        return torch.arange(length)[None, :] < torch.from_numpy(np.asarray(self.lengths, dtype=np.int64))[:, None]


def check_routed(attn: str) -> None:
    """A backend without routed experts (no ``selected_keys``) is a one-line error naming those that have them."""
    if not hasattr(get_attention(attn), "selected_keys"):
        routed = [n for n in list_attentions() if hasattr(get_attention(n), "selected_keys")]
        raise UserError(f"tokens needs a backend with routed experts (one whose class has selected_keys: "
                        f"{', '.join(routed)}); this run's backend is {attn!r}")


def counting_hook(into: List[torch.Tensor]) -> Callable[..., None]:
    """A forward hook (with kwargs) on an attention module: each call's selection counts [B, H, N] appended."""

    def hook(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        q, k = args[0], args[1]
        mask = kwargs.get("mask", args[3] if len(args) > 3 else None)
        index, real = module.selected_keys(q, k, mask)  # [B, H, m, keys] each
        counts = torch.zeros(q.shape[:3], dtype=torch.int32, device=q.device)  # [B, H, N]
        counts.scatter_add_(2, index.flatten(2), real.flatten(2).to(torch.int32))
        into.append(counts.cpu())

    return hook


def capture(loaded: Loaded, batch: int) -> Selections:
    """The trained model over the test rows, with every layer's selection counts."""
    model = loaded.trained()
    layers: List[List[torch.Tensor]] = [[] for _ in model.encoder.blocks]
    hooks = [block.attn.register_forward_hook(counting_hook(layers[i]), with_kwargs=True)
             for i, block in enumerate(model.encoder.blocks)]
    try:
        with torch.no_grad(), torch.autocast(loaded.device.type, dtype=torch.bfloat16, enabled=loaded.bf16):
            for tokens, lengths, _ in batches(loaded.test, batch, loaded.device):
                model(tokens, lengths)
    finally:
        for hook in hooks:
            hook.remove()
    # positions of the input: a cls token sits in front of them
    offset = 0 if model.encoder.cls is None else 1
    tokens = np.asarray(loaded.test.tokens)
    lengths = np.asarray(loaded.test.lengths)
    if loaded.spec.dual:
        tokens, lengths = tokens.reshape(-1, tokens.shape[-1]), lengths.reshape(-1)
    return Selections([torch.cat(c)[..., offset:] for c in layers], tokens, lengths)


def layer_stats(counts: torch.Tensor, real: torch.Tensor) -> Dict[str, float]:
    """counts [E, H, L], real [E, L] -> the fraction of real tokens never selected (per head, and by
    every head), the top positions' share of the selections and the mean selections per token."""
    heads = counts.shape[1]
    real_h = real[:, None, :].expand_as(counts)
    tokens = int(real_h.sum())
    # per (example, head): the 10% most selected real positions' share of its selections
    ranked = counts.masked_fill(~real_h, 0).sort(dim=-1, descending=True).values.cumsum(-1).double()  # [E, H, L]
    top = (real.sum(-1).double() * TOP_FRACTION).ceil().long().clamp(min=1)  # [E]
    taken = ranked.gather(-1, (top - 1)[:, None, None].expand(-1, heads, 1))[..., 0]  # [E, H]
    total = ranked[..., -1]
    share = taken[total > 0] / total[total > 0]
    return {
        "never_selected": float(((counts == 0) & real_h).sum()) / tokens,
        "never_selected_any_head": float(((counts.sum(1) == 0) & real).sum()) / float(real.sum()),
        "top10_share": float(share.mean()) if share.numel() else math.nan,
        "selections_per_token": float(counts.sum()) / tokens,
    }


def group_stats(counts: torch.Tensor, real: torch.Tensor, groups: np.ndarray) -> Dict[int, Dict[str, float]]:
    """Per group label (``groups`` [E, L] int): its share of the real tokens, the fraction of its
    (token, head) pairs selected by at least one expert, and its share of all selections."""
    group = torch.from_numpy(np.asarray(groups, dtype=np.int64))
    total_tokens, total_selections = float(real.sum()), float(counts.sum())
    out = {}
    for label in sorted(set(group[real].tolist())):
        where = real & (group == label)  # [E, L]
        picked = counts.permute(0, 2, 1)[where]  # [tokens, H]
        out[label] = {
            "share_of_tokens": float(where.sum()) / total_tokens,
            "selected": float((picked > 0).double().mean()),
            "share_of_selections": float(picked.sum()) / total_selections if total_selections else math.nan,
        }
    return out


def listops_kinds(tokens: np.ndarray) -> Tuple[np.ndarray, List[str]]:
    """Each ListOps token's kind [E, L] (digits one kind, each operator and ``]`` their own) and the kind names."""
    names = ["digit"] + [t for t in VOCAB[11:]]
    kind_of = np.array([0] + [0] * 10 + list(range(1, len(names))), dtype=np.int64)  # by token id (0 = pad)
    return kind_of[np.asarray(tokens, dtype=np.int64)], names


def listops_depth(tokens: np.ndarray) -> np.ndarray:
    """Each token's nesting depth [E, L]: 1 for the root operator, its arguments and its ``]``; an
    operator one level down and everything up to its ``]`` have depth 2, and so on."""
    ids = np.asarray(tokens, dtype=np.int64)
    opens = np.isin(ids, [i for i, t in enumerate(VOCAB) if t.startswith("[")])
    closes = ids == VOCAB.index("]")
    level = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64), axis=1)
    # a ``]`` belongs to the level it closes
    return level + closes


def pixel_frequency(counts: torch.Tensor, side: int) -> np.ndarray:
    """How often each pixel is selected: the fraction of (image, head) pairs, [side, side]."""
    return (counts > 0).double().mean(dim=(0, 1)).numpy().reshape(side, side)


def percent(value: float) -> str:
    return "—" if math.isnan(value) else f"{100 * value:.1f}%"


def tables(loaded: Loaded, sel: Selections) -> List[Table]:
    """Per layer, then (ListOps) by token kind and by nesting depth."""
    real = sel.real()
    stats = [layer_stats(c, real) for c in sel.counts]
    rows = [[str(i + 1), percent(s["never_selected"]), percent(s["never_selected_any_head"]), percent(s["top10_share"]),
             f"{s['selections_per_token']:.2f}"] for i, s in enumerate(stats)]
    records = [{"layer": i + 1, **{k: round(v, 6) for k, v in s.items()}, "examples": len(loaded.test),
                "run": loaded.run.name} for i, s in enumerate(stats)]
    attn = get_attention(loaded.cfg.attn).Config
    options = ", ".join(f"{k}={v}" for k, v in loaded.cfg.attn_options.items() if k in attn.__dataclass_fields__)
    notes = [
        f"Run {loaded.run.folder} ({loaded.cfg.task}, {loaded.cfg.attn}: {options}); best weights on the first "
        f"{len(loaded.test)} test examples.",
        "A position is selected when a routed expert (a landmark's top-k keys) holds it; rates are over (real token, "
        "head) pairs. Top-10% share: the selections taken by the 10% most selected positions of an example and head "
        "(10% if selection were uniform), averaged over examples and heads.",
    ]
    out = [Table(f"Routed-expert selection per layer: {loaded.run.name}",
                 ["layer", "never selected", "never selected by any head", "top-10% share", "selections per token"],
                 rows, notes=notes, records=records)]
    if loaded.cfg.task == "listops":
        kinds, names = listops_kinds(sel.tokens)
        out.append(group_table("By token kind", "token", kinds, names, sel, real))
        depth = listops_depth(sel.tokens)
        out.append(group_table("By nesting depth (1 = the root operator's level)", "depth", depth, None, sel, real))
    return out


def group_table(title: str, what: str, groups: np.ndarray, names: Any, sel: Selections, real: torch.Tensor) -> Table:
    """One row per group: its share of the tokens, then per layer how often it is selected and its
    share of the selections."""
    per_layer = [group_stats(c, real, groups) for c in sel.counts]
    columns = [what, "share of tokens"]
    for i in range(len(per_layer)):
        columns += [f"layer {i + 1}: selected", f"layer {i + 1}: share of selections"]
    rows = []
    for label, first in per_layer[0].items():
        row = [names[label] if names else str(label), percent(first["share_of_tokens"])]
        for stats in per_layer:
            row += [percent(stats[label]["selected"]), percent(stats[label]["share_of_selections"])]
        rows.append(row)
    return Table(title, columns, rows, notes=["Selected: the fraction of (token, head) pairs of that group held by at "
                                              "least one routed expert; share of selections: of all the layer's."])
