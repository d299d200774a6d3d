"""Run configuration: dataclasses are the schema, YAML files hold the values.

Precedence, lowest first:
    dataclass defaults
    < configs/tasks/<task>.yaml                  (model / train / data sections)
    < configs/attn/<attn>.yaml                   (the backend's options; its tasks.<task> section)
    < configs/presets/<preset>.yaml              (sections that apply to every task)
    < configs/tasks/<task>.yaml presets.<preset> (the preset's values for this task)
    < --config FILE.yaml, in the order given     (a user's own layer: model / train / data / attn)
    < --set section.key=value                    (e.g. train.lr=3e-4 attn.topk=64)

configs/ is package data (lra/configs), read wherever the package is installed. A task or built-in
backend without its YAML file is an error (a broken install), never silently defaults; a backend
from a user's file may have none. Unknown keys and values of the wrong type are errors that name the key.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from attentions import AttentionError, is_timing_reference, origin
from attentions.registry import coerce

from .config_checks import (MAX_BATCH, MAX_LAYERS, MAX_LEN, MAX_PROCESSES, MAX_SEED, MAX_SIZE,  # noqa: F401
                            MAX_STEPS, MAX_WIDTH, TRACKERS, check_tracker, validate)
from .errors import UserError
from .files import package_data

CONFIG_DIR = package_data("configs")


@dataclass
class ModelConfig:
    # encoder depth, width, heads and FFN width: the Nystromformer / Skyformer LRA re-runs
    num_layers: int = 2
    dim: int = 64
    num_heads: int = 2
    ffn_dim: int = 128
    dropout: float = 0.1
    # attention width, split over the heads (head_dim = qkv_dim / num_heads), projected back to dim
    # after attention, as the LRA JAX SelfAttention's qkv_features; 0 = dim
    qkv_dim: int = 0
    # position embeddings added to the tokens: "learned" (a table initialised N(0, 0.02)) or "sinusoidal"
    # (the fixed sin/cos table of the LRA JAX AddPositionEmbs when learn_pos_emb is False)
    positions: str = "learned"
    # "mean" (over real tokens only) or "cls" (a learned token prepended to the sequence)
    pooling: str = "mean"
    # the classifier head: "mlp" (Linear(features, ffn_dim), ReLU, Linear(ffn_dim, classes); a dual
    # task's features are [u, v, u*v, u-v]) or "lra" (the LRA JAX heads: the same for one sequence;
    # for two, [u, v] through Linear(2 dim, ffn_dim), ReLU, Linear(ffn_dim, ffn_dim // 2), ReLU, Linear)
    head: str = "mlp"
    # the MiTA paper's output gate, for any backend: attention output x SiLU(g), g a fourth projection view
    gate: bool = False


@dataclass
class TrainConfig:
    steps: int = 5000
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 1000
    # the learning rate of step s (0-based), lra/run/loop.py lr_at: "linear" (warmup to lr, then
    # linear decay to 0), or the LRA JAX schedules (lra_benchmarks/utils/train_utils.py):
    # "rsqrt" = lr * min(1, s / warmup) / sqrt(max(s, warmup)) (lr is the constant, not the peak),
    # "cosine" = lr * min(1, s / warmup) * cosine decay over steps_per_cycle steps after the warmup
    schedule: str = "linear"
    # the cosine schedule's cycle length in steps (0 = train.steps)
    steps_per_cycle: int = 0
    # "adamw" (torch's AdamW at its defaults: betas 0.9 / 0.999, eps 1e-8) or "lra" (the LRA JAX
    # train scripts' flax Adam: betas 0.9 / 0.98, eps 1e-9, weight decay lr * weight_decay * w
    # taken from every weight at each step, which torch's AdamW computes the same way)
    optimizer: str = "adamw"
    # the optimizer's betas and eps; unset (None), those of train.optimizer (OPTIMIZER_VALUES), filled
    # in when the config is resolved, so a run's config.json holds every value its optimizer uses
    beta1: Optional[float] = None
    beta2: Optional[float] = None
    eps: Optional[float] = None
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
    # on the CPU, flush denormal floats to zero (torch.set_flush_denormal): weights or activations
    # that drift into the denormal range make each float operation on them many times slower, so a
    # run's train time can measure the CPU's denormal handling rather than the backend; off by
    # default, so a run repeats the values of the committed records to the last digit
    flush_denormal: bool = False
    # where the scalars of metrics.jsonl also go: none, tensorboard or wandb (lra/run/trackers.py); not
    # part of a run's identity (a run resumes under another tracker)
    tracker: str = "none"


# (beta1, beta2, eps) of each train.optimizer: torch's AdamW defaults; flax optim.Adam as the LRA
# JAX train scripts create it (listops/train.py:72-78 create_optimizer: beta1 0.9, beta2 0.98, eps 1e-9)
OPTIMIZER_VALUES = {"adamw": (0.9, 0.999, 1e-8), "lra": (0.9, 0.98, 1e-9)}


def fill_optimizer(train: Dict[str, Any]) -> Dict[str, Any]:
    """``train`` (a TrainConfig as a dict) with the betas and eps it leaves unset taken from its optimizer."""
    implied = OPTIMIZER_VALUES.get(train.get("optimizer", "adamw"), OPTIMIZER_VALUES["adamw"])
    return {**train, **{k: v for k, v in zip(("beta1", "beta2", "eps"), implied) if train.get(k) is None}}


@dataclass
class DataConfig:
    # where task files live (and where generated tasks are written)
    data_dir: str = "data"
    # sequence length (0 = the task's default)
    max_len: int = 0
    # generated tasks: training examples to generate (0 = the official size)
    size: int = 0
    # Pathfinder difficulty, MQAR formulation ("" = the task's default)
    level: str = ""
    # MQAR: key-value pairs per sequence and vocabulary size (0 = the task's default)
    pairs: int = 0
    vocab: int = 0
    # seed of the data generators
    seed: int = 0
    # processes for generators
    workers: int = 1
    # generate a synthetic task's missing files on first use, into data_dir (ListOps only: Pathfinder
    # and Path-X take hours, so they are generated by `lra-data generate`)
    generate: bool = True


@dataclass
class RunConfig:
    task: str = "listops"
    attn: str = "full"
    preset: str = "paper"
    seed: int = 0
    # where the run's folder is created (the committed reference records are in results/runs)
    out: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # the backend's own hyperparameters (validated against its Config dataclass)
    attn_options: Dict[str, Any] = field(default_factory=dict)
    # the run folder whose best weights this run starts from (lra-run --init-from; "" = a fresh
    # initialisation). Part of the run's identity: such a run never resumes or replaces a plain one
    init_from: str = ""
    # the tuning this run belongs to (lra/tuning.py: the grid, the criterion, the tuning seed and, on
    # the other seeds, the chosen point); set by lra-sweep (lra-run --tuning), {} otherwise. Not part of
    # the run's identity: the same values run outside the sweep are the same run
    tuning: Dict[str, Any] = field(default_factory=dict)

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
        try:
            setattr(section, key, coerce(f"{name}.{key}", value, hints[key]))
        except AttentionError as err:
            raise UserError(str(err)) from err


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


def backend_values(attn: str) -> Dict[str, Any]:
    """The values of configs/attn/<attn>.yaml: required for a built-in backend (one shipped in the
    ``attentions`` package), optional for one registered from a user's file (its Config defaults)."""
    path = CONFIG_DIR / "attn" / f"{attn}.yaml"
    if path.is_file():
        return read_yaml(path)
    try:
        builtin = origin(attn) == "built-in"
    except AttentionError as err:
        raise UserError(str(err)) from err
    if builtin:
        raise UserError(f"built-in attention {attn!r} has no configuration file {path}; the installation is "
                        "incomplete (reinstall the package)")
    return {}


