"""Files: where the package's own data lives, and the one atomic writer every result, checkpoint,
table and generated file goes through (a kill never leaves half a file; permissions as a plain open)."""
from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from .errors import UserError


def package_data(name: str) -> Path:
    """A folder shipped inside the ``lra`` package (``configs``, ``reference``), wherever it is
    installed: the source tree, an editable install or a wheel."""
    return Path(str(resources.files("lra") / name))


def plain_mode(folder: bool = False) -> int:
    """The permissions a plain ``open()`` (or ``mkdir``) gives a new file (folder): 0o666 (0o777) less
    the umask. ``tempfile`` makes its files 0o600 and folders 0o700; results and data are meant to be
    shared, so every atomic writer sets this mode before its rename."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def write_atomic(path: Path, data: Union[bytes, Callable[[Any], None]]) -> None:
    """Write ``data`` (bytes, or a function that writes to a binary file object) to a temporary file
    in the same folder, then rename it to ``path``: a kill leaves the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, (bytes, bytearray)):
                f.write(data)
            else:
                data(f)
        os.chmod(tmp, plain_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: Dict[str, Any]) -> None:
    """``data`` as indented JSON, written atomically."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def output_folder(given: Optional[str], default: str) -> Path:
    """A command's --out folder, made: ``given``, else ``default``-<date>-<time>; a folder that cannot be
    made is a UserError."""
    out = Path(given or f"{default}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create the folder ({err.strerror})")
    return out
