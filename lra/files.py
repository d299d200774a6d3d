"""File permissions shared by every writer: records, checkpoints, tables, generated data, caches."""
from __future__ import annotations

import os


def plain_mode(folder: bool = False) -> int:
    """The permissions a plain ``open()`` (or ``mkdir``) gives a new file (folder): 0o666 (0o777) less
    the umask. ``tempfile`` makes its files 0o600 and folders 0o700; results and data are meant to be
    shared, so every atomic writer sets this mode before its rename."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask
