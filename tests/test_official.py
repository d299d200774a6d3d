"""The official preset and what it needs: the LRA JAX learning-rate schedules, flax's Adam, an
attention width apart from the model width, the sinusoidal position table and the two-tower head,
each checked against the JAX code's computation restated by hand."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from conftest import TINY_LISTOPS
from lra.config import CONFIG_DIR, ModelConfig, RunConfig, TrainConfig, resolve
from lra.errors import UserError
from lra.model import LRAModel
from lra.model.encoder import sinusoid
from lra.run.loop import lr_at
from lra.run.setup import make_optimizer

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")


def test_rsqrt_schedule_is_the_jax_product_of_factors() -> None:
    # train_utils.py: constant * min(1, s / warmup) / sqrt(max(s, warmup)), s the optimizer's step count
    cfg = TrainConfig(lr=0.05, warmup_steps=1000, steps=5000, schedule="rsqrt")
    assert lr_at(0, cfg) == 0.0
    assert lr_at(500, cfg) == pytest.approx(0.05 * 0.5 / math.sqrt(1000))
    assert lr_at(1000, cfg) == pytest.approx(0.05 / math.sqrt(1000))
    assert lr_at(4000, cfg) == pytest.approx(0.05 / 2 / math.sqrt(1000))
    # Retrieval's warmup (8,000) outlasts its 5,000 steps: the rate only climbs
    retrieval = TrainConfig(lr=0.05, warmup_steps=8000, steps=5000, schedule="rsqrt")
    assert lr_at(4999, retrieval) == pytest.approx(0.05 * 4999 / 8000 / math.sqrt(8000))


def test_cosine_schedule_decays_per_cycle_after_the_warmup() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=312, steps=62400, steps_per_cycle=62400, schedule="cosine")
    assert lr_at(0, cfg) == 0.0
    assert lr_at(156, cfg) == pytest.approx(0.5e-3)
    assert lr_at(312, cfg) == pytest.approx(1e-3)
    assert lr_at(312 + 31200, cfg) == pytest.approx(0.5e-3)
    assert lr_at(312 + 62399, cfg) == pytest.approx(0.0, abs=1e-9)
    # a new cycle starts at the top (progress % 1)
    assert lr_at(312 + 62400, cfg) == pytest.approx(1e-3)
    # steps_per_cycle 0 = train.steps
    assert lr_at(312 + 31200, TrainConfig(lr=1e-3, warmup_steps=312, steps=62400, schedule="cosine")) == pytest.approx(0.5e-3)


def test_lra_optimizer_is_flax_adam_with_its_weight_decay() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    cfg = RunConfig(train=TrainConfig(optimizer="lra", lr=0.01, weight_decay=0.1))
    optimizer = make_optimizer(layer, cfg)
    w = layer.weight.detach().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t in (1, 2, 3):
        grad = torch.randn_like(w)
        layer.weight.grad, layer.bias.grad = grad.clone(), torch.zeros_like(layer.bias)
        optimizer.step()
        # flax optim.Adam.apply_param_gradient, step by step
        m = 0.9 * m + 0.1 * grad
        v = 0.98 * v + 0.02 * grad**2
        update = (m / (1 - 0.9**t)) / ((v / (1 - 0.98**t)).sqrt() + 1e-9)
        w = w - 0.01 * update - 0.01 * 0.1 * w
        assert torch.allclose(layer.weight, w, atol=1e-12)


def test_attention_width_sets_the_heads_and_projections() -> None:
    # qkv_dim 16 over 4 heads: head_dim 4 (the scale is 1 / sqrt(4), not 1 / sqrt(32 / 4))
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, dim=32, qkv_dim=16, num_heads=4, ffn_dim=32, dropout=0.0)
    block = LRAModel(cfg, "full", {}, 10, 2, 12).encoder.blocks[0].eval()
    assert block.qkv.weight.shape == (48, 32) and block.proj.weight.shape == (32, 16)
    x = torch.randn(2, 12, 32)
    q, k, v = block.qkv(block.norm1(x)).view(2, 12, 3, 4, 4).permute(2, 0, 3, 1, 4)  # [B, H, N, 4] each
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    h = x + block.proj((weights @ v).transpose(1, 2).reshape(2, 12, 16))
    expected = h + block.ffn(block.norm2(h))
    assert torch.allclose(block(x, None), expected, atol=1e-5)


def test_sinusoid_is_the_jax_table_and_not_learned() -> None:
    table = sinusoid(50, 6).numpy()
    p, i = np.arange(50)[:, None], np.arange(3)[None, :]
    angle = p / 10000.0 ** (2 * i / 6)
    assert np.allclose(table[:, 0::2], np.sin(angle), atol=1e-6) and np.allclose(table[:, 1::2], np.cos(angle), atol=1e-6)
    learned = LRAModel(ModelConfig(), "full", {}, 10, 2, 40)
    fixed = LRAModel(ModelConfig(positions="sinusoidal"), "full", {}, 10, 2, 40)
    count = lambda m: sum(t.numel() for t in m.parameters())  # noqa: E731
    assert count(learned) - count(fixed) == 40 * 64
    assert torch.equal(fixed.encoder.sinusoid, sinusoid(40, 64))


def test_lra_dual_head_concatenates_the_two_towers() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, num_heads=2, ffn_dim=12, dropout=0.0, head="lra")
    model = LRAModel(cfg, "full", {}, 20, 2, 24, dual=True).eval()
    assert [tuple(layer.weight.shape) for layer in model.head if isinstance(layer, torch.nn.Linear)] == [
        (12, 32), (6, 12), (2, 6)]
    tokens, lengths = torch.randint(1, 20, (3, 2, 24)), torch.tensor([[24, 9], [5, 24], [7, 8]])
    u, v = model.encoder(tokens[:, 0], lengths[:, 0]), model.encoder(tokens[:, 1], lengths[:, 1])
    assert torch.allclose(model(tokens, lengths), model.head(torch.cat([u, v], dim=-1)), atol=1e-5)


def official_lines(task: str) -> list:
    """The lines of configs/tasks/<task>.yaml in its presets.official section."""
    lines = (CONFIG_DIR / "tasks" / f"{task}.yaml").read_text().splitlines()
    start = lines.index("  official:")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= 2),
               len(lines))
    return lines[start + 1:end]


@pytest.mark.parametrize("task", TASKS)
def test_every_official_value_cites_its_source_line(task: str) -> None:
    comments: list = []
    values = 0
    for line in official_lines(task):
        text = line.strip()
        if text.startswith("#"):
            comments.append(text)
            continue
        key, _, rest = text.partition(":")
        value, _, comment = rest.partition("#")
        if value.strip():
            values += 1
            cited = " ".join([comment, *comments])
            assert re.search(r"\w+\.py:\d+", cited), f"{task}: {key} cites no file:line"
        comments = []
    assert values >= 15


# (layers, dim, qkv_dim, heads, mlp, dropout, pooling, positions, steps, batch, lr, schedule, warmup, weight decay, max_len)
OFFICIAL = {
    "listops": (4, 512, 512, 8, 1024, 0.1, "cls", "sinusoidal", 5000, 32, 0.05, "rsqrt", 1000, 0.1, 2000),
    "text": (4, 256, 256, 4, 1024, 0.1, "cls", "sinusoidal", 20000, 32, 0.05, "rsqrt", 8000, 0.1, 1000),
    "retrieval": (4, 128, 128, 4, 512, 0.1, "cls", "sinusoidal", 5000, 32, 0.05, "rsqrt", 8000, 0.1, 4000),
    "image": (1, 128, 64, 8, 128, 0.3, "cls", "learned", 35000, 256, 5e-4, "cosine", 175, 0.0, 1024),
    "pathfinder": (4, 32, 16, 4, 32, 0.2, "mean", "sinusoidal", 62400, 512, 1e-3, "cosine", 312, 0.0, 0),
    "pathx": (1, 32, 16, 2, 32, 0.1, "mean", "learned", 500000, 64, 1e-3, "cosine", 2500, 0.0, 0),
}


@pytest.mark.parametrize("task", TASKS)
def test_official_preset_resolves_to_the_jax_values(task: str) -> None:
    cfg = resolve(task, "full", "official")
    m, t = cfg.model, cfg.train
    got = (m.num_layers, m.dim, m.qkv_dim, m.num_heads, m.ffn_dim, m.dropout, m.pooling, m.positions, t.steps,
           t.batch_size, t.lr, t.schedule, t.warmup_steps, t.weight_decay, cfg.data.max_len)
    assert got == OFFICIAL[task]
    assert t.optimizer == "lra" and m.head == "lra"
    assert t.grad_clip == (1.0 if task == "pathx" else 0.0)


def test_official_preset_refuses_a_task_the_paper_lacks() -> None:
    with pytest.raises(UserError, match="preset 'official' has no values for task 'mqar' .the LRA paper has no configuration"):
        resolve("mqar", "full", "official")


@pytest.mark.parametrize("sets, match", [
    (["model.positions=rotary"], r"model\.positions must be one of learned, sinusoidal, got 'rotary'"),
    (["model.head=nli"], r"model\.head must be one of mlp, lra"),
    (["train.schedule=step"], r"train\.schedule must be one of linear, rsqrt, cosine"),
    (["train.optimizer=sgd"], r"train\.optimizer must be one of adamw, lra"),
    (["model.qkv_dim=33"], r"model\.qkv_dim \(33\) must be divisible by model\.num_heads \(2\)"),
    (["model.qkv_dim=-1"], r"model\.qkv_dim must be 0 \(model\.dim\) to"),
    (["train.schedule=rsqrt", "train.warmup_steps=0"], r"train\.schedule=rsqrt divides by train\.warmup_steps"),
    (["train.steps_per_cycle=-5"], r"train\.steps_per_cycle must be 0 \(train\.steps\) to"),
], ids=["positions", "head", "schedule", "optimizer", "qkv-divisible", "qkv-negative", "warmup-zero", "cycle"])
def test_bad_values_are_one_line_errors(sets: list, match: str) -> None:
    with pytest.raises(UserError, match=match):
        resolve("listops", "full", "paper", sets)


def test_a_small_official_run_trains_on_the_jax_schedule(tmp_path: Path, listops_data: Path, cli: Callable) -> None:
    # the official ListOps protocol, shrunk: sinusoidal positions, a cls token, qkv_dim apart from dim,
    # flax's Adam and the rsqrt schedule all through lra-run's loop
    ran = cli("lra-run", "--task", "listops", "--attn", "full", "--preset", "official", "--quiet", "--no-estimate",
              "--data-dir", listops_data, "--out", tmp_path / "runs", "--set", "model.dim=16", "model.qkv_dim=8", "model.num_heads=2",
              "model.ffn_dim=16", "model.num_layers=1", "data.size=256", "data.max_len=128", "train.steps=6",
              "train.warmup_steps=4", "train.eval_every=3", "train.eval_batches=1", "train.test_batches=1",
              "train.log_every=1", "train.threads=1")
    assert ran.code == 0, ran.err
    (path,) = (tmp_path / "runs").glob("*/record.json")
    folder = path.parent
    record = json.loads((folder / "record.json").read_text())
    assert record["status"] == "completed" and record["steps"] == 6
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rates = [row["lr"] for row in logged if "lr" in row]
    # the line of step s holds the rate of its last optimizer step, s - 1 (0-based)
    assert rates == pytest.approx([0.05 * min(1.0, s / 4) / math.sqrt(max(s, 4)) for s in range(6)])


@pytest.mark.parametrize("preset, sets, values", [
    ("official", [], (0.9, 0.98, 1e-9)),
    ("paper", [], (0.9, 0.999, 1e-8)),
    ("official", ["train.beta2=0.95", "train.eps=1e-7"], (0.9, 0.95, 1e-7)),
], ids=["lra", "adamw", "set"])
def test_config_json_holds_every_value_of_the_optimizer(preset: str, sets: list, values: tuple) -> None:
    cfg = resolve("listops", "full", preset, sets)
    train = cfg.to_dict()["train"]
    assert (train["beta1"], train["beta2"], train["eps"]) == values
    group = make_optimizer(torch.nn.Linear(2, 2), cfg).param_groups[0]
    assert (*group["betas"], group["eps"]) == values


def test_a_config_json_without_the_optimizer_values_is_the_same_run() -> None:
    from lra.run.folder import same_run

    cfg = resolve("listops", "full", "official")
    saved = cfg.to_dict()
    for key in ("beta1", "beta2", "eps"):
        del saved["train"][key]
    assert same_run(saved, cfg)
    assert not same_run({**saved, "train": {**saved["train"], "beta2": 0.999}}, cfg)


def test_a_run_shorter_than_its_warmup_is_warned(cli: Callable, tmp_path: Path, listops_data: Path) -> None:
    ran = cli("lra-run", *TINY_LISTOPS, "--attn", "full", "--data-dir", listops_data, "--out", tmp_path,
              "--set", "train.warmup_steps=10")
    assert ran.code == 0, ran.err
    assert ("lra-run: warning: train.steps (4) is less than train.warmup_steps (10): the run ends in its warm-up, "
            "its learning rate never reaching train.lr (0.001); set train.warmup_steps below the steps for a run "
            "that does") in ran.err.splitlines()
