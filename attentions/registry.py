"""Register attention backends by name and build them from a name plus overrides.

    @register("mine")
    class MyAttention(Attention): ...

    attn = build_attention("mine", num_heads=2, head_dim=32, max_len=2000, some_param=3)

Backends come from this package (the modules of ``BUILTINS`` in ``attentions/backends/``: a new
built-in is one file there, its name in that list, and its YAML values for LRA runs in
lra/configs/attn/), from a user's file
(``load_attention_module``) or from installed packages that expose them through the entry-point
group ``lra.attentions``. Listings put the built-ins first, in their ``order``.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Dict, List, Type

from .base import Attention, AttentionError, AttnDims

# the modules of attentions/backends/ that register the built-in backends, imported on first use
BUILTINS = ("full", "linear", "linformer", "moba", "topk", "agent", "mita", "local", "sparse_transformer",
            "longformer", "cosformer", "synthesizer", "reformer", "informer", "performer", "nystromformer",
            "ttt", "bigbird", "sinkhorn", "skyformer", "kernelized", "none")

_REGISTRY: Dict[str, Type[Attention]] = {}
_builtins_loaded = False
_ENTRY_POINT_GROUP = "lra.attentions"
_plugins_loaded = False
# user files already imported (resolved path -> the names they registered): a file runs once per process
_loaded_files: Dict[Path, List[str]] = {}


def register(name: str) -> Callable[[Type[Attention]], Type[Attention]]:
    """Class decorator: make ``cls`` buildable as ``name``. A name can be registered once."""

    def decorate(cls: Type[Attention]) -> Type[Attention]:
        if not (isinstance(cls, type) and issubclass(cls, Attention)):
            raise AttentionError(f"@register({name!r}) must decorate a subclass of attentions.Attention")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise AttentionError(collision(name, _REGISTRY[name], cls))
        if not dataclasses.is_dataclass(cls.Config):
            raise AttentionError(f"{cls.__name__}.Config must be a dataclass of the backend's hyperparameters")
        # a missing taxonomy is not refused here: lra-check-attn reports it as that backend's failure,
        # so one incomplete backend does not stop the others of its file from loading and being checked
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def source_of(cls: type) -> str:
    """The file that defines ``cls`` (its module's name when it has none)."""
    return getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__


def collision(name: str, registered: Type[Attention], new: type) -> str:
    """Why ``new`` cannot take ``name``: which file asked for it, who has it, and what to do instead."""
    if _builtin(registered):
        holder = f"the built-in backend {name!r} ({registered.__module__.replace('.', '/')}.py)"
    else:
        holder = f"the backend {name!r} of {source_of(registered)}"
    return (f"{source_of(new)}: @register({name!r}) takes the name of {holder}; register it under a name of its "
            f"own, e.g. @register({name + '_mine'!r}) (a wrapper of a built-in subclasses it and takes a new name: "
            "docs/backends.md, 'Adding a backend')")


def _load_builtins() -> None:
    """Import the modules of BUILTINS (their ``@register`` decorators run)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTINS:
        importlib.import_module(f"{__package__}.backends.{module}")


def _builtin(cls: Type[Attention]) -> bool:
    return cls.__module__.startswith(f"{__package__}.")


def _load_entry_points() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    try:
        eps = entry_points(group=_ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10
        eps = entry_points().get(_ENTRY_POINT_GROUP, [])
    for ep in eps:
        ep.load()


def load_attention_module(path: str) -> List[str]:
    """Import a user's Python file so that its ``@register`` decorators run; return the names it registers.

    A file already imported in this process is not run again (its classes stay registered).
    """
    file = Path(path)
    if not file.is_file() or file.suffix != ".py":
        raise AttentionError(f"--attn-module {path!r} is not a Python file; give the path of a .py file")
    if file.resolve() in _loaded_files:
        return list(_loaded_files[file.resolve()])
    # built-ins first, so that a file importing one of them does not count it among its own names
    _load_builtins()
    before = set(_REGISTRY)
    module_name = f"lra_user_attention_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except AttentionError:
        raise
    except Exception as err:  # the user's file failed to import: say which file and why
        del sys.modules[module_name]
        raise AttentionError(f"could not import {path}: {type(err).__name__}: {err}") from err
    _loaded_files[file.resolve()] = sorted(set(_REGISTRY) - before)
    return list(_loaded_files[file.resolve()])


def list_attentions(timing: bool = False) -> List[str]:
    """Every registered backend name: the built-ins in their ``order``, then the others by name.
    Timing references (``Attention.timing_only``: ``none``) only with ``timing=True``."""
    _load_builtins()
    _load_entry_points()
    names = [n for n in _REGISTRY if timing or not _REGISTRY[n].timing_only]
    return sorted(names, key=lambda n: (not _builtin(_REGISTRY[n]), _REGISTRY[n].order, n))


def is_timing_reference(name: str) -> bool:
    """Whether ``name`` is a registered timing reference (``none``), not a backend to train or tabulate."""
    list_attentions()
    return name in _REGISTRY and _REGISTRY[name].timing_only


def get_attention(name: str) -> Type[Attention]:
    """The class registered as ``name``; an unknown name lists the known ones."""
    known = list_attentions()
    if name not in _REGISTRY:
        raise AttentionError(f"unknown attention {name!r}; known: {', '.join(known)}")
    return _REGISTRY[name]


def scaling_of(name: str) -> str:
    """The family of backend ``name``: its taxonomy's scaling strategy ("routing", "compression", "both",
    "none"), or "unregistered" for a name the registry lacks (a record of a backend since removed)."""
    list_attentions()
    return _REGISTRY[name].taxonomy.scaling if name in _REGISTRY else "unregistered"


def origin(name: str) -> str:
    """Where backend ``name`` comes from: "built-in", the user's file (relative to the working folder
    when inside it), or the module of an installed entry point."""
    cls = get_attention(name)
    if _builtin(cls):
        return "built-in"
    module = cls.__module__
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return f"{module} (entry point)"
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def config_fields(name: str) -> Dict[str, Any]:
    """The backend's hyperparameters and their types, e.g. {"topk": int}."""
    cls = get_attention(name)
    hints = typing.get_type_hints(cls.Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls.Config)}


