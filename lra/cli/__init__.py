"""The command lines' shared parts: ``Parser`` (one-line errors, exit 2) and ``guarded`` (user errors
as one line, never a traceback). Each command is its own module (run, data, check_attn here;
lra.bench.cli, lra.tables.cli and lra.analyze.cli); this module imports none of them.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, NoReturn, Optional

from attentions import AttentionError

from ..errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def guarded(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; turn user errors into one line and exit status 2."""
    try:
        return body()
    except (UserError, AttentionError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`lra-table | head`): not an error of ours; stdout goes nowhere from
        # now on, so that the interpreter's final flush does not complain either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def call(prog: str, main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]] = None) -> int:
    """What the console script does, without leaving the process: the exit status of ``prog argv``.
    argparse's own exits (--help, a bad flag) become their status too, so tests run commands in-process."""
    try:
        return guarded(prog, lambda: main(argv))
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)


def console(prog: str, main: Callable[[Optional[List[str]]], int]) -> NoReturn:
    """The body of a console script: run ``main`` on sys.argv and exit with its status."""
    sys.exit(call(prog, main))
