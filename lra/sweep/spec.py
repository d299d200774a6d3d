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
    tune: {train.lr: [3.0e-4, 1.0e-3, 3.0e-3, 1.0e-2]}   # optional: tuned values (lra/tuning.py)
    select: val_acc               # what chooses among them (default val_acc)
    data_dir: data                # optional: lra-run --data-dir, the same for every run
    configs: [my_layer.yaml]      # optional: lra-run --config files, applied to every run
    attn_modules: [my_attn.py]    # optional: lra-run --attn-module files

Every field that takes a list also takes one value, read as a one-element list (``configs:
my_layer.yaml``). An ``attn`` item may carry values of its own, a backend in another form as a row of
its own: ``attn: [reformer, {reformer: {attn.form: chunked}}]``.

With ``tune``, the grid of the tuned values runs at the first seed for every cell (task x backend x
preset x the other ``set`` values); once a cell's grid has finished, its other seeds run at the point
``select`` chose (``lra/sweep/tune.py``). Without it, every seed runs every value.

Every run is resolved (lra.config.resolve) when the spec is read, so an unknown task, backend,
preset or key fails before anything is written or submitted.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from ..errors import UserError
from ..format import clip
from ..tuning import Grid, Point, make_grid, text

# a grid larger than this is a typo (an axis pasted twice), not a sweep anyone runs
MAX_RUNS = 10_000
AXES = ("task", "attn", "seeds", "preset", "set")
SPEC_KEYS = AXES + ("extra", "data_dir", "configs", "attn_modules", "tune", "select")
EXTRA_KEYS = ("task", "attn", "seed", "preset", "set")


@dataclass(frozen=True)
class RunSpec:
    """One ``lra-run``: its flags, and the key that names it in the sweep's own files."""

    task: str
    attn: str
    preset: str
    seed: int
    sets: tuple = ()
    # a tuned sweep's runs: the JSON of RunConfig.tuning (lra-run --tuning), "" otherwise
    tuning: str = ""

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


@dataclass(frozen=True)
class Backend:
    """One item of the ``attn`` axis: a backend, and values of its own (``--set`` items) that make a form
    of it a row of its own, e.g. Backend("reformer", ("attn.form=chunked",))."""

    name: str
    sets: Tuple[str, ...] = ()

    def to_yaml(self) -> Any:
        if not self.sets:
            return self.name
        return {self.name: {item.split("=", 1)[0]: item.split("=", 1)[1] for item in self.sets}}


# a tuned sweep's choices: cell -> (the chosen point, every grid point's score)
Decided = Dict[str, Tuple[Point, Dict[Point, Optional[float]]]]


