"""The built-in backends' module paths at the package root (``attentions.mita``, ...), still importable.

Each resolves to the module in ``attentions.backends`` itself (the same module object, so setting a
name on it reaches the backend), with a DeprecationWarning that names the path to use.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

# the backends whose modules sat at the root of the package
MOVED = ("full", "linear", "linformer", "moba", "topk", "agent", "mita")


class _MovedBackend(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``attentions.<name>`` for a moved backend and loads ``attentions.backends.<name>`` in its place."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__.rpartition(".")[2]
        warnings.warn(
            f"{module.__name__} is now {__package__}.backends.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        # the import system returns what sys.modules holds once the loader is done
        sys.modules[module.__name__] = importlib.import_module(f"{__package__}.backends.{name}")


def install() -> None:
    """Make the old paths importable (once per process)."""
    if not any(isinstance(finder, _MovedBackend) for finder in sys.meta_path):
        sys.meta_path.append(_MovedBackend())
