"""Files: where the package's own data lives, the one atomic writer every result, checkpoint,
table and generated file goes through (a kill never leaves half a file, a full disk gives one line
naming the file and leaves the old one; permissions as a plain open), and the folder lock that keeps
one process at a time in a run or data folder.

A lock is an ``flock`` on ``<folder>/.lock``; the holder writes its pid there. The OS drops the lock
when the holder exits or is killed, so a crash never leaves a folder stuck. Whoever holds the lock
may delete the temporary files (``.<name>.<random>``) an earlier, killed writer left: nobody else
can be writing them.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .errors import UserError

# what an atomic writer writes: bytes, or a function that writes to a binary file object
Data = Union[bytes, Callable[[Any], None]]


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


class WriteError(UserError):
    """A file could not be written (a full disk, a quota, a folder that became read-only): the message
    names the file and the cause. The file as it was stays, and no temporary file is left. lra-run
    exits with status 1 on it (its run stopped), every other command with status 2."""

    def __init__(self, path: Union[str, Path], err: Union[OSError, str], advice: str = "") -> None:
        self.path = Path(path)
        # the cause: an OSError's text ("No space left on device"), or that of an earlier WriteError
        self.strerror = err if isinstance(err, str) else (err.strerror or type(err).__name__)
        advice = advice or f"{self.path.name} is left as it was; free some space there and run the command again"
        super().__init__(f"cannot write {self.path}: {self.strerror}; {advice}")


class _Noting:
    """A binary file whose ``write`` keeps the OSError it raised: torch.save turns that error into an
    unrelated RuntimeError of its zip writer, and the error a user needs is the first one."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.error: Optional[OSError] = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def write_atomic_set(files: Sequence[Tuple[Path, Data]], advice: str = "") -> None:
    """Write every ``(path, data)`` to a temporary file beside it, then rename them into place in the
    given order: either all are replaced or (a write failed) none, with no temporary file left.
    ``data`` is bytes or a function that writes to a binary file object. A failed write is a WriteError
    (``advice``: what its message tells the user to do; by default, free space and run again)."""
    written: List[Tuple[str, Path]] = []
    try:
        for path, data in files:
            path = Path(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            except OSError as err:
                raise WriteError(path, err, advice) from None
            written.append((tmp, path))
            noting: Optional[_Noting] = None
            try:
                with os.fdopen(fd, "wb") as f:
                    if isinstance(data, (bytes, bytearray)):
                        f.write(data)
                    else:
                        noting = _Noting(f)
                        data(noting)
                os.chmod(tmp, plain_mode())
            except Exception as err:
                cause = err if isinstance(err, OSError) else (noting.error if noting is not None else None)
                if cause is None:
                    raise
                raise WriteError(path, cause, advice) from None
        for tmp, path in written:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise


def write_atomic(path: Path, data: Data, advice: str = "") -> None:
    """Write ``data`` (bytes, or a function that writes to a binary file object) to a temporary file
    in the same folder, then rename it to ``path``: a kill leaves the old file or the new, never half;
    a full disk leaves the old one and raises WriteError."""
    write_atomic_set([(path, data)], advice)


def write_json_atomic(path: Path, data: Dict[str, Any], advice: str = "") -> None:
    """``data`` as indented JSON, written atomically."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode(), advice)


def output_folder(given: Optional[str], default: str) -> Path:
    """A command's --out folder, made: ``given``, else ``default``-<date>-<time>; a folder that cannot be
    made is a UserError."""
    out = Path(given or f"{default}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    check_folder_arg(out, "--out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create the folder ({err.strerror})")
    return out


def check_folder_arg(path: Union[str, Path], flag: str) -> None:
    """A folder argument that names an existing file is a UserError (checked before a command reads or
    writes anything); a missing folder is fine: the command makes it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; give a folder (it is made when missing)")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder; give a folder (it is made when missing)")


LOCK_NAME = ".lock"


class FolderLock:
    """An exclusive lock on ``folder``; ``release`` (or the end of the process) gives it back."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: Optional[int] = None

    def acquire(self, wait: bool, busy: str = "", note: str = "") -> bool:
        """Take the lock; returns whether another process held it first (and ``wait`` waited for it).

        Without ``wait``, a held lock is a UserError: ``busy``. With it, ``note`` (if any) goes to stderr
        while waiting. Both may name {folder} and {pid}.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            pid = holder_pid(fd)
            if not wait:
                os.close(fd)
                raise UserError(busy.format(folder=self.folder, pid=pid))
            if note:
                print(note.format(folder=self.folder, pid=pid), file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = True
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            # a full disk: the lock holds all the same; only the holder's pid goes unnamed ("unknown")
            pass
        self.fd = fd
        return waited

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(fd: int) -> str:
    """The pid the holder wrote into the lock file ("unknown" if it has not written it yet)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return text if text.isdigit() else "unknown"


def remove_temporaries(folder: Path, names: Iterable[str]) -> None:
    """Delete ``.<name>.*`` files and folders in ``folder``: what a killed atomic write of ``name`` left.

    Call it only while holding the folder's lock.
    """
    for name in names:
        for leftover in Path(folder).glob(f".{name}.*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
