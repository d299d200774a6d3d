"""The checks of a resolved run configuration (lra/config.py): the bounds of every number a run
reads, the names a field may take, the attention's options, and the tracker's package. Each failure
is a UserError of one line naming the key, what it holds and what is valid."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, List, Tuple

from attentions import AttentionError, build_config, list_attentions

from .errors import UserError

if TYPE_CHECKING:
    from .config import RunConfig

# train.tracker: where the scalars of metrics.jsonl also go (lra/run/trackers.py)
TRACKERS = ("none", "tensorboard", "wandb")


def _finite(v: float) -> bool:
    return isinstance(v, int) or math.isfinite(v)


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and v >= low


def _within(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and low <= v <= high


def _positive(v: float) -> bool:
    return _finite(v) and v > 0


# upper bounds: far past any real run, low enough that a typo (an extra six zeros) is refused before
# the data are made, not hours into a run or at an overflow deep inside torch
MAX_STEPS = 100_000_000
MAX_BATCH = 65_536
# the longest sequence lra-bench measures is 1M tokens; LRA's longest task (Path-X) is 16K
MAX_LEN = 1 << 20
MAX_SIZE = 10_000_000
MAX_SEED = 2**32 - 1
MAX_WIDTH = 65_536
MAX_LAYERS = 1_024
MAX_PROCESSES = 1_024


def _upto(high: int, low_text: str) -> str:
    return f"{low_text} to {high:,}"


# (value, choices): every field whose value is one of a fixed set of names
CHOICES: List[Tuple[str, Tuple[str, ...]]] = [
    ("model.pooling", ("mean", "cls")),
    ("model.positions", ("learned", "sinusoidal")),
    ("model.head", ("mlp", "lra")),
    ("train.schedule", ("linear", "rsqrt", "cosine")),
    ("train.optimizer", ("adamw", "lra")),
    ("train.precision", ("auto", "fp32", "bf16")),
]


# (value, test, what is valid): every number a run reads, checked when the config is resolved
RANGES: List[Tuple[str, Callable[[Any], bool], str]] = [
    ("--seed", _within(0, MAX_SEED), _upto(MAX_SEED, "0")),
    ("model.num_layers", _within(1, MAX_LAYERS), _upto(MAX_LAYERS, "1")),
    ("model.dim", _within(1, MAX_WIDTH), _upto(MAX_WIDTH, "1")),
    ("model.num_heads", _within(1, MAX_WIDTH), _upto(MAX_WIDTH, "1")),
    ("model.ffn_dim", _within(1, 16 * MAX_WIDTH), _upto(16 * MAX_WIDTH, "1")),
    ("model.dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("model.qkv_dim", _within(0, MAX_WIDTH), _upto(MAX_WIDTH, "0 (model.dim)")),
    ("train.steps", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0 (evaluate the initial weights, no training)")),
    ("train.batch_size", _within(1, MAX_BATCH), _upto(MAX_BATCH, "1")),
    ("train.lr", _positive, "a positive, finite number"),
    ("train.weight_decay", _at_least(0), "0 or more, finite"),
    # unset (None): train.optimizer's own, filled in when the config is resolved
    ("train.beta1", lambda v: v is None or (_finite(v) and 0.0 <= v < 1.0), "in [0, 1)"),
    ("train.beta2", lambda v: v is None or (_finite(v) and 0.0 <= v < 1.0), "in [0, 1)"),
    ("train.eps", lambda v: v is None or _positive(v), "a positive, finite number"),
    ("train.warmup_steps", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0")),
    ("train.steps_per_cycle", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0 (train.steps)")),
    ("train.eval_every", _within(1, MAX_STEPS), _upto(MAX_STEPS, "1")),
    ("train.eval_batches", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0 (all)")),
    ("train.test_batches", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0 (all)")),
    ("train.grad_clip", _at_least(0), "0 (off) or more, finite"),
    ("train.log_every", _within(1, MAX_STEPS), _upto(MAX_STEPS, "1")),
    ("train.checkpoint_every", _within(0, MAX_STEPS), _upto(MAX_STEPS, "0 (only at the end)")),
    ("train.threads", _within(0, MAX_PROCESSES), _upto(MAX_PROCESSES, "0 (torch's default)")),
    ("data.max_len", _within(0, MAX_LEN), _upto(MAX_LEN, "0 (the task's default)")),
    ("data.size", _within(0, MAX_SIZE), _upto(MAX_SIZE, "0 (the official size)")),
    ("data.seed", _within(0, MAX_SEED), _upto(MAX_SEED, "0")),
    ("data.pairs", _within(0, MAX_LEN), _upto(MAX_LEN, "0 (the task's default)")),
    ("data.vocab", _within(0, MAX_SIZE), _upto(MAX_SIZE, "0 (the task's default)")),
    ("data.workers", _within(1, MAX_PROCESSES), _upto(MAX_PROCESSES, "1")),
]


def _value(cfg: RunConfig, path: str) -> Any:
    value: Any = cfg
    for part in path.lstrip("-").split("."):
        value = getattr(value, part)
    return value


def validate(cfg: RunConfig) -> None:
    """Check values that have a fixed set of choices or a valid range."""
    for path, test, valid in RANGES:
        if not test(_value(cfg, path)):
            raise UserError(f"{path} must be {valid}, got {_value(cfg, path)!r}")
    for path, choices in CHOICES:
        if _value(cfg, path) not in choices:
            raise UserError(f"{path} must be one of {', '.join(choices)}, got {_value(cfg, path)!r}")
    width = cfg.model.qkv_dim or cfg.model.dim
    if width % cfg.model.num_heads:
        name = "model.qkv_dim" if cfg.model.qkv_dim else "model.dim"
        raise UserError(f"{name} ({width}) must be divisible by model.num_heads ({cfg.model.num_heads})")
    if cfg.train.schedule in ("rsqrt", "cosine") and cfg.train.warmup_steps == 0:
        raise UserError(f"train.schedule={cfg.train.schedule} divides by train.warmup_steps: give it 1 or more")
    check_tracker(cfg.train.tracker)
    if cfg.attn not in list_attentions():
        raise UserError(f"unknown attention {cfg.attn!r}; known: {', '.join(list_attentions())}")
    try:
        build_config(cfg.attn, cfg.attn_options)
    except AttentionError as err:
        raise UserError(str(err)) from err


def check_tracker(kind: str) -> None:
    """A tracker whose package is missing is refused before the run starts."""
    if kind not in TRACKERS:
        raise UserError(f"train.tracker must be one of {', '.join(TRACKERS)}, got {kind!r}")
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(kind)
    if module is None:
        return
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"train.tracker={kind} needs the {module} package: pip install {module} "
                        "(or pip install -e \".[track]\"), or use train.tracker=none")
