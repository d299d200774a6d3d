"""Multi-query associative recall, MQAR (Arora et al. 2023, "Zoology"; HazyResearch/zoology
``zoology/data/multiquery_ar.py``): key-value pairs, then queries of earlier keys; at each query the
model must name the value paired with its key. A token-level task: one answer per query position.

A sequence of length L with P pairs and vocabulary V, as zoology builds it (its figure sweeps'
``random_non_queries=False``: the positions between queries hold the token 0):

    k1 v1 k2 v2 ... kP vP | 0 ... kj 0 ... ki 0 ...        (L tokens)

- keys are drawn from 1 .. V//2 - 1 and values from V//2 .. V - 1 (disjoint vocabularies), each
  without replacement, so the keys of a sequence are distinct (and so are its values);
- the query region holds (L - 2P) // 2 slots at even offsets 0, 2, 4, ... after the pairs; every key
  is asked once, at the slot of a gap g drawn without replacement with p(g) proportional to
  (g + 1)^(a - 1), a = 0.01 (zoology's power law: a key is most often asked soon after the pairs);
- the label of a query position is its key's value; every other position has IGNORE (-100), so the
  loss and the accuracy count the query positions only.

That is the ``two-token`` formulation (data.level "" or two-token): a query is answered in two hops,
matching the key, then reading the token beside it. ``one-token`` (data.level=one-token) puts each
pair at one position, tokens [L, 2] whose two embeddings the encoder sums (slot 0: the key, query
or filler; slot 1: the value at a pair's position, 0 elsewhere): one hop. The P pairs then take P
positions and the query slots start after them; everything else is as above.

Example i of a split is drawn from ``np.random.default_rng([data.seed, split, i])`` alone, so the same
(data.seed, split, index) always gives the same example, whatever the split's size; nothing is read
from or written to disk (``lra-data generate mqar`` writes examples as TSV for reading).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from ..errors import UserError
from ..files import write_atomic
from .base import IGNORE, SPLITS, DataConfigLike, DataStatus, Split, Task, TaskSpec, register_task

# zoology's power-law exponent of the query gaps (MQARConfig.power_a)
POWER_A = 0.01
# the defaults of data.max_len, data.pairs, data.vocab and data.size (0 = these), and the held-out
# splits' size: zoology's figure sweeps (vocab 8,192; 100,000 training and 3,000 test examples)
MAX_LEN, PAIRS, VOCAB, TRAIN_SIZE, HELD_OUT = 256, 16, 8192, 100_000, 3_000
# the token between queries
FILLER = 0
# data.level: the formulation ("" = two-token, zoology's)
FORMS = ("two-token", "one-token")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The axes of one MQAR set: sequence length, key-value pairs, vocabulary size; and its formulation."""

    length: int
    pairs: int
    vocab: int
    form: str = "two-token"

    @property
    def context(self) -> int:
        """Positions the pairs take."""
        return 2 * self.pairs if self.form == "two-token" else self.pairs

    @property
    def keys(self) -> int:
        """Key tokens: 1 .. vocab // 2 - 1."""
        return self.vocab // 2 - 1

    @property
    def values(self) -> int:
        """Value tokens: vocab // 2 .. vocab - 1."""
        return self.vocab - self.vocab // 2

    @property
    def slots(self) -> int:
        """Query slots after the pairs."""
        return (self.length - self.context) // 2


def shape_of(data: DataConfigLike) -> Shape:
    """The data config's axes (0 = the default), checked: a bad combination is a UserError."""
    if data.level not in ("", *FORMS):
        raise UserError(f"mqar: data.level {data.level!r} is not a formulation; valid: {', '.join(FORMS)} "
                        "(\"\" = two-token, zoology's)")
    shape = Shape(data.max_len or MAX_LEN, data.pairs or PAIRS, data.vocab or VOCAB, data.level or FORMS[0])
    length, pairs, vocab = shape.length, shape.pairs, shape.vocab
    if shape.slots < pairs:
        per_pair = shape.context // pairs + 2
        raise UserError(f"mqar: {pairs} key-value pairs do not fit in data.max_len {length}: {shape.form} pairs take "
                        f"{shape.context} positions and their queries {2 * pairs} more; use data.pairs <= "
                        f"{length // per_pair} or data.max_len >= {per_pair * pairs}")
    if shape.keys < pairs:
        raise UserError(f"mqar: data.vocab {vocab} has {shape.keys} key tokens (1 .. vocab/2 - 1), too few "
                        f"for {pairs} distinct keys per sequence; use data.vocab >= {2 * pairs + 2}")
    return shape


@functools.lru_cache(maxsize=8)
def gap_weights(slots: int) -> np.ndarray:
    """p(g) for g = 0 .. slots - 1: zoology's power law a (g + 1)^(a - 1), normalised."""
    p = POWER_A * np.arange(1, slots + 1, dtype=np.float64) ** (POWER_A - 1)
    return p / p.sum()