@dataclass
class SweepSpec:
    tasks: List[str]
    attns: List[Backend]
    seeds: List[int]
    presets: List[str]
    # section.key -> the values it takes (each a string as --set writes it)
    sets: Dict[str, List[str]] = field(default_factory=dict)
    extra: List[RunSpec] = field(default_factory=list)
    data_dir: Optional[str] = None
    configs: List[str] = field(default_factory=list)
    attn_modules: List[str] = field(default_factory=list)
    # the tuned values (lra/tuning.py); the grid runs at its seed, the first of ``seeds``
    tune: Optional[Grid] = None

    def combos(self) -> List[Tuple[str, ...]]:
        """The --set axes' combinations, each as canonical items."""
        return [tuple(c) for c in itertools.product(*(
            [canonical(key, value) for value in values] for key, values in self.sets.items()
        ))] if self.sets else [()]

    def size(self) -> int:
        """How many runs the spec names: with tuning, the grid at its seed and each other seed at one point."""
        per_cell = len(self.seeds) if self.tune is None else len(self.tune.points()) + len(self.seeds) - 1
        return len(self.tasks) * len(self.attns) * len(self.presets) * len(self.combos()) * per_cell + len(self.extra)

    def cell(self, run: RunSpec) -> str:
        """What a run is but its seed and tuned values: task, backend, preset and the other values."""
        tuned = set(self.tune.keys) if self.tune is not None else set()
        kept = [item for item in run.sets if item.split("=", 1)[0] not in tuned]
        return " ".join([run.task, run.attn, run.preset, *kept])

    def runs(self, decided: Optional[Decided] = None) -> List[RunSpec]:
        """The grid, in order (task, backend, preset, seed, set values), then the extra runs; each once.
        With ``tune``: every grid point at its seed, and the other seeds of each cell in ``decided`` at
        the point chosen there (the cells not yet decided have no runs on those seeds yet)."""
        size = self.size()
        if size > MAX_RUNS:
            raise UserError(f"the sweep expands to {size} runs; at most {MAX_RUNS} are allowed (check the axes)")
        grid: List[RunSpec] = []
        for t, b, p, s, c in itertools.product(self.tasks, self.attns, self.presets, self.seeds, self.combos()):
            run = RunSpec(t, b.name, p, s, b.sets + c)
            if self.tune is None:
                grid.append(run)
            elif s == self.tune.seed:
                block = json.dumps(self.tune.block(), sort_keys=True)
                grid += [RunSpec(t, b.name, p, s, run.sets + tuple(self.tune.sets(point)), block)
                         for point in self.tune.points()]
            elif self.cell(run) in (decided or {}):
                point, scores = (decided or {})[self.cell(run)]
                block = json.dumps(self.tune.block(point, scores), sort_keys=True)
                grid.append(RunSpec(t, b.name, p, s, run.sets + tuple(self.tune.sets(point)), block))
        out: Dict[str, RunSpec] = {}
        for run in grid + self.extra:
            out.setdefault(run.key, run)
        if not out:
            raise UserError("the sweep is empty: give at least one task, backend, seed and preset")
        return list(out.values())

    def undecided(self, decided: Decided) -> List[RunSpec]:
        """A tuned sweep's runs still waiting for their cell's choice: each other seed of each cell not in
        ``decided``, its tuned values written ``<chosen>`` (for the dry run's list)."""
        if self.tune is None:
            return []
        waiting = []
        for t, b, p, s, c in itertools.product(self.tasks, self.attns, self.presets, self.seeds, self.combos()):
            run = RunSpec(t, b.name, p, s, b.sets + c)
            if s != self.tune.seed and self.cell(run) not in decided:
                waiting.append(RunSpec(t, b.name, p, s, run.sets + tuple(f"{k}=<chosen>" for k in self.tune.keys)))
        return waiting

    def to_dict(self) -> Dict[str, Any]:
        out = {
            "task": self.tasks, "attn": [b.to_yaml() for b in self.attns], "seeds": self.seeds, "preset": self.presets,
            "set": {k: list(v) for k, v in self.sets.items()},
            "extra": [{"task": r.task, "attn": r.attn, "seed": r.seed, "preset": r.preset, "set": list(r.sets)}
                      for r in self.extra],
            "data_dir": self.data_dir, "configs": self.configs, "attn_modules": self.attn_modules,
        }
        if self.tune is not None:
            # only a tuned spec has these keys: the saved spec of an untuned sweep reads as before
            out["tune"] = {k: list(vs) for k, vs in zip(self.tune.keys, self.tune.values)}
            out["select"] = self.tune.select
        return out

    def check_tune(self, origin: str) -> None:
        """A tuned key that is also an axis or a backend's own value would be set twice."""
        if self.tune is None:
            return
        if not self.seeds:
            raise UserError(f"{origin}: tune needs a grid (task, attn, seeds) to tune; extra runs are not tuned")
        for key in self.tune.keys:
            if key in self.sets:
                raise UserError(f"{origin}: {key} is both tuned and a set axis; give it in one of them")
            owner = next((b.name for b in self.attns if any(i.split("=", 1)[0] == key for i in b.sets)), None)
            if owner is not None:
                raise UserError(f"{origin}: {key} is both tuned and one of {owner}'s own values; give it in one of them")


def canonical(key: str, value: Any) -> str:
    """``key=value`` with the value written one way (1e-3, 1.0e-3 and 0.001 alike: 0.001), so that a run
    has one key however its values were typed; lra-run reads the result back to the same value."""
    from ..config import parse_set

    _, _, parsed = parse_set(f"{key}={value}")
    return f"{key}={str(value) if isinstance(parsed, str) else text(parsed)}"


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


