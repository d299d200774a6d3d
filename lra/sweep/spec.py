"""A sweep's spec: axes (tasks x backends x seeds x presets x ``--set`` values) and extra runs, expanded
to the ``lra-run`` runs they name.

The same spec comes from flags (``--task listops,text --attn full,mita --seeds 0,1,2 --set
train.lr=1e-3,3e-4``) or from a YAML file of the same axes::

    task: [listops, text]
    attn: [full, mita]
    seeds: [0, 1, 2]
    preset: [cpu]
    set: {train.lr: [1.0e-3, 3.0e-4], attn.topk: [32]}
    extra:                        # runs outside the grid, each a mapping of one run's values
      - {task: listops, attn: mita, seed: 0, preset: cpu, set: [attn.topk=64]}
    data_dir: data                # optional: lra-run --data-dir, the same for every run
    configs: [my_layer.yaml]      # optional: lra-run --config files, applied to every run
    attn_modules: [my_attn.py]    # optional: lra-run --attn-module files

Every field that takes a list also takes one value, read as a one-element list (``configs:
my_layer.yaml``).

Every run is resolved (lra.config.resolve) when the spec is read, so an unknown task, backend,
preset or key fails before anything is written or submitted.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ..errors import UserError
from ..format import clip

# a grid larger than this is a typo (an axis pasted twice), not a sweep anyone runs
MAX_RUNS = 10_000
AXES = ("task", "attn", "seeds", "preset", "set")
SPEC_KEYS = AXES + ("extra", "data_dir", "configs", "attn_modules")
EXTRA_KEYS = ("task", "attn", "seed", "preset", "set")


@dataclass(frozen=True)
class RunSpec:
    """One ``lra-run``: its flags, and the key that names it in the sweep's own files."""

    task: str
    attn: str
    preset: str
    seed: int
    sets: tuple = ()

    @property
    def name(self) -> str:
        """The run's name by its flags; its folder is lra.run.folder.run_name of the resolved config, which
        adds a task's level tag (``mqar-L128-p32_...``) and any ``-N``."""
        return f"{self.task}_{self.attn}_{self.preset}_seed{self.seed}"

    @property
    def key(self) -> str:
        """Unique within a sweep: the name, and a digest of the ``--set`` values when there are any."""
        if not self.sets:
            return self.name
        return f"{self.name}.{hashlib.sha1(' '.join(self.sets).encode()).hexdigest()[:8]}"

    @property
    def label(self) -> str:
        return self.name + (f" [{' '.join(self.sets)}]" if self.sets else "")


@dataclass
class SweepSpec:
    tasks: List[str]
    attns: List[str]
    seeds: List[int]
    presets: List[str]
    # section.key -> the values it takes (each a string as --set writes it)
    sets: Dict[str, List[str]] = field(default_factory=dict)
    extra: List[RunSpec] = field(default_factory=list)
    data_dir: Optional[str] = None
    configs: List[str] = field(default_factory=list)
    attn_modules: List[str] = field(default_factory=list)

    def runs(self) -> List[RunSpec]:
        """The grid, in order (task, backend, preset, seed, set values), then the extra runs; each once."""
        combos = list(itertools.product(*(
            [canonical(key, value) for value in values] for key, values in self.sets.items()
        ))) if self.sets else [()]
        size = len(self.tasks) * len(self.attns) * len(self.presets) * len(self.seeds) * len(combos) + len(self.extra)
        if size > MAX_RUNS:
            raise UserError(f"the sweep expands to {size} runs; at most {MAX_RUNS} are allowed (check the axes)")
        grid = [RunSpec(t, a, p, s, tuple(c)) for t, a, p, s, c in
                itertools.product(self.tasks, self.attns, self.presets, self.seeds, combos)]
        out: Dict[str, RunSpec] = {}
        for run in grid + self.extra:
            out.setdefault(run.key, run)
        if not out:
            raise UserError("the sweep is empty: give at least one task, backend, seed and preset")
        return list(out.values())

    def to_dict(self) -> Dict[str, Any]:
        return {
            "task": self.tasks, "attn": self.attns, "seeds": self.seeds, "preset": self.presets,
            "set": {k: list(v) for k, v in self.sets.items()},
            "extra": [{"task": r.task, "attn": r.attn, "seed": r.seed, "preset": r.preset, "set": list(r.sets)}
                      for r in self.extra],
            "data_dir": self.data_dir, "configs": self.configs, "attn_modules": self.attn_modules,
        }