def example(shape: Shape, seed: int, split: int, index: int) -> Tuple[np.ndarray, np.ndarray]:
    """Example ``index`` of split number ``split`` (0 train, 1 val, 2 test): tokens [L] (one-token: [L, 2])
    and labels [L]."""
    rng = np.random.default_rng([seed, split, index])
    keys = 1 + rng.choice(shape.keys, size=shape.pairs, replace=False)
    values = shape.vocab // 2 + rng.choice(shape.values, size=shape.pairs, replace=False)
    # P gaps without replacement, each draw proportional to the weights of the gaps left (as
    # np.random.choice(replace=False, p=...) draws them): the P largest log(u) / w (Efraimidis and
    # Spirakis 2006), one vectorised draw instead of P sequential ones
    scores = np.log(rng.random(shape.slots)) / gap_weights(shape.slots)
    gaps = np.argpartition(-scores, shape.pairs - 1)[: shape.pairs]
    labels = np.full(shape.length, IGNORE, dtype=np.int64)
    asked = shape.context + 2 * gaps  # [P] the query positions
    labels[asked] = values
    if shape.form == "two-token":
        tokens = np.full(shape.length, FILLER, dtype=np.int32)
        tokens[0 : 2 * shape.pairs : 2] = keys
        tokens[1 : 2 * shape.pairs : 2] = values
        tokens[asked] = keys
        return tokens, labels
    tokens = np.full((shape.length, 2), FILLER, dtype=np.int32)
    tokens[: shape.pairs, 0] = keys
    tokens[: shape.pairs, 1] = values
    tokens[asked, 0] = keys
    return tokens, labels


def make_split(shape: Shape, seed: int, split: int, size: int) -> Split:
    tokens = np.empty((size, shape.length) + ((2,) if shape.form == "one-token" else ()), dtype=np.int32)
    labels = np.empty((size, shape.length), dtype=np.int64)
    for i in range(size):
        tokens[i], labels[i] = example(shape, seed, split, i)
    return Split(tokens, np.full(size, shape.length, dtype=np.int32), labels)


def split_sizes(data: DataConfigLike) -> Dict[str, int]:
    return {"train": data.size or TRAIN_SIZE, "val": HELD_OUT, "test": HELD_OUT}


def token_name(token: np.ndarray, shape: Shape) -> str:
    """How a TSV file shows a position: ``k<id>`` a key, ``v<id>`` a value, ``.`` the filler; a
    one-token pair as ``k<id>=v<id>``."""
    if token.ndim:
        return "=".join(token_name(t, shape) for t in token if t != FILLER) or "."
    if token == FILLER:
        return "."
    return f"k{token}" if token < shape.vocab // 2 else f"v{token}"


def tsv_lines(split: Split, shape: Shape) -> List[str]:
    """The header and one line per example: index, the tokens, the targets (position:value)."""
    lines = ["index\ttokens\ttargets"]
    for i in range(len(split)):
        tokens, labels = split.tokens[i], split.labels[i]
        asked = np.flatnonzero(labels != IGNORE)
        targets = " ".join(f"{p}:{token_name(labels[p], shape)}" for p in asked)
        lines.append(f"{i}\t{' '.join(token_name(t, shape) for t in tokens)}\t{targets}")
    return lines


@register_task("mqar")
class MQAR(Task):
    spec = TaskSpec(name="mqar", num_classes=VOCAB, vocab_size=VOCAB, max_len=MAX_LEN, padded=False, token_level=True)
    generated = True

    def spec_for(self, data: DataConfigLike) -> TaskSpec:
        shape = shape_of(data)
        # the head scores every token of the vocabulary, as zoology's language-model head does
        return dataclasses.replace(self.spec, num_classes=shape.vocab, vocab_size=shape.vocab, max_len=shape.length)

    def max_len(self, data: DataConfigLike) -> int:
        return shape_of(data).length

    def levels(self, data: DataConfigLike) -> Dict[str, Any]:
        """The four axes, resolved (0 = the default): the formulation, N, the vocabulary and the pairs."""
        shape = shape_of(data)
        return {"level": shape.form, "max_len": shape.length, "vocab": shape.vocab, "pairs": shape.pairs}

    def run_tag(self, data: DataConfigLike) -> str:
        """N and the pairs, and the vocabulary and formulation where they are not zoology's:
        ``L128-p32``, ``L64-p4-v256-one-token``."""
        shape = shape_of(data)
        tag = f"L{shape.length}-p{shape.pairs}"
        if shape.vocab != VOCAB:
            tag += f"-v{shape.vocab}"
        return tag if shape.form == FORMS[0] else f"{tag}-{shape.form}"

    def load(self, data: DataConfigLike) -> Dict[str, Split]:
        shape = shape_of(data)
        return {s: make_split(shape, data.seed, i, split_sizes(data)[s]) for i, s in enumerate(SPLITS)}

    def split_sizes(self, data: DataConfigLike) -> Dict[str, int]:
        return split_sizes(data)

    def example_rows(self, data: DataConfigLike, n: int, seed: int = 0) -> Split:
        """The first ``n`` training examples of this level (drawn as ``load`` draws them, in milliseconds)."""
        return make_split(shape_of(data), data.seed, 0, n)

    def folder_name(self, data: DataConfigLike) -> str:
        shape = shape_of(data)
        form = "" if shape.form == FORMS[0] else f"_{shape.form}"
        return f"mqar_L{shape.length}_p{shape.pairs}_v{shape.vocab}{form}_n{split_sizes(data)['train']}_seed{data.seed}"

    def generate(self, data: DataConfigLike) -> Path:
        """Write ``<data_dir>/<folder_name>/{train,val,test}.tsv`` for reading (training never reads them)."""
        shape = shape_of(data)
        folder = Path(data.data_dir) / self.folder_name(data)
        # train last, as the generators of the other tasks do
        for s, split in reversed(self.load(data).items()):
            write_atomic(folder / f"{s}.tsv", ("\n".join(tsv_lines(split, shape)) + "\n").encode())
        return folder

    def status(self, data_dir: str) -> DataStatus:
        from ..config import DataConfig

        sizes = split_sizes(DataConfig(data_dir=data_dir))
        return DataStatus(task="mqar", present=True, source="generated from (data.seed, split, index) on every run",
                          split_sizes=sizes)