def read_user_yaml(path: str) -> Dict[str, Any]:
    """A user's --config file: it must exist and hold sections (model, train, data, attn)."""
    if not Path(path).is_file():
        raise UserError(f"--config {path}: no such file; give a YAML file of sections (model, train, data, attn)")
    return read_yaml(Path(path))


def resolve(
    task: str, attn: str, preset: str = "paper", sets: Optional[List[str]] = None, seed: int = 0,
    configs: Optional[List[str]] = None,
) -> RunConfig:
    """Build the run's configuration from the layers above. Every error is a UserError."""
    if is_timing_reference(attn):
        raise UserError(f"{attn} is a timing reference (the model without attention), not a backend to train; "
                        "lra-bench and scripts/step_compare.py time it")
    cfg = RunConfig(task=task, attn=attn, preset=preset, seed=seed)
    task_file = CONFIG_DIR / "tasks" / f"{task}.yaml"
    if not task_file.is_file():
        raise UserError(f"task {task!r} has no configuration file {task_file}; the installation is incomplete "
                        "(reinstall the package)")
    task_values = read_yaml(task_file)
    _apply_file(cfg, task_values, str(task_file), skip=("presets", "refused_presets"))

    cfg.attn_options.update(attn_options_for(backend_values(attn), task, CONFIG_DIR / "attn" / f"{attn}.yaml"))

    preset_file = CONFIG_DIR / "presets" / f"{preset}.yaml"
    if not preset_file.exists():
        raise UserError(f"unknown preset {preset!r}; valid: {', '.join(list_presets())}")
    preset_values = read_yaml(preset_file)
    task_presets = task_values.get("presets", {}) or {}
    refused = task_values.get("refused_presets", {}) or {}
    if not isinstance(task_presets, dict) or not isinstance(refused, dict):
        raise UserError(f"{task_file}: 'presets' and 'refused_presets' must be mappings keyed by preset name")
    # the other presets this task runs, for the error messages below
    usable = ", ".join(["paper"] + sorted(n for n in task_presets if n != preset))
    if preset in refused:
        raise UserError(f"preset {preset!r} is refused for task {task!r}: {refused[preset]}; use --preset {usable}")
    # a preset marked tasks_required (cpu, smoke, official) runs only on the tasks that define their values
    # for it; the mark may be the reason a task has none
    required = preset_values.pop("tasks_required", False)
    if required and preset not in task_presets:
        has = sorted(n.stem for n in (CONFIG_DIR / "tasks").glob("*.yaml") if preset in (read_yaml(n).get("presets") or {}))
        why = required if isinstance(required, str) else "none measured yet"
        raise UserError(
            f"preset {preset!r} has no values for task {task!r} ({why}); "
            f"it exists for: {', '.join(has) or 'no task'}; use --preset {usable}"
        )
    _apply_file(cfg, preset_values, str(preset_file))
    _apply_file(cfg, task_presets.get(preset, {}) or {}, f"{task_file} presets.{preset}")

    for path in configs or []:
        _apply_file(cfg, read_user_yaml(path), path)
    for item in sets or []:
        section, key, value = parse_set(item)
        if section == "attn":
            cfg.attn_options[key] = value
        else:
            _apply_section(cfg, section, {key: value}, "--set")
    cfg.train = TrainConfig(**fill_optimizer(dataclasses.asdict(cfg.train)))
    validate(cfg)
    return cfg


def from_saved(saved: Dict[str, Any], origin: str) -> RunConfig:
    """The RunConfig a run folder's config.json holds (``origin`` names the file in errors); keys a
    later version added take their defaults, unknown keys and wrong types are errors."""
    cfg = RunConfig()
    hints = typing.get_type_hints(RunConfig)
    for key, value in saved.items():
        if key in SECTIONS:
            _apply_section(cfg, key, value, origin)
        elif key == "attn_options":
            _apply_section(cfg, "attn", value, origin)
        elif key in hints:
            try:
                setattr(cfg, key, coerce(key, value, hints[key]))
            except AttentionError as err:
                raise UserError(f"{origin}: {err}") from err
        else:
            raise UserError(f"{origin}: unknown key {key!r}; valid: {', '.join(f.name for f in dataclasses.fields(RunConfig))}")
    cfg.train = TrainConfig(**fill_optimizer(dataclasses.asdict(cfg.train)))
    validate(cfg)
    return cfg
