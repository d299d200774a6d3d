"""lra-analyze recall: where a trained MQAR model loses recall.

Every query of the test split is scored by its trained model (best weights) and placed by two
facts of the sequence: how far back its key lies (query position - key position) and which pair
it asks for (the key's rank among the sequence's keys, 0 = the first pair). A mechanism whose
keys per query are a window or a fixed pattern loses recall past a distance; one that compresses
the sequence into a fixed number of slots loses it past a number of pairs; one that cannot tell
the keys apart names *a* value of the sequence but not the right one. So beside the accuracy the
probe counts how often the answer is one of the sequence's values at all ("in context"): a model at
MQAR's guess level (100/P %) names in-context values nearly always and the right one by chance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from ..errors import UserError
from ..format import Table
from ..tasks.base import IGNORE
from .loaded import Loaded, batches

# the bins of the key's distance back from its query, and of the pair's rank (upper bounds, inclusive)
DISTANCE_BINS = (4, 8, 16, 32, 64, 128, 256, 512)
RANK_BINS = (3, 7, 15, 31, 63, 127, 255)


@dataclass
class Queries:
    """One entry per query of the examples scored: answered right, answered with one of the sequence's
    values, the key's distance back, the pair's rank, and the sequence's number of pairs."""

    correct: np.ndarray
    in_context: np.ndarray
    distance: np.ndarray
    rank: np.ndarray
    pairs: np.ndarray


def key_slot(tokens: torch.Tensor) -> torch.Tensor:
    """The token a position shows as key or query: the one-token form's slot 0, else the token."""
    return tokens[..., 0] if tokens.dim() == 3 else tokens


@torch.no_grad()
def score(loaded: Loaded, batch: int) -> Queries:
    """Every query of the loaded test rows, scored by the run's trained model."""
    if loaded.cfg.task != "mqar":
        raise UserError(f"recall probes MQAR runs (multi-query associative recall); this run's task is {loaded.cfg.task!r}")
    model = loaded.trained()
    rows: List[Tuple[np.ndarray, ...]] = []
    for tokens, lengths, labels in batches(loaded.test, batch, loaded.device):
        with torch.autocast(device_type=loaded.device.type, dtype=torch.bfloat16, enabled=loaded.bf16):
            logits = model(tokens, lengths)
        guess = logits.float().argmax(-1).cpu().numpy()  # [B, L]
        keys = key_slot(tokens).cpu().numpy()
        for b, target in enumerate(labels.cpu().numpy()):
            rows.append(example(keys[b], target, guess[b]))
    return Queries(*(np.concatenate(column) for column in zip(*rows)))


def example(keys: np.ndarray, target: np.ndarray, guess: np.ndarray) -> Tuple[np.ndarray, ...]:
    """One sequence's queries: [queries] arrays of correct, in_context, distance, rank, pairs. A query's
    key is the first earlier position holding its token (every key of a sequence is distinct and
    asked once, so the sequence's values are its labels)."""
    at = np.flatnonzero(target != IGNORE)  # the query positions
    first = {}
    for position, token in enumerate(keys):
        first.setdefault(int(token), position)
    key_at = np.array([first[int(keys[i])] for i in at])
    order = np.argsort(np.argsort(key_at))  # each key's rank among the sequence's keys
    values = set(target[at].tolist())
    picked = guess[at]
    return (picked == target[at], np.array([int(v) in values for v in picked]), at - key_at, order,
            np.full(len(at), len(at)))


def binned(values: np.ndarray, start: int, bins: Sequence[int]) -> List[Tuple[str, np.ndarray]]:
    """(label, mask) of each non-empty bin: start-4, 5-8, ... up to the largest bound, then "> last"."""
    out = []
    edges = [start - 1, *bins]
    for lo, hi in zip(edges, edges[1:]):
        mask = (values > lo) & (values <= hi)
        if mask.any():
            out.append((f"{lo + 1}-{hi}", mask))
    rest = values > bins[-1]
    if rest.any():
        out.append((f"> {bins[-1]}", rest))
    return out


def tables(loaded: Loaded, q: Queries) -> List[Table]:
    """The summary, then accuracy by the key's distance and by the pair's rank."""
    name = loaded.run.name
    pairs = int(np.median(q.pairs)) if len(q.pairs) else 0
    summary = Table(f"{name}: MQAR recall", ["Queries", "Accuracy (%)", "In context (%)", "Guess level (%)",
                                              "Right among in-context answers (%)"])
    inside = q.in_context.sum()
    summary.rows.append([f"{len(q.correct):,}", pct(q.correct.mean()), pct(q.in_context.mean()),
                         pct(1.0 / pairs) if pairs else "—", pct(q.correct.sum() / inside) if inside else "—"])
    summary.notes = [
        f"Every query of {len(loaded.test):,} test sequences ({pairs} pairs each), scored by the run's best weights "
        f"({loaded.cfg.attn}, train.lr {loaded.cfg.train.lr:g}, seed {loaded.cfg.seed}). In context: the answer "
        "is one of the sequence's values (right or not). Guess level: naming one of them at random.",
    ]
    out = [summary]
    for title, values, start, bins in (("distance back to the key (positions)", q.distance, 1, DISTANCE_BINS),
                                       ("rank of the pair asked for (0 = the first)", q.rank, 0, RANK_BINS)):
        table = Table(f"{name}: accuracy by {title}", ["Bin", "Queries", "Accuracy (%)", "In context (%)"])
        for label, mask in binned(values, start, bins):
            table.rows.append([label, f"{int(mask.sum()):,}", pct(q.correct[mask].mean()), pct(q.in_context[mask].mean())])
        out.append(table)
    return out


def pct(value: float) -> str:
    return f"{100.0 * value:.1f}"
