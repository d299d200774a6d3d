"""Run configuration: dataclasses are the schema, YAML files hold the values.

Precedence, lowest first:
    dataclass defaults
    < configs/tasks/<task>.yaml                  (model / train / data sections)
    < configs/attn/<attn>.yaml                   (the backend's options; its tasks.<task> section)
    < configs/presets/<preset>.yaml              (sections that apply to every task)
    < configs/tasks/<task>.yaml presets.<preset> (the preset's values for this task)
    < --set section.key=value                    (e.g. train.lr=3e-4 attn.topk=64)

Unknown keys and values of the wrong type are errors that name the key.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from attentions import AttentionError, build_config, list_attentions

from .errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ModelConfig:
    # encoder depth, width, heads and FFN width: the Nystromformer / Skyformer LRA re-runs
    num_layers: int = 2
    dim: int = 64
    num_heads: int = 2
    ffn_dim: int = 128
    dropout: float = 0.1
    # "mean" (over real tokens only) or "cls" (a learned token prepended to the sequence)
    pooling: str = "mean"


@dataclass
class TrainConfig:
    steps: int = 5000
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 1000
    # evaluate on the validation split every eval_every steps, on eval_batches batches (0 = all)
    eval_every: int = 50
    eval_batches: int = 0
    # the final test on the best checkpoint covers test_batches batches (0 = the whole test split)
    test_batches: int = 0
    grad_clip: float = 1.0
    # label-preserving augmentation of training batches: none, or dihedral (images whose label
    # survives rotations and flips: Pathfinder, Path-X)
    augment: str = "none"
    # write a per-step line to the run's metrics.jsonl every log_every steps
    log_every: int = 10
    # save a resumable checkpoint every checkpoint_every steps (0 = only at the end)
    checkpoint_every: int = 500
    # "auto" = cuda if available else cpu; or "cpu", "cuda", "cuda:1"
    device: str = "auto"
    # "auto" = bf16 autocast on CUDA, fp32 on the CPU; or "fp32", "bf16"
    precision: str = "auto"
    # torch CPU threads (0 = torch's default)
    threads: int = 0


@dataclass
class DataConfig:
    # where task files live (and where generated tasks are written)
    data_dir: str = "data"
    # sequence length (0 = the task's default)
    max_len: int = 0
    # generated tasks: training examples to generate (0 = the official size)
    size: int = 0
    # Pathfinder difficulty ("" = the task's default)
    level: str = ""
    # seed of the data generators
    seed: int = 0
    # processes for generators
    workers: int = 1
    # generate a synthetic task's missing files on first use (off when --data-dir is given)
    generate: bool = True


@dataclass
class RunConfig:
    task: str = "listops"
    attn: str = "full"
    preset: str = "paper"
    seed: int = 0
    # where the run's folder is created
    out: str = "results/runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # the backend's own hyperparameters (validated against its Config dataclass)
    attn_options: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


def list_presets() -> List[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "presets").glob("*.yaml"))


def read_yaml(path: Path) -> Dict[str, Any]:
    """A YAML mapping from ``path``; malformed YAML is a one-line error naming the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: malformed YAML ({getattr(err, 'problem', err)})")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _coerce(key: str, value: Any, kind: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # YAML 1.1 reads 3e-4 (no dot) as a string; accept it where a float is expected
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if type(value) is not kind:
        raise UserError(f"{key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _apply_section(cfg: RunConfig, name: str, values: Any, origin: str) -> None:
    if name == "attn":
        if not isinstance(values, dict):
            raise UserError(f"{origin}: section 'attn' must be a mapping of the backend's options")
        cfg.attn_options.update(values)
        return
    if name not in SECTIONS:
        raise UserError(f"{origin}: unknown section {name!r}; valid: {', '.join([*SECTIONS, 'attn'])}")
    if not isinstance(values, dict):
        raise UserError(f"{origin}: section {name!r} must be a mapping, got {values!r}")
    section = getattr(cfg, name)
    hints = typing.get_type_hints(SECTIONS[name])
    for key, value in values.items():
        if key not in hints:
            raise UserError(f"{origin}: unknown key {name}.{key}; valid: {', '.join(hints)}")
        setattr(section, key, _coerce(f"{name}.{key}", value, hints[key]))


def _apply_file(cfg: RunConfig, values: Dict[str, Any], origin: str, skip: tuple = ()) -> None:
    if not isinstance(values, dict):
        raise UserError(f"{origin}: expected a mapping of sections, got {type(values).__name__}")
    for name, section in values.items():
        if name not in skip:
            _apply_section(cfg, name, section, origin)


def parse_set(item: str) -> tuple:
    """``section.key=value`` -> ("section", "key", value parsed as YAML)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError(f"--set {item!r} must look like section.key=value, e.g. train.lr=3e-4 or attn.topk=64")
    path, raw = item.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        # YAML 1.1 reads 3e-4 as a string: numbers written that way are numbers here
        try:
            value = float(value)
        except ValueError:
            pass
    return section, key, value


def attn_options_for(values: Dict[str, Any], task: str, origin: Path) -> Dict[str, Any]:
    """A backend file's options for ``task``: its top-level values, then its ``tasks.<task>`` section."""
    per_task = values.pop("tasks", None) or {}
    if not isinstance(per_task, dict):
        raise UserError(f"{origin}: 'tasks' must be a mapping of task name to options, got {type(per_task).__name__}")
    section = per_task.get(task) or {}
    if not isinstance(section, dict):
        raise UserError(f"{origin}: 'tasks.{task}' must be a mapping of option to value, got {section!r:.60}")
    return {**values, **section}


def resolve(task: str, attn: str, preset: str = "paper", sets: Optional[List[str]] = None, seed: int = 0) -> RunConfig:
    """Build the run's configuration from the layers above. Every error is a UserError."""
    cfg = RunConfig(task=task, attn=attn, preset=preset, seed=seed)
    task_file = CONFIG_DIR / "tasks" / f"{task}.yaml"
    task_values = read_yaml(task_file) if task_file.exists() else {}
    _apply_file(cfg, task_values, str(task_file), skip=("presets",))

    attn_file = CONFIG_DIR / "attn" / f"{attn}.yaml"
    attn_values = read_yaml(attn_file) if attn_file.exists() else {}
    cfg.attn_options.update(attn_options_for(attn_values, task, attn_file))

    preset_file = CONFIG_DIR / "presets" / f"{preset}.yaml"
    if not preset_file.exists():
        raise UserError(f"unknown preset {preset!r}; valid: {', '.join(list_presets())}")
    preset_values = read_yaml(preset_file)
    task_presets = task_values.get("presets", {}) or {}
    if not isinstance(task_presets, dict):
        raise UserError(f"{task_file}: 'presets' must be a mapping of preset name to sections")
    if preset_values.pop("tasks_required", False) and preset not in task_presets:
        has = sorted(n.stem for n in (CONFIG_DIR / "tasks").glob("*.yaml") if preset in (read_yaml(n).get("presets") or {}))
        raise UserError(
            f"preset {preset!r} has no values for task {task!r} (none measured yet); "
            f"it exists for: {', '.join(has) or 'no task'}; use --preset paper or smoke"
        )
    _apply_file(cfg, preset_values, str(preset_file))
    _apply_file(cfg, task_presets.get(preset, {}) or {}, f"{task_file} presets.{preset}")

    for item in sets or []:
        section, key, value = parse_set(item)
        if section == "attn":
            cfg.attn_options[key] = value
        else:
            _apply_section(cfg, section, {key: value}, "--set")
    validate(cfg)
    return cfg


def _finite(v: float) -> bool:
    return isinstance(v, int) or math.isfinite(v)


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and v >= low


def _positive(v: float) -> bool:
    return _finite(v) and v > 0


# (value, test, what is valid): every number a run reads, checked when the config is resolved
RANGES: List[Tuple[str, Callable[[Any], bool], str]] = [
    ("--seed", _at_least(0), "0 or more"),
    ("model.num_layers", _at_least(1), "at least 1"),
    ("model.dim", _at_least(1), "at least 1"),
    ("model.num_heads", _at_least(1), "at least 1"),
    ("model.ffn_dim", _at_least(1), "at least 1"),
    ("model.dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("train.steps", _at_least(1), "at least 1"),
    ("train.batch_size", _at_least(1), "at least 1"),
    ("train.lr", _positive, "a positive, finite number"),
    ("train.weight_decay", _at_least(0), "0 or more, finite"),
    ("train.warmup_steps", _at_least(0), "0 or more"),
    ("train.eval_every", _at_least(1), "at least 1"),
    ("train.eval_batches", _at_least(0), "0 (all) or more"),
    ("train.test_batches", _at_least(0), "0 (all) or more"),
    ("train.grad_clip", _at_least(0), "0 (off) or more, finite"),
    ("train.log_every", _at_least(1), "at least 1"),
    ("train.checkpoint_every", _at_least(0), "0 (only at the end) or more"),
    ("train.threads", _at_least(0), "0 (torch's default) or more"),
    ("data.max_len", _at_least(0), "0 (the task's default) or more"),
    ("data.size", _at_least(0), "0 (the official size) or more"),
    ("data.seed", _at_least(0), "0 or more"),
    ("data.workers", _at_least(1), "at least 1"),
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
    if cfg.model.pooling not in ("mean", "cls"):
        raise UserError(f"model.pooling must be 'mean' or 'cls', got {cfg.model.pooling!r}")
    if cfg.model.dim % cfg.model.num_heads:
        raise UserError(f"model.dim ({cfg.model.dim}) must be divisible by model.num_heads ({cfg.model.num_heads})")
    if cfg.train.precision not in ("auto", "fp32", "bf16"):
        raise UserError(f"train.precision must be auto, fp32 or bf16, got {cfg.train.precision!r}")
    if cfg.attn not in list_attentions():
        raise UserError(f"unknown attention {cfg.attn!r}; known: {', '.join(list_attentions())}")
    try:
        build_config(cfg.attn, cfg.attn_options)
    except AttentionError as err:
        raise UserError(str(err)) from err
