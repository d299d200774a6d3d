"""One process at a time in a folder, and the temporary files a killed writer leaves behind.

A lock is an ``flock`` on ``<folder>/.lock``; the holder writes its pid there. The OS drops the lock
when the holder exits or is killed, so a crash never leaves a folder stuck. Whoever holds the lock
may delete the temporary files (``.<name>.<random>``) an earlier, killed writer left: nobody else
can be writing them.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path
from typing import Iterable, Optional

from .errors import UserError

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