def canonical(key: str, value: Any) -> str:
    """``key=value`` with the value written one way (1e-3, 1.0e-3 and 0.001 alike: 0.001), so that a run
    has one key however its values were typed; lra-run reads the result back to the same value."""
    from ..config import parse_set

    _, _, parsed = parse_set(f"{key}={value}")
    if isinstance(parsed, bool):
        text = "true" if parsed else "false"
    elif isinstance(parsed, float):
        text = repr(parsed)
    else:
        text = str(value)
    return f"{key}={text}"


def split_list(flag: str, text: str) -> List[str]:
    """``a,b,c`` -> [a, b, c]; an empty item is an error naming the flag."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise UserError(f"{flag} {text!r}: give comma-separated values without empty items, e.g. {flag} a,b")
    return items


def seeds_of(flag: str, values: Sequence[Any]) -> List[int]:
    out = []
    for value in values:
        try:
            seed = int(str(value))
        except ValueError:
            raise UserError(f"{flag}: {value!r} is not a seed; give whole numbers 0 or more, e.g. 0,1,2")
        if seed < 0:
            raise UserError(f"{flag}: seed {seed} is negative; give whole numbers 0 or more, e.g. 0,1,2")
        out.append(seed)
    return out


def set_axis(items: Sequence[str]) -> Dict[str, List[str]]:
    """``--set train.lr=1e-3,3e-4 attn.topk=32`` -> {train.lr: [1e-3, 3e-4], attn.topk: [32]}."""
    axis: Dict[str, List[str]] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"--set {item!r} must look like section.key=value[,value...], e.g. train.lr=1e-3,3e-4")
        key, values = item.split("=", 1)
        if key in axis:
            raise UserError(f"--set names {key} twice; give its values once, comma-separated: {key}=a,b")
        axis[key] = split_list(f"--set {key}=", values)
    return axis


def from_flags(tasks: str, attns: str, seeds: str, presets: str, sets: Sequence[str],
               data_dir: Optional[str], configs: Sequence[str], attn_modules: Sequence[str]) -> SweepSpec:
    return SweepSpec(
        tasks=split_list("--task", tasks), attns=split_list("--attn", attns),
        seeds=seeds_of("--seeds", split_list("--seeds", seeds)), presets=split_list("--preset", presets),
        sets=set_axis(sets), data_dir=data_dir, configs=list(configs), attn_modules=list(attn_modules),
    )


def path_list(origin: str, key: str, value: Any) -> List[str]:
    """``configs`` and ``attn_modules``: a list of paths, or one path (a one-element list)."""
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise UserError(f"{origin}: {key} must be a path or a list of paths, got {clip(repr(value), 80)}")
    return values


def as_list(origin: str, key: str, value: Any) -> List[Any]:
    """A YAML axis: a list of scalars, or one scalar."""
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, (list, dict)) or v is None for v in values):
        raise UserError(f"{origin}: {key} must be a value or a non-empty list of values, got {clip(repr(value), 80)}")
    return values


def from_yaml(path: str, origin: str = "") -> SweepSpec:
    """The spec in a YAML file; every problem is one UserError that starts with ``origin`` (default
    ``--spec PATH``, the flag that named the file)."""
    file = Path(path)
    origin = origin or f"--spec {path}"
    try:
        values = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{origin}: no such file; give a YAML file with the axes {', '.join(AXES)}")
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{origin} is not readable YAML ({clip(str(err), 200)}); see lra-sweep run --help for the format")
    if not isinstance(values, dict):
        raise UserError(f"{origin}: expected a mapping with the axes {', '.join(AXES)}, got {type(values).__name__}")
    unknown = sorted(set(values) - set(SPEC_KEYS))
    if unknown:
        raise UserError(f"{origin}: unknown key {unknown[0]!r}; valid keys: {', '.join(SPEC_KEYS)}")
    raw_sets = values.get("set") or {}
    if not isinstance(raw_sets, dict):
        raise UserError(f"{origin}: set must map section.key to its values, e.g. {{train.lr: [1.0e-3, 3.0e-4]}}")
    sets = {}
    for key, axis in raw_sets.items():
        if not isinstance(key, str) or "." not in key:
            raise UserError(f"{origin}: set key {key!r} must look like section.key, e.g. train.lr")
        sets[key] = [str(v) for v in as_list(origin, f"set.{key}", axis)]
    extra = [extra_run(origin, i, item) for i, item in enumerate(values.get("extra") or [])]
    has_grid = any(values.get(k) is not None for k in ("task", "attn", "seeds", "preset"))
    spec = SweepSpec(
        tasks=[str(v) for v in as_list(origin, "task", values["task"])] if has_grid and "task" in values else [],
        attns=[str(v) for v in as_list(origin, "attn", values["attn"])] if has_grid and "attn" in values else [],
        seeds=seeds_of(f"{origin}: seeds", as_list(origin, "seeds", values.get("seeds", 0))) if has_grid else [],
        presets=[str(v) for v in as_list(origin, "preset", values.get("preset", "paper"))] if has_grid else [],
        sets=sets, extra=extra, data_dir=optional_str(origin, "data_dir", values.get("data_dir")),
        configs=path_list(origin, "configs", values.get("configs")),
        attn_modules=path_list(origin, "attn_modules", values.get("attn_modules")),
    )
    if has_grid and (not spec.tasks or not spec.attns):
        raise UserError(f"{origin}: a grid needs both task and attn (seeds default to 0, preset to paper)")
    return spec


def optional_str(origin: str, key: str, value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise UserError(f"{origin}: {key} must be a path, got {clip(repr(value), 60)}")
    return value


def extra_run(origin: str, index: int, item: Any) -> RunSpec:
    where = f"{origin}: extra[{index}]"
    if not isinstance(item, dict) or "task" not in item or "attn" not in item:
        raise UserError(f"{where} must be a mapping with at least task and attn (and seed, preset, set)")
    unknown = sorted(set(item) - set(EXTRA_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(EXTRA_KEYS)}")
    sets = item.get("set") or []
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
        raise UserError(f"{where}: set must be a list of section.key=value strings, e.g. [attn.topk=64]")
    return RunSpec(str(item["task"]), str(item["attn"]), str(item.get("preset", "paper")),
                   seeds_of(f"{where}: seed", [item.get("seed", 0)])[0],
                   tuple(canonical(*s.split("=", 1)) for s in sets))


def check_runs(spec: SweepSpec, runs: List[RunSpec]) -> None:
    """Resolve every run's config as lra-run would: an unknown axis value fails here, naming the run."""
    from attentions import AttentionError, load_attention_module

    from ..config import resolve
    from ..tasks import get_task

    try:
        for path in spec.attn_modules:
            load_attention_module(path)
    except AttentionError as err:
        raise UserError(str(err))
    if spec.data_dir is not None and not Path(spec.data_dir).is_dir():
        raise UserError(f"data_dir {spec.data_dir} is not a folder; give the folder that holds the tasks' files")
    for run in runs:
        try:
            get_task(run.task)
            resolve(run.task, run.attn, run.preset, list(run.sets), seed=run.seed, configs=spec.configs)
        except (UserError, AttentionError) as err:
            raise UserError(f"run {run.label}: {err}")
