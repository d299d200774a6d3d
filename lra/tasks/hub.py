"""The Hugging Face ``datasets`` fallback of the real-data tasks, tried only when the machine is online.

Text and Image read the user's files first. When there are none, the data set's own copy on the hub
is fetched with ``datasets.load_dataset``, but only after a quick check that the hub can be reached:
the ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` switches, else one TCP connection with a short
timeout. An offline machine gets the missing-data error at once instead of a long retry loop, and
still loads a copy it fetched before, from the token cache.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Dict, Optional
from urllib.parse import urlparse

import numpy as np

from ..errors import UserError
from .base import SPLITS

_TRUE = {"1", "true", "yes", "on"}


def offline_reason(timeout: float = 1.5) -> str:
    """Why the hub cannot be used now, or "" when it can. Never downloads anything."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return f"{host} is unreachable"
    return ""


def cache_ready(data_dir: str, task: str, key: str) -> bool:
    """Whether ``cached_splits`` already holds this key (its layout: <data_dir>/.cache/<task>-<key>/)."""
    return (Path(data_dir) / ".cache" / f"{task}-{key}").is_dir()


def cached_sizes(data_dir: str, task: str, key: str) -> Optional[Dict[str, int]]:
    """Rows per split of a cached copy (read from the .npy headers), or None when there is none."""
    if not cache_ready(data_dir, task, key):
        return None
    folder = Path(data_dir) / ".cache" / f"{task}-{key}"
    try:
        return {s: len(np.load(folder / f"{s}.labels.npy", mmap_mode="r")) for s in SPLITS}
    except (OSError, ValueError):
        return None


def load_hub(task: str, name: str, instead: str) -> Any:
    """``datasets.load_dataset(name)``; a failure is one line that says what to download instead."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{task}: the `datasets` package is not installed; {instead}")
    try:
        return datasets.load_dataset(name)
    except Exception as err:  # network, hub or cache errors all mean: use local files instead
        raise UserError(f"{task}: fetching {name} with `datasets` failed ({type(err).__name__}: {err}); {instead}")