def coerce(key: str, value: Any, kind: Any) -> Any:
    """``value`` checked against the annotated type ``kind``; a wrong type is an error naming ``key``.

    Optional[X] takes None; a float takes an int or a string that reads as a number ("3e-4": YAML
    1.1 reads 3e-4, without a dot, as a string); a bool is never a number. Types other than int,
    float, str and bool are not checked. lra's run configuration uses the same rules.
    """
    if typing.get_origin(kind) is typing.Union:
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(o for o in options if o is not type(None))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if kind in (int, float, str, bool) and type(value) is not kind:
        raise AttentionError(f"{key} must be {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


def build_config(name: str, overrides: Dict[str, Any]) -> Any:
    """The backend's Config with ``overrides`` applied; unknown keys and wrong types are errors."""
    cls = get_attention(name)
    fields = config_fields(name)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        valid = ", ".join(fields) if fields else "(none)"
        raise AttentionError(f"unknown option {unknown[0]!r} for attention {name!r}; valid: {valid}")
    values = {k: coerce(f"attn.{k}", v, fields[k]) for k, v in overrides.items()}
    return cls.Config(**values)


def build_attention(name: str, *, num_heads: int, head_dim: int, max_len: int, **overrides: Any) -> Attention:
    """Build backend ``name`` for heads of ``head_dim`` and sequences up to ``max_len`` tokens. An option
    past what a sequence holds (a block, window or bucket longer than max_len) is clamped to it, alike for
    every backend: the module's ``notices`` say which (``Attention.within_length``)."""
    cls = get_attention(name)
    cfg, notices = cls.within_length(build_config(name, overrides), max_len)
    attn = cls(AttnDims(num_heads=num_heads, head_dim=head_dim, max_len=max_len), cfg)
    attn.notices = notices
    return attn