def set_axis(items: Sequence[str], flag: str = "--set") -> Dict[str, List[str]]:
    """``--set train.lr=1e-3,3e-4 attn.topk=32`` -> {train.lr: [1e-3, 3e-4], attn.topk: [32]}."""
    axis: Dict[str, List[str]] = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"{flag} {item!r} must look like section.key=value[,value...], e.g. train.lr=1e-3,3e-4")
        key, values = item.split("=", 1)
        if key in axis:
            raise UserError(f"{flag} names {key} twice; give its values once, comma-separated: {key}=a,b")
        axis[key] = split_list(f"{flag} {key}=", values)
    return axis


def from_flags(tasks: str, attns: str, seeds: str, presets: str, sets: Sequence[str],
               data_dir: Optional[str], configs: Sequence[str], attn_modules: Sequence[str],
               tune: Sequence[str] = (), select: Optional[str] = None) -> SweepSpec:
    seed_list = seeds_of("--seeds", split_list("--seeds", seeds))
    spec = SweepSpec(
        tasks=split_list("--task", tasks), attns=[Backend(a) for a in split_list("--attn", attns)],
        seeds=seed_list, presets=split_list("--preset", presets),
        sets=set_axis(sets), data_dir=data_dir, configs=list(configs), attn_modules=list(attn_modules),
    )
    if tune:
        axis = set_axis(tune, "--tune")
        spec.tune = make_grid("--tune", axis, select or "val_acc", seed_list[0])
        spec.check_tune("--tune")
    elif select is not None:
        raise UserError("--select chooses among tuned values: give them with --tune, e.g. --tune train.lr=3e-4,1e-3")
    return spec


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
        attns=attn_axis(origin, values["attn"]) if has_grid and "attn" in values else [],
        seeds=seeds_of(f"{origin}: seeds", as_list(origin, "seeds", values.get("seeds", 0))) if has_grid else [],
        presets=[str(v) for v in as_list(origin, "preset", values.get("preset", "paper"))] if has_grid else [],
        sets=sets, extra=extra, data_dir=optional_str(origin, "data_dir", values.get("data_dir")),
        configs=path_list(origin, "configs", values.get("configs")),
        attn_modules=path_list(origin, "attn_modules", values.get("attn_modules")),
    )
    if has_grid and (not spec.tasks or not spec.attns):
        raise UserError(f"{origin}: a grid needs both task and attn (seeds default to 0, preset to paper)")
    if values.get("tune") is not None:
        if not spec.seeds:
            raise UserError(f"{origin}: tune needs a grid (task, attn, seeds) to tune; extra runs are not tuned")
        spec.tune = make_grid(origin, values["tune"], values.get("select", "val_acc"), spec.seeds[0])
        spec.check_tune(origin)
    elif values.get("select") is not None:
        raise UserError(f"{origin}: select chooses among tuned values: give them as tune, e.g. tune: {{train.lr: [3.0e-4, 1.0e-3]}}")
    return spec


def attn_axis(origin: str, value: Any) -> List[Backend]:
    """The ``attn`` axis: backend names, or one-key mappings of a backend to values of its own
    (``{reformer: {attn.form: chunked}}``)."""
    backends = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, dict) and len(item) == 1:
            name, own = next(iter(item.items()))
            if not isinstance(own, dict) or not own or not all(isinstance(k, str) and "." in k for k in own):
                raise UserError(f"{origin}: attn item {clip(repr(item), 80)} must map a backend to its own values, "
                                "e.g. {reformer: {attn.form: chunked}}")
            if any(isinstance(v, (list, dict)) or v is None for v in own.values()):
                raise UserError(f"{origin}: attn item {clip(repr(item), 80)}: each of its values must be one value")
            backends.append(Backend(str(name), tuple(canonical(k, v) for k, v in own.items())))
        elif isinstance(item, (str, int, float)) and not isinstance(item, bool) and str(item):
            backends.append(Backend(str(item)))
        else:
            raise UserError(f"{origin}: attn must be a backend or a list of backends (each a name, or a one-key "
                            f"mapping of a name to values of its own), got {clip(repr(item), 80)}")
    if not backends:
        raise UserError(f"{origin}: attn must name at least one backend")
    return backends


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
