"""MQAR: the generated examples against their definition, the masked loss and accuracy by hand, a
smoke run through lra-run, the backends at the task's shapes, the TSV files, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lra.config import DataConfig, resolve
from lra.tasks import get_task
from lra.tasks.base import IGNORE
from lra.tasks.mqar import Shape, example, gap_weights, shape_of, tsv_lines
from lra.run.loop import evaluate, per_target
from lra.run.distributed import Dist

SHAPE = Shape(length=64, pairs=8, vocab=64)


@pytest.mark.parametrize("shape", [SHAPE, Shape(length=64, pairs=16, vocab=40), Shape(length=33, pairs=1, vocab=4)],
                         ids=["L64-P8-V64", "L64-P16-V40-full", "L33-P1-V4-smallest"])
def test_examples_keep_their_definition(shape: Shape) -> None:
    half = shape.vocab // 2
    for index in range(200):
        tokens, labels = example(shape, seed=3, split=0, index=index)
        assert tokens.shape == labels.shape == (shape.length,)
        keys, values = tokens[0 : 2 * shape.pairs : 2], tokens[1 : 2 * shape.pairs : 2]
        # disjoint vocabularies: keys 1 .. V/2 - 1, values V/2 .. V - 1; keys distinct within a sequence
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < shape.vocab)).all()
        assert len(set(keys.tolist())) == shape.pairs and len(set(values.tolist())) == shape.pairs
        asked = np.flatnonzero(labels != IGNORE)
        # every key asked exactly once, at an even offset after the pairs, and nothing else labelled
        assert len(asked) == shape.pairs and (asked >= 2 * shape.pairs).all() and (asked % 2 == 0).all()
        assert sorted(tokens[asked].tolist()) == sorted(keys.tolist())
        pair_of = dict(zip(keys.tolist(), values.tolist()))
        for p in asked:
            # the query's key appears earlier as a key, and its target is the value paired with it
            first = int(np.flatnonzero(tokens == tokens[p])[0])
            assert first < 2 * shape.pairs and first % 2 == 0
            assert labels[p] == pair_of[int(tokens[p])] == tokens[first + 1]
        # everything after the pairs that is not a query is the filler 0
        rest = np.setdiff1d(np.arange(2 * shape.pairs, shape.length), asked)
        assert (tokens[rest] == 0).all()


@pytest.mark.parametrize("pairs", [1, 8, 21], ids=["P1", "P8", "P21-full"])
def test_one_token_examples_keep_their_definition(pairs: int) -> None:
    one, two = Shape(length=64, pairs=pairs, vocab=64, form="one-token"), Shape(length=64, pairs=pairs, vocab=64)
    for index in range(100):
        tokens, labels = example(one, seed=3, split=1, index=index)
        assert tokens.shape == (64, 2) and labels.shape == (64,)
        keys, values = tokens[:pairs, 0], tokens[:pairs, 1]
        assert ((keys >= 1) & (keys < 32)).all() and ((values >= 32) & (values < 64)).all()
        assert len(set(keys.tolist())) == pairs
        # slot 1 holds a value at the pairs' positions only
        assert (tokens[pairs:, 1] == 0).all()
        asked = np.flatnonzero(labels != IGNORE)
        assert len(asked) == pairs and ((asked - pairs) % 2 == 0).all() and (asked >= pairs).all()
        pair_of = dict(zip(keys.tolist(), values.tolist()))
        assert all(labels[p] == pair_of[int(tokens[p, 0])] for p in asked)
        rest = np.setdiff1d(np.arange(pairs, 64), asked)
        assert (tokens[rest] == 0).all()
        if pairs <= 16:
            # the same pairs as the two-token example of that index (the query slots differ in number)
            tokens2, _ = example(two, seed=3, split=1, index=index)
            assert (tokens2[0 : 2 * pairs : 2] == keys).all() and (tokens2[1 : 2 * pairs : 2] == values).all()


def test_an_example_is_a_function_of_seed_split_and_index() -> None:
    data = DataConfig(max_len=64, pairs=8, vocab=64, size=50)
    splits = get_task("mqar").load(data)
    tokens, labels = example(SHAPE, 0, 2, 17)
    assert (splits["test"].tokens[17] == tokens).all() and (splits["test"].labels[17] == labels).all()
    # another training-set size leaves the first rows as they were
    bigger = get_task("mqar").load(DataConfig(max_len=64, pairs=8, vocab=64, size=80))["train"]
    assert (bigger.tokens[:50] == splits["train"].tokens).all() and (bigger.labels[:50] == splits["train"].labels).all()
    # the split, the seed and the index each change the example
    for other in [example(SHAPE, 0, 1, 17), example(SHAPE, 1, 2, 17), example(SHAPE, 0, 2, 18)]:
        assert not (other[0] == tokens).all()
    assert (splits["train"].lengths == 64).all() and len(splits["val"]) == len(splits["test"]) == 3000


def test_query_gaps_follow_zoologys_power_law() -> None:
    # the first slot's share of queries against its probability under sequential draws without replacement
    shape = Shape(length=64, pairs=1, vocab=64)
    slots = shape.slots
    asked = np.array([np.flatnonzero(example(shape, 0, 0, i)[1] != IGNORE)[0] for i in range(4000)])
    gaps = (asked - 2 * shape.pairs) // 2
    p = gap_weights(slots)
    # one draw: the gap's frequencies are p itself
    assert abs((gaps == 0).mean() - p[0]) < 0.03
    assert p[0] > 10 * p[-1] and np.all(np.diff(p) < 0)


def test_masked_loss_and_accuracy_by_hand() -> None:
    # 2 rows of 3 positions, 4 classes; row 0 asks at positions 0 and 2, row 1 at position 1
    logits = torch.tensor([[[2.0, 0.0, 0.0, 0.0], [0.0, 9.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]],
                           [[0.0, 0.0, 5.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, IGNORE, 2], [IGNORE, 0, IGNORE]])
    flat_logits, flat_labels = per_target(logits, labels)
    # the three asked positions only: log-softmax of their targets
    e = np.exp(1.0)
    by_hand = [-np.log(e**2 / (e**2 + 3)), -np.log(1 / (3 + e)), -np.log(e / (e + 3))]
    assert F.cross_entropy(flat_logits, flat_labels).item() == pytest.approx(np.mean(by_hand), rel=1e-6)

    class Fixed(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return logits[tokens[:, 0]]

    from lra.tasks import Split

    split = Split(np.array([[0, 0, 0], [1, 0, 0]]), np.array([3, 3]), labels.numpy())
    acc, loss = evaluate(Fixed(), split, 2, 0, torch.device("cpu"), Dist(), False)
    # row 0: position 0 right (argmax 0), position 2 wrong (argmax 3 for 2); row 1: position 1 right
    assert acc == pytest.approx(2 / 3) and loss == pytest.approx(np.mean(by_hand), rel=1e-6)
    # a classifier's labels [B] pass through unchanged
    same = per_target(logits[:, 0], torch.tensor([0, 2]))
    assert same[0].shape == (2, 4) and same[1].tolist() == [0, 2]


TINY_MQAR = ["--task", "mqar", "--preset", "smoke", "--quiet", "--set", "model.dim=16", "model.ffn_dim=32",
             "train.steps=4", "train.eval_every=2", "data.max_len=32", "data.pairs=4", "data.vocab=32", "data.size=32"]


def test_smoke_run_of_full_attention(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    ran = cli("lra-run", *TINY_MQAR, "--attn", "full", "--data-dir", "data", "--out", "runs")
    assert ran.code == 0, ran.err
    record = json.loads((tmp_path / "runs" / "mqar-L32-p4-v32_full_smoke_seed0" / "record.json").read_text())
    assert record["status"] == "completed" and record["task"] == "mqar"
    # the smoke preset tests 4 batches of 8 rows: 32 rows, 4 queries each; an accuracy is a count of them
    assert record["test_examples"] == 32 and round(record["test_acc"] * 128, 6) == round(record["test_acc"] * 128)
    assert 0 < record["majority_acc"] < 1
    assert record["config"]["data"]["pairs"] == 4 and record["config"]["data"]["vocab"] == 32
    # nothing is written to the data folder: the examples come from (seed, split, index)
    assert list((tmp_path / "data").iterdir()) == []


def test_every_backend_at_the_tasks_shapes(cli) -> None:
    from attentions import list_attentions

    names = [a for n in list_attentions() for a in ("--name", n)]
    ran = cli("lra-check-attn", *names, "--task", "mqar", "--preset", "smoke")
    assert ran.code == 0, ran.out
    assert ran.out.count("B=3 H=2 N=64 D=32") == len(list_attentions()) and "FAIL" not in ran.out


def test_cpu_protocol_keeps_every_budget_well_below_n() -> None:
    """At the cpu preset no backend but the dense ones (full and Kernelized Attention, the Synthesizer's
    learned weights, linear attention, cosFormer and TTT through their fixed-size states) reaches every
    key: each sparse or compressed backend sees at most N / 8 keys per query."""
    from attentions import build_attention, list_attentions
    from lra.config import resolve
    from lra.tables.recall import keys_per_query

    seen = {}
    for name in list_attentions():
        cfg = resolve("mqar", name, "cpu")
        n, heads = cfg.data.max_len, cfg.model.num_heads
        attn = build_attention(name, num_heads=heads, head_dim=cfg.model.dim // heads, max_len=n, **cfg.attn_options)
        seen[name] = keys_per_query(attn.budget(), n)
    # backends whose every query reaches all N keys by construction (a dense score or a fixed-size state)
    dense = ("full", "kernelized", "linear", "cosformer", "synthesizer", "ttt_linear", "ttt_mlp")
    assert all(seen[name] == 128 for name in dense), seen
    # the Sparse Transformer's fixed pattern cannot go below its own block of l plus one summary column
    # in each other block, l + N / l - 1 >= 2 sqrt(N) - 1: 21 keys at N = 128 (l = 12, c = 1)
    floor = {"sparse_transformer": 21}
    assert all(keys <= floor.get(name, 128 // 8) for name, keys in seen.items() if name not in dense), seen


def test_run_folders_name_the_level() -> None:
    from lra.run.folder import run_name
    from lra.config import resolve

    names = {run_name(resolve("mqar", "full", "cpu", sets=[f"data.pairs={p}"])) for p in (8, 16, 32)}
    assert names == {f"mqar-L128-p{p}-v256-one-token_full_cpu_seed0" for p in (8, 16, 32)}
    assert run_name(resolve("mqar", "mita", "paper", seed=2)) == "mqar-L256-p16_mita_paper_seed2"
    # a task of one level keeps its plain name
    assert run_name(resolve("listops", "full", "cpu")) == "listops_full_cpu_seed0"


def test_generate_writes_readable_tsv(tmp_path: Path, cli) -> None:
    ran = cli("lra-data", "generate", "mqar", "--data-dir", tmp_path, "--size", 5, "--max-len", 16, "--pairs", 2,
              "--vocab", 20)
    assert ran.code == 0, ran.err
    folder = tmp_path / "mqar_L16_p2_v20_n5_seed0"
    lines = (folder / "train.tsv").read_text().splitlines()
    assert lines[0] == "index\ttokens\ttargets" and len(lines) == 6
    tokens, labels = example(Shape(16, 2, 20), 0, 0, 0)
    index, shown, targets = lines[1].split("\t")
    words = shown.split()
    assert index == "0" and len(words) == 16 and words[0] == f"k{tokens[0]}" and words[1] == f"v{tokens[1]}"
    asked = np.flatnonzero(labels != IGNORE)
    assert targets == " ".join(f"{p}:v{labels[p]}" for p in asked)
    assert all(w == "." for p, w in enumerate(words) if p >= 4 and p not in asked)
    assert len((folder / "test.tsv").read_text().splitlines()) == 3001
    assert tsv_lines(get_task("mqar").load(DataConfig(max_len=16, pairs=2, vocab=20, size=5))["train"],
                     Shape(16, 2, 20)) == lines


@pytest.mark.parametrize("args, message", [
    (["data.max_len=32", "data.pairs=9"], "9 key-value pairs do not fit in data.max_len 32"),
    (["data.max_len=64", "data.pairs=8", "data.vocab=16"], "data.vocab 16 has 7 key tokens"),
    (["data.max_len=32", "data.pairs=11", "data.level=one-token"], "use data.pairs <= 10 or data.max_len >= 33"),
    (["data.level=three-token"], "data.level 'three-token' is not a formulation; valid: two-token, one-token"),
    (["data.pairs=-1"], "data.pairs must be 0 (the task's default) to 1,048,576"),
], ids=["pairs-too-many", "vocab-too-small", "one-token-pairs-too-many", "unknown-form", "negative-pairs"])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, args: list, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    ran = cli("lra-run", "--task", "mqar", "--attn", "full", "--preset", "smoke", "--quiet", "--set", *args)
    assert ran.code == 2 and ran.err.count("\n") == 1 and message in ran.err, ran.err
    assert list(tmp_path.iterdir()) == []


def test_one_token_smoke_run_sums_the_pair_embeddings(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from lra.model import Encoder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    ran = cli("lra-run", *TINY_MQAR, "data.level=one-token", "--attn", "full", "--data-dir", "data", "--out", "runs")
    assert ran.code == 0, ran.err
    # the encoder's input at a position is the sum of its slots' embeddings
    cfg = resolve("mqar", "full", "smoke", ["model.dim=16", "model.dropout=0"])
    enc = Encoder(cfg.model, "full", {}, 32, 8, padded=False, per_position=True).eval()
    both = torch.tensor([[[3, 20]] * 8])
    summed = enc.tokens.weight[3] + enc.tokens.weight[20]
    enc.tokens.weight.data[3] = summed
    enc.tokens.weight.data[20] = 0
    assert torch.allclose(enc(both, None), enc(torch.tensor([[3] * 8]), None), atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["mqar", "--pairs", "9", "--max-len", "32"], "9 key-value pairs do not fit"),
    (["listops", "--pairs", "4"], "--pairs sets an axis of mqar only"),
], ids=["mqar-pairs-too-many", "pairs-for-listops"])
def test_generate_bad_input_is_one_line_exit_2(tmp_path: Path, cli, args: list, message: str) -> None:
    ran = cli("lra-data", "generate", *args, "--data-dir", tmp_path)
    assert ran.code == 2 and ran.err.count("\n") == 1 and message in ran.err, ran.err
    assert list(tmp_path.iterdir()) == []


def test_shape_of_defaults_and_spec() -> None:
    shape = shape_of(DataConfig())
    assert (shape.length, shape.pairs, shape.vocab) == (256, 16, 8192)
    cfg = resolve("mqar", "full", "smoke")
    spec = get_task("mqar").spec_for(cfg.data)
    assert spec.token_level and not spec.padded and spec.vocab_size == spec.num_classes == cfg.data.vocab


def test_reproduce_mqar_scripts_run_the_matrix_and_the_budget_grid(tmp_path: Path) -> None:
    """scripts/reproduce_mqar.sh: backends x levels x seeds through lra-sweep, then the recall table;
    scripts/reproduce_mqar_budget.sh: lra-analyze budget on each MiTA run, then its table over seeds."""
    import os
    import subprocess

    from conftest import ROOT

    runs = tmp_path / "runs"
    env = {**os.environ, "OUT": str(runs), "TABLES": str(tmp_path / "tables"), "PRESET": "smoke", "SEEDS": "0 1",
           "PAIRS": "2 4", "BACKENDS": "full mita"}
    tiny = ["model.dim=16", "model.ffn_dim=32", "model.num_layers=1", "train.steps=4", "train.eval_every=2",
            "data.size=32"]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_mqar.sh"), "--executor", "debug", "--quiet",
                           "--set", *tiny], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.parent.name for p in runs.glob("*/record.json")) == sorted(
        f"mqar-L64-p{p}-v256_{a}_smoke_seed{s}" for a in ("full", "mita") for p in (2, 4) for s in (0, 1))
    recall = (tmp_path / "tables" / "recall.md").read_text()
    assert "| 2 pairs | 4 pairs |" in recall and "Runs used (8)" in recall
    env = {**os.environ, "RUNS": str(runs), "OUT": str(tmp_path / "budget"), "PRESET": "smoke", "BACKENDS": "mita",
           "EXAMPLES": "8", "GRID_mita": "attn.landmarks=4,8 attn.topk=8"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_mqar_budget.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "budget" / "mqar_mita_smoke.md").read_text()
    assert "| landmarks | topk | cost per query | pairs 2 | pairs 4 |" in table and "seeds 0, 1" in table
    # no run of any backend asked for: lines naming what is missing, exit 2
    env["BACKENDS"] = "topk"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_mqar_budget.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no finished topk run" in proc.stderr and "no run to analyse" in proc.stderr
